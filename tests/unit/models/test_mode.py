"""MoDE in one process: balancing (the Switch loss and the aux-free bias), gradients against a per-token reference,
exact integer load counters, one compiled graph, and every shipped MoDE config's layout. (Dropless routing against a
per-token reference is in test_decoder.py; expert parallelism in integration/test_expert_parallel.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_utils import REPO

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import fill_param_
from torchtitan_ext.models.mode import MoDE


def _skewed_layer(**overrides) -> tuple[MoDE, torch.Tensor]:
    """A layer whose router sends nearly every token of the input to the same two experts."""
    args = dataclasses.replace(ModelArgs(vocab_size=8, dim=16, n_heads=2, n_experts=8, top_k=2, moe_hidden=8),
                               **overrides)
    layer = MoDE(args)
    for name, p in layer.named_parameters():
        fill_param_(name, p.data, "normal", 0.1, seed=0)
    with torch.no_grad():
        layer.router.weight[:2] += 0.15  # experts 0 and 1 score high for inputs with a positive mean
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0)) * 0.3 + 1.0
    return layer, x


def _imbalance(layer: MoDE, x: torch.Tensor) -> float:
    counts = torch.bincount(layer.route(x)[0].flatten(), minlength=layer.n_experts).float()
    return (counts.max() / counts.mean()).item()


def test_aux_loss_reduces_imbalance():
    layer, x = _skewed_layer(aux_loss_coef=1.0, router_z_loss_coef=0.0)
    before = _imbalance(layer, x)
    # A small step: with a large one the router swings the whole skew onto another pair of experts.
    opt = torch.optim.SGD(layer.router.parameters(), lr=0.02)
    for _ in range(50):
        opt.zero_grad()
        idx, _, logits = layer.route(x)
        layer.balancing_loss(logits, torch.bincount(idx.flatten(), minlength=8)).backward()
        opt.step()
    after = _imbalance(layer, x)
    assert before > 3.0 and after < 0.5 * before, (before, after)


def test_aux_free_bias_reduces_imbalance_without_gradients():
    # A sign step must stay below the spread of the scores it shifts: at 0.01 (for probabilities ~0.1 that
    # differ by ~0.01 between tokens) whole groups of tokens flip together and the load cycles around 2.5-3.5x.
    layer, x = _skewed_layer(aux_loss_coef=0.0, router_z_loss_coef=0.0, bias_update_rate=0.001)
    before = _imbalance(layer, x)
    weights = layer.router.weight.clone()
    for _ in range(300):
        idx = layer.route(x)[0]
        layer.update_bias(torch.bincount(idx.flatten(), minlength=8).float())
    after = _imbalance(layer, x)
    assert torch.equal(layer.router.weight, weights)
    assert before > 3.0 and after < 0.5 * before, (before, after)


def test_aux_loss_gradient_reaches_the_router_through_the_layer():
    layer, x = _skewed_layer(aux_loss_coef=1.0, router_z_loss_coef=0.0)
    layer.train()
    out = layer(x[None])
    (out * 0).sum().backward()  # the main loss contributes nothing: only the balancing loss is left
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_forced_balanced_routing_gives_every_expert_the_same_load():
    """The benchmark setting: on the skewed layer (the router's own choice: experts 0 and 1 for nearly every
    token) every expert gets exactly tokens x top_k / n_experts copies, each token's copies go to distinct
    experts, and the router still gets a gradient through the gates."""
    layer, x = _skewed_layer(force_balanced_routing=True, aux_loss_coef=0.0, router_z_loss_coef=0.0)
    assert _skewed_layer()[0].route(x)[0].flatten().bincount(minlength=8)[:2].sum() > 0.9 * x.shape[0] * 2
    idx = layer.route(x)[0]
    assert idx.flatten().bincount(minlength=8).tolist() == [x.shape[0] * 2 // 8] * 8
    assert (idx[:, 0] != idx[:, 1]).all()
    layer(x[None]).square().sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0


def _filled_layer(args: ModelArgs, seed: int = 1) -> MoDE:
    layer = MoDE(args).double()
    for name, p in layer.named_parameters():
        fill_param_(name, p.data, "normal", 0.3, seed=seed)
    return layer


@pytest.mark.parametrize("top_k, renormalize", [(1, False), (2, True), (3, True)])
def test_mode_gradients_match_per_token_reference(top_k, renormalize):
    """Input, expert and router gradients through the sort / dispatch / gate-weighted combine equal those of
    a plain per-token loop over each token's k experts (float64)."""
    args = ModelArgs(vocab_size=8, dim=16, n_heads=2, n_experts=5, top_k=top_k, moe_hidden=12,
                     renormalize_gates=renormalize, aux_loss_coef=0.0, router_z_loss_coef=0.0)
    layer = _filled_layer(args)
    ref = _filled_layer(args)
    x = torch.randn(3, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(xa) * g).sum().backward()

    flat = xb.reshape(-1, 16)
    probs = (flat @ ref.router.weight.t()).softmax(-1)
    idx = probs.detach().topk(top_k, dim=-1).indices
    gates = probs.gather(1, idx)
    if renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    e = ref.experts
    rows = []
    for t in range(flat.shape[0]):
        rows.append(sum(gates[t, j] * ((torch.nn.functional.silu(flat[t] @ e.w1[i].t()) * (flat[t] @ e.w3[i].t()))
                                       @ e.w2[i].t()) for j, i in enumerate(idx[t].tolist())))
    (torch.stack(rows).reshape(x.shape) * g).sum().backward()
    # The router runs in float32 (MoDE.route), the reference in float64.
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-5)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(layer.experts, name).grad, getattr(e, name).grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.router.weight.grad, ref.router.weight.grad, atol=1e-5, rtol=1e-5)


