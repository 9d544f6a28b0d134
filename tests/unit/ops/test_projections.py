"""Linears sharing an input as one GEMM (ops/projections.py): the same outputs and gradients as the linears one by
one (plain: to float64 rounding; float8: bit for bit against one Float8Linear over the concatenated weight),
and the groups that must not fuse run one by one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.float8_utils import TINY, init_decoder, needs_torchao
from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.models.args import ComputeOptions
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.ops.projections import fusion_for, project


def linears(outs: list[int], dim: int = 16, dtype=torch.float64, seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(dim, o, bias=False, dtype=dtype) for o in outs]


def outputs_and_grads(mods, x: torch.Tensor, fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    ys = project(x, mods, fused)
    grads = [torch.randn(y.shape, generator=torch.Generator().manual_seed(i), dtype=y.dtype) for i, y in
             enumerate(ys)]
    torch.autograd.backward(ys, grads)
    out = [y.detach() for y in ys], [x.grad] + [m.weight.grad for m in mods]
    for m in mods:
        m.weight.grad = None
    return out


def test_plain_linears_fused_equal_one_by_one_in_float64():
    mods = linears([8, 4, 4])
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert fusion_for(mods) is not None
    (ys, gs), (fys, fgs) = outputs_and_grads(mods, x, False), outputs_and_grads(mods, x, True)
    for a, b in zip(ys + gs, fys + fgs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


class _Other(nn.Linear):
    pass


def test_groups_that_must_not_fuse_run_one_by_one():
    mixed = linears([8, 4])
    mixed[1].__class__ = _Other  # a swapped-in linear (e.g. fake-quantised) of another type
    biased = [nn.Linear(16, 8), nn.Linear(16, 4)]
    assert fusion_for(mixed) is None and fusion_for(biased) is None
    x = torch.randn(3, 16, dtype=torch.float64)
    ys = project(x, mixed, fused=True)
    torch.testing.assert_close(ys[1], mixed[1](x))


def test_a_decoder_with_fused_projections_computes_the_same_loss_and_gradients():
    args = TINY
    ref = init_decoder(Decoder(args), seed=3).double()
    fused = copy.deepcopy(ref)
    for m in fused.modules():  # the same modules, now fusing (the builder sets it through ComputeOptions)
        if hasattr(m, "fused_projections"):
            m.fused_projections = True
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (ref, fused):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), b in zip(ref.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_compute_options_reach_the_attention_and_the_feed_forward():
    model = Decoder(TINY, ComputeOptions(fused_projections=True))
    block = model.layers["0"]
    assert block.attention.fused_projections and block.feed_forward.fused_projections


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_group_equals_one_float8_linear_over_the_concatenated_weight(recipe):
    from torchao.float8.float8_linear import Float8Linear

    from torchtitan_ext.quant.float8 import _linear_config, _torchao_float8, convert_to_float8

    outs = [64, 32, 32]
    group = nn.Sequential(*linears(outs, dim=64, dtype=torch.float32))
    convert_to_float8(group, Float8Section(enabled=True, recipe=recipe, min_dim=16), emulate=True,
                      log=lambda s: None)
    mods = list(group)
    assert all(type(m) is Float8Linear for m in mods) and fusion_for(mods) is not None
    whole = nn.Linear(64, sum(outs), bias=False)
    whole.weight.data.copy_(torch.cat([m.weight.data for m in mods]))
    whole = Float8Linear.from_float(whole, config=_linear_config(_torchao_float8(), Float8Section(recipe=recipe),
                                                                 emulate=True))
    x = torch.randn(4, 8, 64) * 3
    (fys, fgs) = outputs_and_grads(mods, x, True)
    xw = x.clone().requires_grad_(True)
    y = whole(xw)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in
             enumerate(y.split(outs, dim=-1))]
    y.backward(torch.cat(grads, dim=-1))
    assert torch.equal(torch.cat(fys, dim=-1), y.detach())
    assert torch.equal(fgs[0], xw.grad)
    assert torch.equal(torch.cat(fgs[1:]), whole.weight.grad)
    # and it is float8: one by one (each weight its own scale, the input cast per linear) differs a little
    if recipe == "tensorwise":
        ys, _ = outputs_and_grads(mods, x, False)
        assert not torch.equal(torch.cat(ys, dim=-1), y.detach())


def _fp8_gpu_skip_reason() -> str | None:
    from tests.float8_utils import TORCHAO_ERROR
    from torchtitan_ext.quant.float8 import MIN_CAPABILITY

    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability() < MIN_CAPABILITY:
        return "needs compute capability >= 8.9"
    return TORCHAO_ERROR


@pytest.mark.gpu
@pytest.mark.skipif(_fp8_gpu_skip_reason() is not None, reason=str(_fp8_gpu_skip_reason()))
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_float8_group_equals_one_float8_linear_under_autocast(compiled):
    """Real FP8 GEMMs, float32 weights under bf16 autocast (the one-GPU trainer's setting): the fused q / k / v
    group computes what one Float8Linear over the concatenated weight computes."""
    from torchao.float8.float8_linear import Float8Linear

    from torchtitan_ext.quant.float8 import _linear_config, _torchao_float8, convert_to_float8

    outs = [1024, 256, 256]
    group = nn.Sequential(*linears(outs, dim=1024, dtype=torch.float32)).cuda()
    convert_to_float8(group, Float8Section(enabled=True), log=lambda s: None)
    whole = nn.Linear(1024, sum(outs), bias=False).cuda()
    whole.weight.data.copy_(torch.cat([m.weight.data for m in group]))
    whole = Float8Linear.from_float(whole, config=_linear_config(_torchao_float8(), Float8Section(), emulate=False))
    x = torch.randn(4096, 1024, device="cuda")
    fused = (lambda x: torch.cat(project(x, list(group), True), dim=-1))
    run_whole = whole
    if compiled:
        fused, run_whole = torch.compile(fused), torch.compile(whole)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = fused(x), run_whole(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
