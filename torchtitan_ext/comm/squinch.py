"""Squinch: 6-bit gradient codec (8 values -> 6 bytes).

Format of one block of 8 values (blocks stored back to back, block b at bytes 6b..6b+5):

- byte 0, ``q_max = clip(int(6 * ln(max|x_i|) + 129), 0, 254)``; the block scale is
  ``maxabs = exp((q_max - 128) / 6)``.
- byte 1, sign bits: bit i (``1 << i``) is the IEEE sign bit of element i.
- bytes 2..5, 4-bit magnitudes ``q_i = min(int(sqrt(|x_i| / maxabs) * 15 + 0.5), 15)``; byte 2+j holds
  element 2j in its high nibble and element 2j+1 in its low nibble.
- decoding gives ``sign_i * (q_i / 15)^2 * maxabs``.

How the formulas are evaluated, so that every backend (CPU, CUDA, Triton, Triton interpreter) produces the
same bytes without depending on a libm's ``log``/``sqrt``/division rounding:

- ``q_max`` is the exact value of the formula for the float32 block maximum: it counts the thresholds
  ``exp((k - 129) / 6)``, k = 1..254, that the maximum reaches; each threshold is stored as the smallest
  float32 not below its exact value (computed with ``decimal``), so the comparison is exact.
- With ``S = maxabs / 900`` (one float32 per ``q_max``, rounded to nearest), ``int(sqrt(|x| / maxabs) * 15 +
  0.5) >= j`` is ``|x| >= (2j - 1)^2 * S``; ``q_i`` counts the j = 1..15 whose float32 product
  ``(2j - 1)^2 * S`` does not exceed ``|x_i|``. This equals the formula except when ``|x_i|`` lies within one
  float32 rounding of a boundary.
- Decoding is ``(2 q_i)^2 * S`` (one float32 product, the same value as ``(q_i / 15)^2 * maxabs``), negated
  when the sign bit is set.

Special values (the published format leaves them open):

- Zeros encode to magnitude 0 and decode to exact zeros (``-0.0`` keeps its sign bit and decodes to ``-0.0``).
- An all-zero block: ``ln(0) = -inf`` clips to ``q_max = 0``; it decodes to exact zeros.
- Tiny blocks (max below ``exp(-128/6) ~ 5.4e-10``) clip to ``q_max = 0``; their values stay below the scale,
  so the error stays below ``maxabs(0) * 61/900 ~ 3.7e-11``.
- Huge blocks: ``q_max`` is clipped to 254 for finite blocks (max at or above ``exp(21) ~ 1.3e9``);
  magnitudes saturate at ``exp(21)``.
- Non-finite: ``q_max = 255`` is reserved for blocks holding a NaN or +-Inf. Such a block encodes to
  ``FF 00 00 00 00 00`` and decodes to eight NaNs, so a non-finite gradient stays non-finite for the
  trainer's guard.
- A length that is not a multiple of 8 is padded with zeros to a whole block; ``decode`` drops the padding.

Round-trip error (derived in tests/unit/comm/test_squinch_codec.py): for a finite block with ``q_max < 254`` or no
saturation, ``|decode(encode(x))_i - x_i| <= 2 sqrt(S |x_i|) + S`` (times 1 + 1e-5 for float32 rounding);
with ``maxabs <= exp(1/6) max|x|`` (q_max not clipped) this is at most ``0.0738 * max|x|`` per block.
"""

from __future__ import annotations

import functools
import os
import struct
from decimal import Decimal, localcontext
from typing import Literal, NamedTuple

import torch

__all__ = ["encode", "decode", "encode_reference", "decode_reference", "encoded_numel", "BLOCK", "BLOCK_BYTES"]

BLOCK = 8
BLOCK_BYTES = 6
NONFINITE_QMAX = 255

Backend = Literal["auto", "reference", "triton"]


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _f32_at_least(exact: Decimal) -> float:
    """Smallest positive float32 >= ``exact``: comparing a float32 against it is the exact comparison."""
    bits = _f32_bits(float(exact))
    while Decimal(_f32_from_bits(bits)) < exact:
        bits += 1
    while bits > 0 and Decimal(_f32_from_bits(bits - 1)) >= exact:
        bits -= 1
    return _f32_from_bits(bits)


def _f32_nearest(exact: Decimal) -> float:
    """float32 nearest to ``exact`` (positive), decided in decimal to avoid double rounding via float64."""
    bits = _f32_bits(float(exact))
    return min((_f32_from_bits(b) for b in (bits - 1, bits, bits + 1)), key=lambda f: abs(Decimal(f) - exact))