def test_load_counters_stay_exact_integers_in_bf16_models():
    args = ModelArgs(vocab_size=8, dim=16, n_heads=2, n_experts=4, top_k=2, moe_hidden=8)
    layer = MoDE(args)
    for name, p in layer.named_parameters():
        fill_param_(name, p.data, "normal", 0.3, seed=0)
    layer = layer.to(torch.bfloat16)
    layer.token_domains = torch.zeros(1, dtype=torch.long)  # one domain id per sequence
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(1, 1000, 16, dtype=torch.bfloat16))
    assert layer.load.dtype == layer.domain_load.dtype == torch.long
    assert int(layer.load.sum()) == int(layer.domain_load[0].sum()) == 3 * 1000 * 2  # bf16 would stop at 256s
    layer.eval()  # evaluation batches must not steer the balancing bias nor the training metrics
    with torch.no_grad():
        layer(torch.randn(1, 1000, 16, dtype=torch.bfloat16))
    assert int(layer.load.sum()) == int(layer.domain_load[0].sum()) == 3 * 1000 * 2


def _masked_grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """grouped_mm without host syncs (every group's GEMM on every row, masked): what the CUDA path's
    single torch._grouped_mm call looks like to the compiler."""
    row = torch.arange(x.shape[0], device=x.device)[:, None]
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    out = x.new_zeros(x.shape[0], w.shape[1])
    for g in range(w.shape[0]):
        out = out + (x @ w[g].t()) * ((row >= starts[g]) & (row < ends[g])).to(x.dtype)
    return out


def test_mode_layer_compiles_to_one_graph(monkeypatch):
    """No graph break in the layer (the trainer compiles blocks with fullgraph=True): routing counts with a
    static shape, the balancing-loss scale read outside autograd.Function. Inductor is not needed for that
    (aot_eager); the grouped GEMM is stood in for by a sync-free masked version, as on CUDA."""
    import torchtitan_ext.models.mode as mode

    monkeypatch.setattr(mode, "grouped_mm", _masked_grouped_mm)
    torch._dynamo.reset()
    args = ModelArgs(vocab_size=8, dim=16, n_heads=2, n_experts=4, top_k=2, moe_hidden=8,
                     aux_loss_coef=0.1, router_z_loss_coef=0.01)
    eager, compiled = _filled_layer(args).float().train(), _filled_layer(args).float().train()
    eager.aux_grad_scale = compiled.aux_grad_scale = 0.5
    x = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(0))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager(xa).square().sum().backward()
    torch.compile(compiled, fullgraph=True, backend="aot_eager")(xb).square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad)
    torch.testing.assert_close(compiled.router.weight.grad, eager.router.weight.grad)
    torch.testing.assert_close(compiled.experts.w2.grad, eager.experts.w2.grad)
    assert torch.equal(compiled.load, eager.load)


# config file -> [(world size, extra overrides)]; every train_configs/mode_*.toml must be listed.
MODE_JOBS = {
    "mode_debug.toml": [(2, [])],
    "mode_235b.toml": [(256, [])],
    "mode_480b.toml": [(512, []), (1024, ["--training.global_batch_size", "4096"])],
}
H100_GIB = 80


