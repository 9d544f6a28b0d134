"""torchao's rowwise float8 scales, shared by the float8 experts' emulation and their GPU cast kernels."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
EPS = 1e-12  # torchao's amax floor: an all-zero row gets a finite scale and quantises to zeros


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """torchao's rowwise scale: 448 / amax (floored at EPS, divided in float64), rounded down to a power of two,
    in float32; data = saturate(x * scale)."""
    scale = (torch.finfo(E4M3).max / amax.to(torch.float64).clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))
