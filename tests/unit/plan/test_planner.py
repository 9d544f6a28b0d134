"""The memory planner's figures against what torch really holds on CPU: saved-tensor bytes of a forward
pass (``saved_tensors_hooks``), parameter bytes and the optimizer's state after a real step; its shards
scale with the layout; bad inputs give one line and exit 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import get_flavor
from torchtitan_ext.parallel.grad_norm import grad_norm
from torchtitan_ext.plan.__main__ import main
from torchtitan_ext.plan.estimate import GRADS, block_activations, head_activations, plan
from torchtitan_ext.train.losses import cross_entropy_loss
from torchtitan_ext.train.optim import Optimizers

TINY = ["--model.flavor", "debug", "--data.tokenizer", "byte", "--model.dim", "64", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_hidden", "128",
        "--training.seq_len", "32", "--training.local_batch_size", "2"]


def _tiny_model(args, dtype: torch.dtype) -> Decoder:
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    return model.to(dtype)


def _saved_bytes(model: Decoder, batch: int, seq: int) -> int:
    """Distinct storages autograd saves in forward + loss, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, model.args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy_loss(model(tokens), tokens)
    return sum(seen.values())


@pytest.mark.parametrize("name,overrides,dtype", [
    ("dense fp32", {}, torch.float32),
    ("dense bf16, no QK-norm", {"qk_norm": False}, torch.bfloat16),
    ("MoDE fp32", {"n_experts": 4, "top_k": 2, "moe_hidden": 96}, torch.float32),
    ("MoDE every 2nd layer bf16, squared ReLU, KV sharing", {"n_experts": 4, "top_k": 1, "moe_every": 2,
                                                            "activation": "relu2", "kv_share": "interleaved"},
     torch.bfloat16),
])
def test_activation_closed_form_matches_saved_tensors(name, overrides, dtype):
    """Within 1% (the RoPE tables' per-sequence casts, a few bytes per token, are not modelled)."""
    args = dataclasses.replace(get_flavor("debug"), vocab_size=384, max_seq_len=96, n_layers=2, **overrides)
    batch, seq = 4, 96
    act = 4 if dtype == torch.float32 else 2
    per_token = sum(sum(block_activations(args, i, act, norm="composite").values()) for i in range(args.n_layers))
    per_token += sum(head_activations(args, act, "composite", fused_ce=False).values())
    measured = _saved_bytes(_tiny_model(args, dtype), batch, seq)
    assert per_token * batch * seq == pytest.approx(measured, rel=0.01), name


def _tp_saved_bytes(rank: int, world: int, qk_norm: bool | tuple) -> int | list[int]:
    """Saved-tensor bytes of one TP rank (local shards of DTensors), loss parallel."""
    if isinstance(qk_norm, tuple):  # several models in one set of processes
        return [_tp_saved_bytes(rank, world, q) for q in qk_norm]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from torchtitan_ext.parallel.tp import apply_tp

    args = dataclasses.replace(get_flavor("debug"), vocab_size=384, max_seq_len=64, n_layers=2, qk_norm=qk_norm)
    with torch.device("meta"):
        model = Decoder(args)
    apply_tp(model, init_device_mesh("cpu", (world,)), True)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)

    tokens = torch.randint(0, args.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))

    def forward() -> None:
        with loss_parallel():
            cross_entropy_loss(model(tokens), tokens)
    return _local_saved_bytes(model, forward)


