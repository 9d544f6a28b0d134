"""Triton kernels for the Squinch codec, byte-identical to ``squinch.encode_reference``/``decode_reference``.

Bit-identity without matching libm: ``tl.log``, ``tl.sqrt`` and ``/`` are approximate on NVIDIA GPUs, so the
kernels use them only for a first guess and then settle each value with the comparisons the reference makes
(against ``QMAX_THRESHOLDS`` and the float32 products ``(2j - 1)^2 * S``). The guess errs by ~1e-6 of a step:
``q_max`` checks the two neighbouring thresholds, ``q_i`` the one boundary it can be near. Decoding is one
float32 product per value and a sign-bit flip.

Each program handles ``BLOCKS`` blocks of 8 as a [BLOCKS, 8] tile: loads are contiguous across the tile and
per-block reductions (max, sign byte, nibble word) stay in registers. The encoder writes each block's 6 bytes
as three 16-bit stores; byte stores masked to 6 of 8 columns ran at half the speed.
Tile bases are int64 so tensors above 2^31 values work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchtitan_ext.comm import squinch

_INF_BITS = tl.constexpr(0x7F800000)
_ENCODE_BLOCKS = 512
_DECODE_BLOCKS = 512
_NUM_WARPS = 4


@triton.jit
def _encode_kernel(x_ptr, out_ptr, thresholds_ptr, scales_ptr, inverse_scales_ptr, n, n_blocks,
                   BLOCKS: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCKS  # 64-bit base, 32-bit offsets within the tile
    blocks = tl.arange(0, BLOCKS)
    lanes = tl.arange(0, 8)
    idx = blocks[:, None] * 8 + lanes[None, :]
    x = tl.load(x_ptr + first * 8 + idx, mask=idx < n - first * 8, other=0.0).to(tl.float32)
    # |x| as float32 bits: one integer max per block gives both the block max and whether it is finite.
    bits = x.to(tl.int32, bitcast=True)
    abs_bits = bits & 0x7FFFFFFF
    max_bits = tl.max(abs_bits, axis=1)
    finite = max_bits < _INF_BITS  # NaN and Inf have the largest bit patterns
    # Non-finite blocks are encoded as zeros (then q_max = 255): no NaN/Inf reaches a float-to-int cast.
    mag = tl.where(finite[:, None], abs_bits, 0).to(tl.float32, bitcast=True)
    block_max = tl.where(finite, max_bits, 0).to(tl.float32, bitcast=True)

    # q_max: guess with the (approximate) log, then settle against the exact thresholds T[q0], T[q0 + 1].
    guess = 6.0 * tl.log(tl.maximum(block_max, 1e-30)) + 129.0
    q0 = tl.minimum(tl.maximum(guess, 0.0), 254.0).to(tl.int32)
    below = tl.load(thresholds_ptr + q0)
    above = tl.load(thresholds_ptr + q0 + 1)
    q_max = q0 + (block_max >= above).to(tl.int32) - (block_max < below).to(tl.int32)

    # q_i: j = round(sqrt(|x| / S) / 2 + 1/2) is the one level whose boundary (2j - 1)^2 S the value can be
    # near (sqrt(|x| / S) = 2j - 1 there; a guess error only moves j where sqrt(|x| / S) is an even number,
    # half-way between boundaries, and both neighbours then give the same q). One exact comparison settles q.
    scale = tl.load(scales_ptr + q_max)[:, None]
    inverse_scale = tl.load(inverse_scales_ptr + q_max)[:, None]
    j = tl.floor(tl.minimum(tl.sqrt(mag * inverse_scale) * 0.5 + 1.0, 16.0))
    edge = 2.0 * j - 1.0  # small integers: exact in float32, so edge * edge * S is the reference's product
    q = tl.minimum(j - (mag < edge * edge * scale).to(tl.float32), 15.0).to(tl.uint32)

    # Pack: sign byte (IEEE sign bits), nibble word (byte 2 + j = element 2j high, 2j + 1 low) little-endian.
    sign_byte = tl.sum((bits < 0).to(tl.uint32) << lanes[None, :].to(tl.uint32), axis=1)
    nibble_shift = (8 * (lanes // 2) + 4 * (1 - lanes % 2)).to(tl.uint32)
    word = tl.sum(q << nibble_shift[None, :], axis=1)
    sign_byte = tl.where(finite, sign_byte, 0)
    word = tl.where(finite, word, 0)
    q_max = tl.where(finite, q_max, 255).to(tl.uint32)

    # A block's 6 bytes as three 16-bit stores (out_ptr is an int16 view; block b at halves 3b..3b + 2).
    out = out_ptr + first * 3 + blocks * 3
    valid = blocks < n_blocks - first
    tl.store(out, (q_max | (sign_byte << 8)).to(tl.int16), mask=valid)
    tl.store(out + 1, (word & 0xFFFF).to(tl.int16), mask=valid)
    tl.store(out + 2, (word >> 16).to(tl.int16), mask=valid)


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
        t = squinch.tables(x.device)
        grid = (triton.cdiv(n_blocks, _ENCODE_BLOCKS),)
        _encode_kernel[grid](x, out.view(torch.int16), t.thresholds, t.scales, t.inverse_scales, n, n_blocks,
                             BLOCKS=_ENCODE_BLOCKS, num_warps=_NUM_WARPS)
    return out


def decode(encoded: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode ``numel`` float32 values; see ``squinch.decode`` (which validates the arguments)."""
    encoded = encoded.contiguous()
    n_blocks = encoded.numel() // squinch.BLOCK_BYTES
    out = torch.empty(numel, dtype=torch.float32, device=encoded.device)
    if n_blocks:
        grid = (triton.cdiv(n_blocks, _DECODE_BLOCKS),)
        _decode_kernel[grid](encoded, out, squinch.tables(encoded.device).scales, numel, n_blocks,
                             BLOCKS=_DECODE_BLOCKS, num_warps=_NUM_WARPS)
    return out
