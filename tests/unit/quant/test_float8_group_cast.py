"""The per-group, column-wise float8 cast of the float8 experts' weight gradient (``quant/float8_group_cast.py``):
on CPU under TRITON_INTERPRET=1 against a plain-torch reference, bit for bit (scales and data); on a GPU
against torchao 0.17's per-expert kernel, and ``_Float8GroupedMM`` against torchao's grouped GEMM, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# (rows, cols, group ends): empty groups (first, middle, last-but-one), a group over several 256-row programs,
# groups ending inside a program, columns not a multiple of the 128-column block, one group only
CASES = [(96, 40, [0, 16, 16, 48, 96]), (640, 136, [16, 560, 576, 576, 640]), (16, 8, [16])]


def reference(x: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One group at a time: the column maxima over the group's rows, torchao's scales, saturate(x * scale)."""
    from torchtitan_ext.quant.float8_scales import E4M3, scales_from_amax

    starts = [0, *ends.tolist()[:-1]]
    amax = torch.stack([x[s:e].float().abs().amax(dim=0) if e > s else x.new_zeros(x.shape[1], dtype=torch.float32)
                        for s, e in zip(starts, ends.tolist(), strict=True)])
    scales = scales_from_amax(amax)
    group = torch.searchsorted(ends.long(), torch.arange(x.shape[0], device=x.device), right=True)
    fmax = torch.finfo(E4M3).max
    return (x.float() * scales[group]).clamp(-fmax, fmax).to(E4M3), scales.reshape(-1)


def inputs(rows: int, cols: int, ends: list[int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows whose columns span 1e-3..1e3 (so some values are e4m3 subnormals once scaled), one column all
    zero in the first non-empty group, and the ends as int32."""
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)
    first = next(e for e in ends if e > 0)
    x[first - 16:first, 3] = 0
    return x.bfloat16().to(device), torch.tensor(ends, dtype=torch.int32, device=device)


def check_cast() -> None:
    """Run in a fresh process with TRITON_INTERPRET=1 (triton reads it when kernels are decorated)."""
    from torchtitan_ext.quant.float8_group_cast import group_colwise_cast

    for rows, cols, ends in CASES:
        x, e = inputs(rows, cols, ends)
        data, scales = group_colwise_cast(x, e)
        want_data, want_scales = reference(x, e)
        assert data.stride() == (1, rows), data.stride()
        assert torch.equal(scales, want_scales), (rows, cols, (scales - want_scales).abs().max())
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)), (rows, cols)
    bad = torch.zeros(32, 8, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match="expected a row-major 2-d tensor"):
        group_colwise_cast(bad, torch.tensor([8], dtype=torch.int32))


def test_cast_matches_reference_on_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", "import test_float8_group_cast as t; t.check_cast()"], cwd=TESTS,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm90 GPU (torch._scaled_grouped_mm)"
    try:
        import torchao.prototype.moe_training  # noqa: F401
    except ImportError as e:
        return f"needs torchao 0.17 ({e})"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
def test_gpu_cast_matches_torchao_and_reference():
    from torchao.prototype.moe_training.kernels import triton_fp8_per_group_colwise_scales_dual as torchao_dual

    from torchtitan_ext.quant.float8_group_cast import group_colwise_cast

    for rows, cols, ends in [*CASES, (4096, 1408, [0, 2048, 2048, 2560, 4096])]:
        x, e = inputs(rows, cols, ends, "cuda")
        data, scales = group_colwise_cast(x, e)
        want_data, want_scales = reference(x, e)
        ta_data, ta_scales, _, _ = torchao_dual(x, x, e, torch.float8_e4m3fn, round_scales_to_power_of_2=True)
        assert torch.equal(scales, want_scales) and torch.equal(scales, ta_scales)
        differ = {name: int((data.view(torch.uint8) != d.view(torch.uint8)).sum())
                  for name, d in (("reference", want_data), ("torchao", ta_data))}
        assert differ == {"reference": 0, "torchao": 0}, (rows, cols, differ)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gpu_grouped_mm_equals_torchao(weight_dtype):
    """``_Float8GroupedMM`` of one input with two weights (a SwiGLU expert's w1 and w3: the input cast once)
    against torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` once per weight: both outputs and both weight
    gradients bit for bit (the same scales and GEMMs, only the casts run through other kernels); the input
    gradient is the sum of the two GEMMs' in both, added in the same order."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    from torchtitan_ext.quant.float8_experts import _Float8GroupedMM

    gen = torch.Generator().manual_seed(0)
    ends = torch.tensor([0, 512, 528, 528, 2048, 2304], dtype=torch.int32, device="cuda")
    x0 = torch.randn(2304, 256, generator=gen).bfloat16().cuda()
    ws0 = [(torch.randn(6, 192, 256, generator=gen) * 0.05).to(weight_dtype).cuda() for _ in range(2)]
    gs = [torch.randn(2304, 192, generator=gen).bfloat16().cuda() for _ in range(2)]

    def torchao(x, ws):
        return tuple(_to_fp8_rowwise_then_scaled_grouped_mm(x, w.transpose(-2, -1), ends,
                                                            pad_token_groups_for_grouped_mm=False) for w in ws)
    results = []
    for fn in (lambda x, ws: _Float8GroupedMM.apply(x, ends, *ws), torchao):
        x, ws = x0.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws0]
        ys = fn(x, ws)
        torch.autograd.backward(ys, gs)
        results.append([*ys, x.grad, *(w.grad for w in ws)])
    for ours, theirs in zip(*results, strict=True):
        assert torch.isfinite(ours).all()
        assert torch.equal(ours, theirs)
