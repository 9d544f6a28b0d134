"""Block-scaled float8 linears (DeepSeek-V3's recipe; ``[float8] recipe = "blockwise"``).

One e4m3 scale per block instead of per tensor or row: activations and output gradients get 1 x 128 blocks
along the GEMM's contraction dim, weights 128 x 128 blocks. An outlier then coarsens only its own block's
rounding, where a tensorwise scale coarsens the whole tensor's. Gradients are e4m3 too (DeepSeek-V3): the
fine blocks give the range that tensorwise recipes buy with e5m2. The three GEMMs of ``y = x W^T`` (x: M x K
tokens, W: N x K):

  forward  y  = x W^T    x in 1 x 128 blocks along K,  W in 128 x 128 blocks
  dgrad    dx = dy W     dy in 1 x 128 blocks along N, W in 128 x 128 blocks
  wgrad    dW = dy^T x   dy and x in 128 x 1 blocks (128 tokens of one column), the contraction dim being M

A block's scale is amax / 448 (448: e4m3's largest value), so its largest element maps to 448; zero blocks
get the amax floor ``EPS`` and quantise to zeros. ``pow2`` rounds the scale up to a power of two (exact
scaling, as the rowwise recipe does); the GPU kernels use exact amax scales like the CPU default.

The math here is plain torch (CPU, tests; ``emulate`` runs every GEMM as a matmul of the dequantised operands
in the input's precision). On the GPU the same scheme runs through torchao 0.17's prototype
``torchao.prototype.blockwise_fp8_training``: its Triton quantisation kernels and cuBLAS's block-scaled FP8
GEMMs through ``torch._scaled_mm``. Its alternative, torchao's Triton GEMMs, is slower than cuBLAS (slower
than bf16 at large shapes) and fails to compile under torch 2.11's inductor, so it is not offered. The swapped
module subclasses ``nn.Linear`` and keeps its ``weight`` (and ``bias``) parameters, so checkpoints, FSDP and
the initialisation plan see the same names and shapes.

cuBLAS's block-scaled GEMM reads the 128 x 128 weight scales with their contraction-block count rounded up to
a multiple of 4 (torch's checks for ``_scaled_mm_v2`` spell out this layout, ``L4 = round_up(K / 128, 4)``);
torchao 0.17 hands it unpadded scales, which ``torch._scaled_mm`` accepts. Any contraction of a number of
blocks not divisible by 4 then comes out wrong (with torch 2.11: small linears such as 256 -> 768 were off by
orders of magnitude, while 1024 -> 2048 matched the emulation). The forward contracts over in_features, the
input gradient over out_features: so only linears whose in and out features are multiples of 512
(``CONTRACTION_MULTIPLE``) convert, the rest stay bf16 with the reason logged, and token counts are
zero-padded to a multiple of 512 for the weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
CONTRACTION_MULTIPLE = 4 * BLOCK  # every GEMM's contraction: a multiple of 4 blocks (the module docstring)
EPS = 1e-12  # amax floor (torchao's kernels use the same): a zero block gets a tiny scale, not a division by 0


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], pow2: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales of shape (rows / block[0], cols / block[1])) of a 2-D ``x``, one scale per
    ``block``: ``x ~= values * scale`` blockwise. Ragged edges form smaller blocks."""
    rows, cols = x.shape
    br, bc = block
    pr, pc = -rows % br, -cols % bc
    xp = F.pad(x, (0, pc, 0, pr)) if pr or pc else x
    tiles = xp.reshape(xp.shape[0] // br, br, xp.shape[1] // bc, bc)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).double().clamp(min=EPS)
    inv = (E4M3_MAX / amax).float()  # what multiplies x, computed like torchao's kernels
    if pow2:
        inv = torch.exp2(torch.floor(torch.log2(inv)))  # round the multiplier down: no block can overflow
    q = (tiles.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.reshape(xp.shape)[:rows, :cols]
    return q, inv.reciprocal().reshape(tiles.shape[0], tiles.shape[2])


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``, each scale broadcast over its block; the product is formed in float32
    (float64 for a float64 ``dtype``), as a GEMM applies its float32 scales, and then rounded to ``dtype``."""
    rows, cols = q.shape
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    full = scale.to(wide).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (q.to(wide) * full[:rows, :cols]).to(dtype)


def fake_quantize(x: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> torch.Tensor:
    """What a block-scaled GEMM sees of ``x``: quantised and dequantised, in ``x``'s dtype."""
    return dequantize_blocks(*quantize_blocks(x, block, pow2), block, dtype=x.dtype)


class _EmulatedBlockwiseMM(torch.autograd.Function):
    """``x @ w.T`` with DeepSeek-V3's block scaling on all three GEMMs, run as high-precision matmuls of the
    dequantised operands (``x``: 2-D, rows = tokens)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        w = fake_quantize(weight, (BLOCK, BLOCK)).to(x.dtype)
        return fake_quantize(x, (1, BLOCK)) @ w.T

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        w = fake_quantize(weight, (BLOCK, BLOCK)).to(dy.dtype)
        dx = fake_quantize(dy, (1, BLOCK)) @ w
        dw = fake_quantize(dy, (BLOCK, 1)).T @ fake_quantize(x, (BLOCK, 1)).to(dy.dtype)
        return dx, dw.to(weight.dtype)


def _torchao_blockwise_mm() -> type[torch.autograd.Function]:
    """torchao's block-scaled autograd Function (forward, dgrad and wgrad as above, Triton quantisation)."""
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    return fp8_blockwise_mm


class BlockwiseFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run block-scaled float8; in/out features must be multiples of 128.

    ``emulate``: the plain-torch path (any device; tests). Otherwise CUDA (compute capability 9.0) through
    torchao's prototype with cuBLAS GEMMs. Under
    autocast the input is cast to the autocast dtype first (as torchao's Float8Linear does); the weight is
    quantised from its own dtype. Token counts are zero-padded to a multiple of 512 for the wgrad blocks.
    The GPU path refuses in/out features that are not multiples of 512 (wrong results, the module docstring)
    unless ``unchecked_shapes`` (for measuring such shapes against the emulation)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, emulate: bool = False,
                 unchecked_shapes: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if in_features % BLOCK or out_features % BLOCK:
            raise ValueError(f"block-scaled float8 needs in/out features divisible by {BLOCK}, got "
                             f"{in_features} x {out_features}")
        if not emulate and not unchecked_shapes and (in_features % CONTRACTION_MULTIPLE
                                                     or out_features % CONTRACTION_MULTIPLE):
            raise ValueError(f"block-scaled float8 on the GPU needs in/out features divisible by "
                             f"{CONTRACTION_MULTIPLE} (cuBLAS computes other contractions wrong), got "
                             f"{in_features} x {out_features}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.emulate = emulate
        self._mm = None if emulate else _torchao_blockwise_mm()

    @classmethod
    def from_linear(cls, mod: nn.Linear, *, emulate: bool = False, unchecked_shapes: bool = False
                    ) -> BlockwiseFloat8Linear:
        """The swap: a new module sharing ``mod``'s parameter objects (meta or materialised)."""
        new = cls(mod.in_features, mod.out_features, mod.bias is not None, emulate=emulate,
                  unchecked_shapes=unchecked_shapes, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        pad = -x2.shape[0] % CONTRACTION_MULTIPLE
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        if self._mm is None:
            y = _EmulatedBlockwiseMM.apply(x2, self.weight)
        else:  # torchao's GEMMs write bf16 (the cuBLAS block-scaled kernels have no float32 output)
            y = self._mm.apply(x2.contiguous(), self.weight, BLOCK, torch.bfloat16, False)  # False: cuBLAS
            y = y.to(x.dtype)
        if pad:
            y = y[:-pad]
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8 blockwise 1x128 / 128x128{' (emulated)' * self.emulate}"


def convert_to_blockwise(model: nn.Module, keep: Callable[[nn.Module, str], bool], *, emulate: bool = False
                         ) -> list[str]:
    """Swap, in place, every ``nn.Linear`` for which ``keep(module, fqn)`` holds; returns their FQNs."""
    targets = [(fqn, m) for fqn, m in model.named_modules()
               if type(m) is nn.Linear and keep(m, fqn)]
    for fqn, m in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BlockwiseFloat8Linear.from_linear(m, emulate=emulate))
    return [fqn for fqn, _ in targets]
