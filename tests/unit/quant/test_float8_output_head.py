"""Issue 16 leftovers: a compiled dense model under tensor parallelism, the float8 output head, and what the
op-level selective activation checkpointing keeps (GEMM and attention outputs) and recomputes (the rest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from float8_utils import TINY, TORCHAO_ERROR, needs_torchao, tiny_float8, tiny_tokens, train_accumulated

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.parallel.compile import apply_compile
from torchtitan_ext.quant import float8 as f8

if TORCHAO_ERROR is None:
    from torchao.float8.float8_linear import Float8Linear

HEAD = Float8Section(enabled=True, min_dim=16, include_output=True)


def test_include_output_converts_the_head_despite_filter_fqns():
    with torch.device("meta"):
        model = Decoder(TINY)
    for include, head_converted in ((False, False), (True, True)):
        cfg = Float8Section(enabled=True, min_dim=16, filter_fqns=["output", "wo"], include_output=include)
        keep = f8.float8_module_filter(cfg)
        assert keep(model.output, "output") is head_converted
        assert not keep(model.layers["0"].attention.wo, "layers.0.attention.wo")  # the other entries still hold
        assert keep(model.layers["0"].attention.wq, "layers.0.attention.wq")


def _float8_model(parallelize=None) -> Decoder:
    model, converted = tiny_float8(HEAD, parallelize)
    assert "output" in converted
    return model


def _loss_and_head_grad(model: nn.Module, loss_context) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = tiny_tokens()
    with loss_context():
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    grad = model.output.weight.grad
    return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach(), \
        grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _tp_head_worker(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from torchtitan_ext.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (world,))
    model = _float8_model(lambda m: apply_tp(m, mesh, loss_parallel=True))
    assert isinstance(model.output, Float8Linear)
    blocks, model.layers = model.layers, nn.ModuleDict()  # compile the head alone (compiled TP blocks: above)
    apply_compile(model, experts_in_graph=True, tensor_parallel=True, compile_head=True)
    model.layers = blocks
    assert model.output._compiled_call_impl is not None
    assert model.output.weight.to_local().shape == (TINY.vocab_size // world, TINY.dim)  # vocabulary shard
    return _loss_and_head_grad(model, loss_parallel)


@pytest.mark.slow
@needs_torchao
def test_float8_head_under_tp_with_loss_parallel_matches_one_process():
    """Emulated float8 head sharded over the vocabulary, logits never gathered (loss parallel), the head
    compiled as the trainer does with include_output: loss and head gradient equal one eager process's
    float8 head (tensorwise scales are global amaxes of the DTensors)."""
    from contextlib import nullcontext

    loss, grad = _loss_and_head_grad(_float8_model(), nullcontext)
    for got_loss, got_grad in run_distributed(_tp_head_worker, 2):
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_grad, grad, rtol=1e-5, atol=1e-7)


def _fsdp_head_worker(rank: int, world: int) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (world,))

    def parallelize(model: nn.Module) -> None:
        blocks, model.layers = model.layers, nn.ModuleDict()  # the trainer's order: compile, then FSDP
        apply_compile(model, experts_in_graph=True, tensor_parallel=False, compile_head=True)
        model.layers = blocks
        apply_fsdp(model, mesh, torch.float32, torch.float32)

    losses = train_accumulated(_float8_model(parallelize), [tiny_tokens()[2 * rank:2 * rank + 2]], steps=3)
    dist.all_reduce(losses, op=dist.ReduceOp.AVG)
    return losses


@pytest.mark.slow
@needs_torchao
def test_compiled_float8_head_under_fsdp_trains_like_one_process():
    """The compiled float8 head inside FSDP2's root unit: 3 AdamW steps on 2 ranks equal one eager process
    taking each rank's half-batch as a micro-batch."""
    tokens = tiny_tokens()
    ref = train_accumulated(_float8_model(), [tokens[:2], tokens[2:]], steps=3)
    for got in run_distributed(_fsdp_head_worker, 2):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert ref[-1] < ref[0]