def _build_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds on the block max (index k: smallest max with q_max >= k) and S = maxabs / 900 per q_max."""
    with localcontext() as ctx:
        ctx.prec = 40
        thresholds = [0.0]
        thresholds += [_f32_at_least((Decimal(k - 129) / 6).exp()) for k in range(1, NONFINITE_QMAX)]
        thresholds.append(float("inf"))  # finite blocks never reach 255
        scales = [_f32_nearest((Decimal(k - 128) / 6).exp() / 900) for k in range(NONFINITE_QMAX)]
        scales.append(float("nan"))  # q_max = 255: non-finite block decodes to NaN
    return torch.tensor(thresholds, dtype=torch.float32), torch.tensor(scales, dtype=torch.float32)


# QMAX_THRESHOLDS[k] (k = 0..255): the block max reaches q_max >= k. SCALES[k]: exp((k - 128) / 6) / 900.
QMAX_THRESHOLDS, SCALES = _build_tables()
# (2j - 1)^2, j = 1..15: q_i >= j when |x_i| >= (2j - 1)^2 * S.
_ODD_SQUARES = torch.tensor([(2 * j - 1) ** 2 for j in range(1, 16)], dtype=torch.float32)
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

class Tables(NamedTuple):
    """The codec's tables on one device. ``inverse_scales`` (1 / S) only feeds the Triton encoder's first
    guess of q_i, which exact comparisons then settle."""

    thresholds: torch.Tensor
    scales: torch.Tensor
    odd_squares: torch.Tensor
    inverse_scales: torch.Tensor


@functools.cache
def tables(device: torch.device) -> Tables:
    """The tables on ``device``, cached so encoding does not copy them each call."""
    return Tables(QMAX_THRESHOLDS.to(device), SCALES.to(device), _ODD_SQUARES.to(device), (1.0 / SCALES).to(device))


def encoded_numel(numel: int) -> int:
    """Bytes of the encoding of ``numel`` values: 6 per started block of 8."""
    return BLOCK_BYTES * ((numel + BLOCK - 1) // BLOCK)


def _flat_float(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"squinch.encode: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    x = x.reshape(-1)
    return x if x.dtype in _SUPPORTED_DTYPES else x.float()


def encode_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch encoder (CPU or GPU): the readable definition of the bytes the Triton kernel must match."""
    x = _flat_float(x).float()
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, (-n) % BLOCK)).view(-1, BLOCK)
    thresholds, scales, odd_squares, _ = tables(x.device)
    mag = padded.abs()
    finite = torch.isfinite(padded).all(dim=1)
    # q_max = number of thresholds k = 1..254 that the block max reaches; non-finite blocks get 255.
    block_max = mag.amax(dim=1)
    q_max = torch.searchsorted(thresholds[1:NONFINITE_QMAX], block_max, right=True)
    q_max = torch.where(finite, q_max, NONFINITE_QMAX)
    # q_i = number of j = 1..15 with (2j - 1)^2 * S <= |x_i|.
    level_thresholds = odd_squares * scales[q_max].unsqueeze(1)
    q = torch.searchsorted(level_thresholds, mag, right=True)
    q = torch.where(finite.unsqueeze(1), q, 0)
    negative = torch.signbit(padded) & finite.unsqueeze(1)
    shifts = torch.arange(BLOCK, device=x.device)
    sign_byte = (negative.long() << shifts).sum(dim=1)
    nibble_bytes = (q[:, 0::2] << 4) | q[:, 1::2]
    out = torch.cat([q_max.unsqueeze(1), sign_byte.unsqueeze(1), nibble_bytes], dim=1)
    return out.to(torch.uint8).reshape(-1)


def _check_encoded(encoded: torch.Tensor, numel: int) -> None:
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"squinch.decode: numel must be a non-negative int, got {numel!r}")
    if not isinstance(encoded, torch.Tensor) or encoded.dtype != torch.uint8 or encoded.dim() != 1:
        desc = f"{encoded.dtype} of shape {tuple(encoded.shape)}" if isinstance(encoded, torch.Tensor) else encoded
        raise ValueError(f"squinch.decode: expected a 1-D uint8 tensor, got {desc}")
    if encoded.numel() != encoded_numel(numel):
        raise ValueError(
            f"squinch.decode: {numel} values need {encoded_numel(numel)} bytes, got {encoded.numel()}"
        )


def decode_reference(encoded: torch.Tensor, numel: int) -> torch.Tensor:
    """Pure-torch decoder: ``sign * (2 q)^2 * S[q_max]`` in float32, padding dropped."""
    _check_encoded(encoded, numel)
    scales = tables(encoded.device).scales
    blocks = encoded.view(-1, BLOCK_BYTES).long()
    q_max, sign_byte, nibble_bytes = blocks[:, 0], blocks[:, 1], blocks[:, 2:]
    q = torch.stack([nibble_bytes >> 4, nibble_bytes & 15], dim=2).reshape(-1, BLOCK)
    negative = ((sign_byte.unsqueeze(1) >> torch.arange(BLOCK, device=encoded.device)) & 1).bool()
    magnitude = ((2 * q) ** 2).float() * scales[q_max].unsqueeze(1)
    return torch.where(negative, -magnitude, magnitude).reshape(-1)[:numel]


def _use_triton(device: torch.device, backend: Backend, op: str) -> bool:
    """Pick the kernel: Triton on CUDA when importable, on CPU only when asked for under TRITON_INTERPRET=1."""
    if backend == "reference":
        return False
    if backend not in ("auto", "triton"):
        raise ValueError(f"squinch.{op}: backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    try:
        import triton  # noqa: F401
    except ImportError:
        if backend == "triton":
            raise ValueError(f"squinch.{op}: backend='triton' asked for but triton is not importable") from None
        return False
    if device.type != "cuda" and backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"squinch.{op}: backend='triton' on {device.type} needs TRITON_INTERPRET=1")
    return device.type == "cuda" or backend == "triton"


def encode(x: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """Encode ``x`` (any shape, float dtype) to a 1-D uint8 tensor of ``6 * ceil(x.numel() / 8)`` bytes."""
    flat = _flat_float(x)
    if _use_triton(flat.device, backend, "encode"):
        from torchtitan_ext.comm import squinch_triton

        return squinch_triton.encode(flat)
    return encode_reference(flat)


def decode(encoded: torch.Tensor, numel: int, *, backend: Backend = "auto") -> torch.Tensor:
    """Decode ``numel`` float32 values from bytes made by :func:`encode` (same device as ``encoded``)."""
    _check_encoded(encoded, numel)
    if _use_triton(encoded.device, backend, "decode"):
        from torchtitan_ext.comm import squinch_triton

        return squinch_triton.decode(encoded, numel)
    return decode_reference(encoded, numel)