def _stage_memory_gib(cfg, args: ModelArgs, dims) -> list[float]:
    """Per pipeline rank: 16 B per parameter split over dp_shard (fp32 weights, gradients, 2 AdamW moments;
    experts are split over ep, then FSDP over dp_shard / ep: dp_shard ways in all) + full-recompute block
    inputs of the micro-batch chunks in flight before the first backward + the last stage's logits (bf16,
    fp32 and gradients: ~10 B each). The figures the configs' comments quote."""
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.parallel.pp import layer_ranges, stage_ids

    p, t = cfg.parallelism, cfg.training
    with torch.device("meta"):
        one_layer = Decoder(dataclasses.replace(args, n_layers=1))
    per_layer = sum(x.numel() for x in one_layer.layers["0"].parameters())
    embedding, head = args.vocab_size * args.dim, args.vocab_size * args.dim + args.dim
    virtual = p.pp_virtual_stages if dims.pp > 1 else 1
    n_stages = dims.pp * virtual
    ranges = layer_ranges(args.n_layers, n_stages, p.pp_split_points)
    micro = (p.pp_microbatches or n_stages) if dims.pp > 1 else 1
    seqs = t.local_batch_size // micro
    out = []
    for rank in range(dims.pp):
        stages = stage_ids(rank, dims.pp, virtual, p.pp_schedule) if dims.pp > 1 else [0]
        layers = sum(len(ranges[s]) for s in stages)
        params = layers * per_layer + (embedding if 0 in stages else 0) + (head if n_stages - 1 in stages else 0)
        in_flight = min((virtual - 1) * dims.pp + 2 * (dims.pp - 1 - rank), micro * virtual) + 1
        chunk = max(len(ranges[s]) for s in stages)
        acts = in_flight * chunk * seqs * t.seq_len * args.dim * 2
        logits = seqs * t.seq_len * args.vocab_size * 10 if n_stages - 1 in stages else 0
        out.append((16 * params / dims.dp_shard + acts + logits) / 2**30)
    return out


def test_every_mode_config_has_a_world_size():
    shipped = {p.name for p in (REPO / "train_configs").glob("mode_*.toml")}
    assert shipped == set(MODE_JOBS), "list each shipped MoDE job's intended world size in MODE_JOBS"


@pytest.mark.parametrize("name, world, extra", [(n, w, e) for n, jobs in MODE_JOBS.items() for w, e in jobs])
def test_mode_config_layout_is_valid_at_its_world_size(name, world, extra):
    """ParallelDims accepts the layout; ep divides the experts and dp_shard, tp the heads, the pipeline
    stages the layers; the schedule, micro-batches and global batch fit; per-GPU memory fits an H100."""
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.models.flavors import resolve_model_args
    from torchtitan_ext.parallel.dims import ParallelDims
    from torchtitan_ext.parallel.ep import check_ep
    from torchtitan_ext.parallel.pp import check_schedule, layer_ranges
    from torchtitan_ext.parallel.tp import check_tp

    cfg = parse_args(["--config", str(REPO / "train_configs" / name), *extra])
    p, t = cfg.parallelism, cfg.training
    dims = ParallelDims.from_config(p, world)  # raises ParallelDimsError on a bad product or ep
    args = resolve_model_args(cfg, cfg.data.tokenizer_vocab_size if cfg.data.tokenizer == "builtin" else 0)
    assert args.n_experts > 0 and dims.ep > 1, "a MoDE job with expert parallelism"
    check_ep(args.n_experts, dims.ep, dims.tp)
    assert args.n_experts % (dims.ep * dims.tp) == 0 and dims.dp_shard % dims.ep == 0
    assert args.n_heads % dims.tp == 0 and args.kv_heads % dims.tp == 0
    if dims.tp > 1:
        check_tp(args, dims.tp)
    if dims.pp > 1:
        n_stages = dims.pp * p.pp_virtual_stages
        ranges = layer_ranges(args.n_layers, n_stages, p.pp_split_points)
        assert len(ranges) == n_stages and all(len(r) > 0 for r in ranges)
        assert not args.tie_embeddings
        check_schedule(p.pp_schedule, p.pp_virtual_stages, p.pp_microbatches or n_stages, dims.pp,
                       t.local_batch_size)
    per_step = t.local_batch_size * dims.dp
    gbs = per_step if t.global_batch_size == -1 else t.global_batch_size
    assert gbs % per_step == 0, (gbs, per_step)
    assert t.seq_len <= args.max_seq_len
    if world > 8:  # the cluster jobs: under 60 GiB by the estimate, leaving room for buffers and fragmentation
        memory = _stage_memory_gib(cfg, args, dims)
        assert max(memory) < 0.75 * H100_GIB, [round(m, 1) for m in memory]


@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_expert_weight_cast_scales_its_gradient_in_one_pass(scale):
    """The eager experts' weight cast (``_CastForExperts``, used on CUDA; compiled, it runs on CPU too): the
    forward is ``w.bfloat16()``; the backward returns the bf16 gradient in ``w``'s dtype times ``scale``,
    contiguous even when the gradient arrives transposed (as a grouped GEMM's weight gradient does)."""
    from torchtitan_ext.models.mode import _CastForExperts

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 16, generator=gen, requires_grad=True)
    out = _CastForExperts.apply(w, scale)
    assert out.dtype == torch.bfloat16 and torch.equal(out, w.detach().bfloat16())
    grad = torch.randn(3, 16, 8, generator=gen).bfloat16().transpose(-2, -1)  # a transposed layout
    out.backward(grad)
    assert w.grad.dtype == torch.float32 and w.grad.is_contiguous()
    assert torch.equal(w.grad, grad.float() * scale)  # exact: one float32 multiply of the widened gradient