def _local_saved_bytes(model: torch.nn.Module, forward) -> int:
    """Distinct storages autograd saves while ``forward()`` runs, DTensors by their local shard, parameters
    excluded."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def test_tp_activations_match_saved_tensors_per_rank():
    """TP 2 with sequence and loss parallel, 2 gloo processes, with and without QK-norm: heads and hidden sizes
    halved, norms sequence-sharded, the projections' input all-gathered, the log-softmax vocabulary-sharded."""
    from dist_utils import run_distributed

    variants = (False, True)
    per_rank = run_distributed(_tp_saved_bytes, 2, variants)
    for i, qk_norm in enumerate(variants):
        args = dataclasses.replace(get_flavor("debug"), vocab_size=384, max_seq_len=64, n_layers=2, qk_norm=qk_norm)
        per_token = sum(sum(block_activations(args, j, 4, "composite", tp=2).values()) for j in range(2))
        per_token += sum(head_activations(args, 4, "composite", fused_ce=False, tp=2).values())
        for measured in per_rank:
            assert per_token * 4 * 64 == pytest.approx(measured[i], rel=0.01), qk_norm


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_parameter_and_optimizer_bytes_match_a_real_step(optimizer):
    cfg = parse_args([*TINY, "--optimizer.name", optimizer, "--training.mixed_precision_param", "float32"])
    p = plan(cfg, 1)
    from torchtitan_ext.models.flavors import resolve_model_args

    model = _tiny_model(resolve_model_args(cfg, 257), torch.float32)
    opt = Optimizers([model], cfg.optimizer)
    tokens = torch.randint(0, 257, (2, 32))
    cross_entropy_loss(model(tokens), tokens).backward()
    params = list(model.parameters())
    opt.step(params, grad_norm(params), max_norm=1.0)
    param_bytes = sum(q.numel() * 4 for q in model.parameters())
    state_bytes = sum(v.numel() * v.element_size() for o in opt.optimizers for s in o.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.ndim > 0)
    assert p.memory["parameters (fp32)"] == param_bytes
    assert p.memory[GRADS] == sum(q.grad.numel() * 4 for q in model.parameters())
    assert p.memory["optimizer state"] == state_bytes
    assert "autocast bf16 weight copies" not in p.memory  # float32: no casts


def test_shards_scale_with_the_layout():
    one = plan(parse_args(TINY), 1)
    fsdp4 = plan(parse_args(TINY), 4)
    for key in ("parameters (fp32)", GRADS, "optimizer state"):
        assert fsdp4.memory[key] == pytest.approx(one.memory[key] / 4)
    assert fsdp4.activations_no_ac == one.activations_no_ac  # the same micro-batch per rank
    n_params = one.memory["parameters (fp32)"] / 4
    # all-gather of the bf16 parameters, forward and backward, (n-1)/n of them from the other ranks
    assert fsdp4.comm["dp_shard all-gather (fwd + bwd, per micro-batch)"] == pytest.approx(2 * 2 * n_params * 3 / 4)
    assert fsdp4.comm["dp_shard reduce-scatter"] == pytest.approx(4 * n_params * 3 / 4)  # fp32 gradients
    squinch = plan(parse_args([*TINY, "--comm.gradient_compression", "squinch"]), 4)
    assert squinch.comm["dp_shard reduce-scatter"] == pytest.approx(fsdp4.comm["dp_shard reduce-scatter"] * 6 / 32)
    hsdp = plan(parse_args([*TINY, "--parallelism.dp_replicate", "2"]), 4)  # 2 x 2: all-reduce of the shards
    assert hsdp.memory["parameters (fp32)"] == pytest.approx(one.memory["parameters (fp32)"] / 2)
    assert hsdp.comm["dp_replicate all-reduce"] == pytest.approx(2 * 4 * n_params / 2 / 2)
    full = plan(parse_args([*TINY, "--activation_checkpoint.mode", "full"]), 1)
    tokens, layers = 2 * 32, 2
    per_layer = one.activations_no_ac / layers  # equal blocks here
    # each block keeps its bf16 input; one block is recomputed at a time
    assert full.memory["activations"] == pytest.approx(layers * 2 * 64 * tokens + per_layer)
    moe = [*TINY, "--model.n_experts", "4", "--model.top_k", "2", "--model.moe_hidden", "64"]
    ep1, ep2 = plan(parse_args(moe), 1), plan(parse_args([*moe, "--parallelism.ep", "2"]), 2)
    assert ep2.memory["parameters (fp32)"] == pytest.approx(ep1.memory["parameters (fp32)"] / 2)
    # all-to-all: dispatch + combine, forward + backward, of top_k copies per token, half to the other rank
    assert ep2.comm["ep all-to-all"] == pytest.approx(2 * 4 * tokens * 2 * 64 * 2 / 2)
    assert ep2.activations_no_ac == ep1.activations_no_ac
    tp2 = plan(parse_args([*TINY, "--parallelism.tp", "2"]), 2)
    assert tp2.memory["activations"] < one.memory["activations"]
    assert tp2.comm["tp all-gather / reduce-scatter of activations"] > 0


