"""Triton kernels for the Squinch codec, byte-identical to ``squinch.encode_reference``/``decode_reference``.

Bit-identity without matching libm: ``tl.log``, ``tl.sqrt`` and ``/`` are approximate on NVIDIA GPUs, so the
kernels use them only for a first guess of ``q_max`` and ``q_i`` and then settle each value with the same
comparisons the reference makes (against ``QMAX_THRESHOLDS`` and the float32 products ``(2j - 1)^2 * S``).
The guess is off by at most one step (its error is ~1e-6 of a step), so checking the two neighbouring
thresholds gives the exact count. Decoding is one float32 product per value and a sign-bit flip.

Each program handles ``BLOCKS`` blocks of 8 as a [BLOCKS, 8] tile: the loads of values and the stores of bytes
are contiguous across the tile, and per-block reductions (max, sign byte, nibble word) stay in registers.
Offsets are int64 so tensors above 2^31 values work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchtitan_ext.comm import squinch

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_ENCODE_BLOCKS = 512
_DECODE_BLOCKS = 512
_NUM_WARPS = 4


@triton.jit
def _encode_kernel(x_ptr, out_ptr, thresholds_ptr, scales_ptr, n, n_blocks, BLOCKS: tl.constexpr):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    lanes = tl.arange(0, 8)
    idx = blocks[:, None] * 8 + lanes[None, :]
    x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    mag = tl.abs(x)
    finite = tl.sum((mag <= _FLT_MAX).to(tl.int32), axis=1) == 8  # NaN fails the comparison
    # Non-finite blocks are encoded as zeros (then q_max = 255): no NaN/Inf reaches a float-to-int cast.
    mag = tl.where(finite[:, None], mag, 0.0)
    block_max = tl.max(mag, axis=1)

    # q_max: guess with the (approximate) log, then settle against the exact thresholds T[q0], T[q0 + 1].
    guess = 6.0 * tl.log(tl.maximum(block_max, 1e-30)) + 129.0
    q0 = tl.minimum(tl.maximum(guess, 0.0), 254.0).to(tl.int32)
    below = tl.load(thresholds_ptr + q0)
    above = tl.load(thresholds_ptr + q0 + 1)
    q_max = q0 + (block_max >= above).to(tl.int32) - (block_max < below).to(tl.int32)

    # q_i: guess round(sqrt(|x| / S) / 2), then settle against (2 q0 - 1)^2 S and (2 q0 + 1)^2 S.
    scale = tl.load(scales_ptr + q_max)[:, None]
    root = tl.sqrt(mag * (1.0 / scale))
    q = tl.minimum((root + 1.0) * 0.5, 15.0).to(tl.int32)
    lower = ((2 * q - 1) * (2 * q - 1)).to(tl.float32) * scale
    upper = ((2 * q + 1) * (2 * q + 1)).to(tl.float32) * scale
    q = q + ((q < 15) & (mag >= upper)).to(tl.int32) - ((q > 0) & (mag < lower)).to(tl.int32)
    q = tl.where(finite[:, None], q, 0)

    # Pack: sign byte (IEEE sign bits), nibble word (byte 2 + j = element 2j high, 2j + 1 low) little-endian.
    negative = (x.to(tl.int32, bitcast=True) < 0) & finite[:, None]
    sign_byte = tl.sum(negative.to(tl.int32) << lanes[None, :], axis=1)
    nibble_shift = 8 * (lanes // 2) + 4 * (1 - lanes % 2)
    word = tl.sum(q.to(tl.uint32) << nibble_shift[None, :].to(tl.uint32), axis=1).to(tl.int32, bitcast=True)
    q_max = tl.where(finite, q_max, 255)

    col = lanes[None, :]
    word_byte = (word[:, None] >> (8 * tl.maximum(col - 2, 0))) & 255
    out = tl.where(col == 0, q_max[:, None], tl.where(col == 1, sign_byte[:, None], word_byte))
    mask = (col < 6) & (blocks[:, None] < n_blocks)
    tl.store(out_ptr + blocks[:, None] * 6 + col, out.to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(enc_ptr, out_ptr, scales_ptr, n, n_blocks, BLOCKS: tl.constexpr):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    lanes = tl.arange(0, 8)
    col = lanes[None, :]
    raw = tl.load(enc_ptr + blocks[:, None] * 6 + col, mask=(col < 6) & (blocks[:, None] < n_blocks), other=0)
    raw = raw.to(tl.uint32)
    q_max = tl.sum(tl.where(col == 0, raw, 0), axis=1).to(tl.int32)
    sign_byte = tl.sum(tl.where(col == 1, raw, 0), axis=1)
    word = tl.sum(tl.where(col >= 2, raw << (8 * tl.maximum(col - 2, 0)).to(tl.uint32), 0), axis=1)

    nibble_shift = (8 * (lanes // 2) + 4 * (1 - lanes % 2)).to(tl.uint32)
    q = ((word[:, None] >> nibble_shift[None, :]) & 15).to(tl.int32)
    sign_bit = ((sign_byte[:, None] >> lanes[None, :].to(tl.uint32)) & 1) << 31
    scale = tl.load(scales_ptr + q_max)[:, None]
    magnitude = ((2 * q) * (2 * q)).to(tl.float32) * scale
    # Flip the sign bit rather than negate: unary minus may lower to 0 - x, which loses -0.0.
    value = (magnitude.to(tl.uint32, bitcast=True) ^ sign_bit).to(tl.float32, bitcast=True)
    idx = blocks[:, None] * 8 + col
    tl.store(out_ptr + idx, value, mask=idx < n)


def encode(x: torch.Tensor) -> torch.Tensor:
    """Encode a flat float32/bf16/fp16 tensor; see ``squinch.encode``."""
    x = x.contiguous()
    n = x.numel()
    n_blocks = triton.cdiv(n, squinch.BLOCK)
    out = torch.empty(n_blocks * squinch.BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    if n_blocks:
        thresholds, scales, _ = squinch.tables(x.device)
        grid = (triton.cdiv(n_blocks, _ENCODE_BLOCKS),)
        _encode_kernel[grid](x, out, thresholds, scales, n, n_blocks, BLOCKS=_ENCODE_BLOCKS, num_warps=_NUM_WARPS)
    return out


def decode(encoded: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode ``numel`` float32 values; see ``squinch.decode`` (which validates the arguments)."""
    encoded = encoded.contiguous()
    n_blocks = encoded.numel() // squinch.BLOCK_BYTES
    out = torch.empty(numel, dtype=torch.float32, device=encoded.device)
    if n_blocks:
        _, scales, _ = squinch.tables(encoded.device)
        grid = (triton.cdiv(n_blocks, _DECODE_BLOCKS),)
        _decode_kernel[grid](encoded, out, scales, numel, n_blocks, BLOCKS=_DECODE_BLOCKS, num_warps=_NUM_WARPS)
    return out
