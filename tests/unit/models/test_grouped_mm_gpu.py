"""The experts' grouped GEMM on the GPU (``models/mode.py grouped_mm``): output, input gradient and weight
gradient against a float64 loop over the groups, eagerly and compiled, with empty groups and with the
allocator's free memory full of NaN (a weight-gradient block the kernel never wrote would show)."""

from __future__ import annotations

import pytest
import torch
from gpu_utils import poison_cuda_cache

from torchtitan_ext.models.mode import GroupedExperts, grouped_mm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA GPU of compute capability 9.0 (torch._grouped_mm)")]


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_grouped_mm_matches_a_float64_loop(compiled):
    counts = [0, 1000, 17, 0, 3000, 5, 700, 2377, 0]  # empty groups first, inside and last
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(counts), 512, device="cuda", generator=gen)
    w = (torch.randn(len(counts), 768, 512, device="cuda", generator=gen) * 512 ** -0.5).requires_grad_()
    grad = torch.randn(sum(counts), 768, device="cuda", generator=gen)
    ends = torch.tensor(counts, device="cuda").cumsum(0, dtype=torch.int32)
    xb = x.bfloat16().requires_grad_()
    fn = torch.compile(grouped_mm, fullgraph=True) if compiled else grouped_mm
    poison_cuda_cache()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(xb, w, ends)
    y.backward(grad.bfloat16())

    x64, w64 = xb.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    outs, start = [], 0
    for g, end in enumerate(ends.tolist()):
        outs.append(x64[start:end] @ w64[g].t())
        start = end
    ref = torch.cat(outs)
    ref.backward(grad.bfloat16().double())
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and w.grad.is_contiguous()
    bounds = [0, *ends.tolist()]
    for g, n in enumerate(counts):  # group by group: a few wrong rows at a group's edge would show
        rows = slice(bounds[g], bounds[g + 1])
        if n == 0:
            assert torch.count_nonzero(w.grad[g]) == 0  # written as zeros, not left as the allocator's NaN
            continue
        assert _relerr(y[rows], ref[rows]) < 1e-2, g
        assert _relerr(xb.grad[rows], x64.grad[rows]) < 1e-2, g
        assert _relerr(w.grad[g], w64.grad[g]) < 1e-2, g


@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_experts_match_a_float64_loop(compiled):
    """``GroupedExperts`` against a float64 SwiGLU per expert: output, input gradient and the three weights'
    gradients, with an expert that receives no rows."""
    counts = [600, 0, 1500, 37, 900, 11]
    experts = GroupedExperts(len(counts), 256, 384).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.copy_(torch.randn(w.shape, device="cuda", generator=gen) * w.shape[-1] ** -0.5)
    x = torch.randn(sum(counts), 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(sum(counts), 256, device="cuda", generator=gen).bfloat16()
    fn = torch.compile(experts, fullgraph=True) if compiled else experts
    poison_cuda_cache()
    y = fn(x, torch.tensor(counts, device="cuda"))
    y.backward(grad)

    x64 = x.detach().double().requires_grad_()
    w1, w2, w3 = (w.detach().double().requires_grad_() for w in (experts.w1, experts.w2, experts.w3))
    outs, start = [], 0
    for g, n in enumerate(counts):
        rows = x64[start:start + n]
        outs.append((torch.nn.functional.silu(rows @ w1[g].t()) * (rows @ w3[g].t())) @ w2[g].t())
        start += n
    torch.cat(outs).backward(grad.double())
    assert _relerr(y, torch.cat(outs).detach()) < 1e-2
    assert _relerr(x.grad, x64.grad) < 1e-2
    for got, ref in ((experts.w1, w1), (experts.w2, w2), (experts.w3, w3)):
        assert got.grad.dtype == torch.float32 and got.grad.is_contiguous()
        assert torch.count_nonzero(got.grad[1]) == 0  # the empty expert's rows
        assert _relerr(got.grad, ref.grad) < 1e-2
