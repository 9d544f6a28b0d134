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


def _head_grad_and_exact(cfg: Float8Section) -> tuple[torch.Tensor, torch.Tensor]:
    """The float8 head's weight gradient and the exact one (float64, from the head's own input and output
    gradient as the model saw them)."""
    model, _ = tiny_float8(cfg)
    seen = {}
    model.output.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    model.output.register_full_backward_hook(lambda m, grad_in, grad_out: seen.update(dy=grad_out[0]))
    _loss_and_head_grad(model, __import__("contextlib").nullcontext)
    x, dy = seen["x"].flatten(0, 1).double(), seen["dy"].flatten(0, 1).double()
    return model.output.weight.grad.double(), dy.T @ x


@needs_torchao
def test_a_bf16_weight_gradient_keeps_the_float8_heads_weight_gradient_exact():
    """``output_weight_grad = "bf16"``: the head's weight gradient is the high-precision product of its input
    and output gradient; with ``"float8"`` it is the product of their float8 roundings, measurably off. The
    forward and input gradient stay float8 in both (the head is a Float8Linear either way)."""
    import dataclasses

    grad, exact = _head_grad_and_exact(dataclasses.replace(HEAD, output_weight_grad="bf16"))
    torch.testing.assert_close(grad, exact, rtol=1e-5, atol=1e-7)
    rounded, exact_rounded = _head_grad_and_exact(HEAD)
    error = (rounded - exact_rounded).norm() / exact_rounded.norm()
    assert error > 1e-3  # e4m3 / e5m2 operands: a relative error of a few percent
    model, converted = tiny_float8(dataclasses.replace(HEAD, output_weight_grad="bf16"))
    assert isinstance(model.output, Float8Linear) and "output" in converted
    assert model.layers["0"].attention.wq.config.cast_config_grad_output_for_grad_weight.scaling_type.value \
        != "disabled"  # the blocks keep the float8 weight gradient


@needs_torchao
def test_a_bf16_weight_gradient_needs_the_float8_tensorwise_head():
    import dataclasses

    from torchtitan_ext.errors import ConfigError

    for cfg, got in ((Float8Section(enabled=True, output_weight_grad="bf16"), "include_output = false"),
                     (dataclasses.replace(HEAD, recipe="rowwise", output_weight_grad="bf16"), "recipe 'rowwise'")):
        with pytest.raises(ConfigError, match=f"float8.output_weight_grad = 'bf16' needs float8.include_output = "
                                              f"true and float8.recipe = 'tensorwise' \\(got .*{got}"):
            f8.check_float8_supported(dataclasses.replace(cfg, emulate=True), torch.device("cpu"))