def test_cli_verdict_and_bad_inputs_one_line(capsys):
    ok = subprocess.run([sys.executable, "-m", "torchtitan_ext.plan", "--config", "train_configs/7b.toml", "--gpus",
                         "8"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "fits on 80 GiB" in ok.stdout and "tp all-gather" in ok.stdout
    assert main(["--config", "train_configs/7b.toml", "--gpus", "8", "--device-memory", "16"]) == 0
    assert "does not fit on 16 GiB" in capsys.readouterr().out
    for bad, expect in [
        (["--config", "train_configs/7b.toml", "--gpus", "0"], "--gpus: expected a finite number > 0"),
        (["--config", "train_configs/7b.toml", "--gpus", "x"], "--gpus: expected a number"),
        (["--config", "train_configs/7b.toml", "--gpus"], "--gpus: missing value"),
        (["--config", "train_configs/7b.toml", "--gpus", "6"], "the world size is 6"),
        (["--config", "train_configs/7b.toml", "--device-memory", "nan"], "--device-memory: expected a finite"),
        (["--config", "train_configs/mode_235b.toml", "--gpus", "128"], "ep = 64 must divide dp_shard = 32"),
        (["--config", "nope.toml"], "not found"),
        (["--config", "train_configs/7b.toml", "--gpus", "8", "--training.seq_len", "x"], "expected int"),
        (["--config", "train_configs/7b.toml", "--gpus", "8", "--model.n_kv_heads", "3"], "not divisible"),
    ]:
        assert main(bad) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], (bad, err)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"qk_norm": False}, {"qk_norm": True, "activation": "relu2"}])
def test_compiled_block_activations_match_inductor_saved_tensors(overrides):
    """What inductor's partitioner keeps for a compiled block (CPU inductor; the same partitioner as on GPU):
    norm input + reciprocal RMS, the projections' inputs, q, k, v, output + LSE, three SwiGLU hidden tensors
    (two for squared ReLU). Within 1% (RoPE tables not modelled)."""
    from torchtitan_ext.models.decoder import Block, rope_tables

    args = dataclasses.replace(get_flavor("debug"), vocab_size=384, max_seq_len=128, n_layers=2, **overrides)
    block = Block(args, 0).to(torch.bfloat16)
    cos, sin = rope_tables(args)
    x = torch.randn(4, 128, args.dim, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block)
    compiled(x, (cos[None], sin[None]))[0].sum().backward()  # compile outside the hooks
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x, (cos[None], sin[None]))
    planned = sum(block_activations(args, 0, 2, norm="fused", compiled=True).values()) * 4 * 128
    assert planned == pytest.approx(sum(seen.values()), rel=0.01)


def _compiled_tp_sac_block_bytes(rank: int, world: int) -> int:
    """Saved bytes of one compiled TP block under op-level selective AC on this rank: the model with 2 blocks
    minus the one with 1 (the embedding's and the head's shares cancel)."""
    return _compiled_tp_sac_saved_bytes(2, world) - _compiled_tp_sac_saved_bytes(1, world)


def _compiled_tp_sac_saved_bytes(layers: int, world: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing
    from torchtitan_ext.parallel.compile import apply_compile
    from torchtitan_ext.parallel.tp import apply_tp

    torch._dynamo.reset()
    args = dataclasses.replace(get_flavor("debug"), vocab_size=384, max_seq_len=64, n_layers=layers)
    with torch.device("meta"):
        model = Decoder(args)
    apply_tp(model, init_device_mesh("cpu", (world,)), False)
    apply_activation_checkpointing(model, "selective", 0)
    apply_compile(model, experts_in_graph=False, tensor_parallel=True, compile_head=False)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, args.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()  # compile outside the hooks
    return _local_saved_bytes(model, lambda: model(tokens))


@pytest.mark.slow
def test_compiled_tp_selective_block_keeps_the_reduce_scattered_output():
    """TP 2 (sequence parallel), op-level selective AC, a compiled block (CPU inductor, 2 gloo processes): the
    saved bytes equal the planner's. The policy keeps TP's reduce-scatter outputs, so the partitioner keeps
    attention's reduce-scattered slice instead of wo's and w2's full partial sums, which it needed to redo the
    reduce-scatter in the backward (1.5 d_model activations per token more at TP 2, and one collective more)."""
    from dist_utils import run_distributed

    from torchtitan_ext.plan.estimate import selective_activations

    per_rank = run_distributed(_compiled_tp_sac_block_bytes, 2)
    args = dataclasses.replace(get_flavor("debug"), vocab_size=384, max_seq_len=64, n_layers=2)
    planned = selective_activations(args, 1, 4, 2, compiled=True) * 4 * 64
    assert per_rank == [planned, planned], (per_rank, planned)
