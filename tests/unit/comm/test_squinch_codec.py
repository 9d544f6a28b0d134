"""The Squinch codec: exact bytes of hand-computed blocks, the published formula, the error bound, Triton.

Round-trip error bound (the one ``squinch.py`` refers to)
--------------------------------------------------------
Take one finite block with maximum ``m`` and ``q_max`` from byte 0, and let ``S`` be the float32 scale the
codec uses for it, ``S = maxabs / 900`` with ``maxabs = exp((q_max - 128) / 6)`` (``squinch.SCALES``).
For a value ``x`` of the block write ``r = sqrt(|x| / S) / 2 = 15 sqrt(|x| / maxabs)``: then ``|x| = 4 r^2 S``
and the formula ``q = min(int(sqrt(|x| / maxabs) * 15 + 0.5), 15)`` is ``min(floor(r + 1/2), 15)``.

1. No saturation: ``q_max = int(6 ln m + 129)`` gives ``(q_max - 128) / 6 > ln m``, so ``|x| <= m < maxabs``
   and ``r < 15``; the clip at 0 (``m < exp(-128/6) = maxabs(0)``) keeps ``r < 15`` too. Only the clip at
   254 (``m >= exp(21)``) lets ``r`` exceed 15.5, where ``q`` saturates at 15.
2. Unsaturated, ``q`` is ``r`` rounded half up, so ``|q - r| <= 1/2`` and ``q + r <= 2 r + 1/2``. Decoding
   gives ``4 q^2 S``, hence

       |decode - x| = 4 S |q - r| (q + r) <= 2 S (2 r + 1/2) = 2 sqrt(S |x|) + S.

   The bound is reached at the rounding boundaries ``|x| = (2j - 1)^2 S`` (error ``(4j - 1) S``).
3. float32: the encoder compares ``|x|`` with the float32 products ``(2j - 1)^2 S`` and the decoder rounds
   ``4 q^2 S`` once, each a relative error of at most 2^-24. A threshold rounding can move ``q`` by one only
   when ``|x|`` is within 2^-24 of the boundary, where it adds at most ``((2j - 1)^2 + 4 j^2) S 2^-24`` to an
   error bound of ``(4j - 1) S``: a relative excess below ``2 j 2^-24 <= 1.8e-6``. The tests allow 1e-5.
4. Per block: with ``|x| <= m`` and, when ``q_max`` is not clipped, ``maxabs <= e^{1/6} m``,

       |decode - x| <= 2 sqrt(S m) + S <= m (2 sqrt(e^{1/6} / 900) + e^{1/6} / 900) = 0.07378 m.

   A block clipped to ``q_max = 0`` keeps ``r < 15``, so its error is below ``61 S(0) ~ 3.7e-11``.

Non-finite blocks decode to NaN by design (``q_max = 255``); saturated blocks (``q_max = 254`` and
``|x| > 961 S``) decode to ``+-900 S = +-exp(21)``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_ext.comm import squinch
from torchtitan_ext.comm.squinch import decode_reference, encode_reference

NAN, INF = float("nan"), float("inf")
FLT_MAX = 3.4028234663852886e38
BOUND_SLACK = 1 + 1e-5  # float32 rounding of the thresholds and of the decode product (docstring, 3.)
BLOCK_BOUND = 0.07378 * BOUND_SLACK  # docstring, 4.


def _hex(t: torch.Tensor) -> str:
    return " ".join(f"{b:02X}" for b in t.tolist())


def _expected_decode(q_max: int, signs: list[int], qs: list[int]) -> list[float]:
    """The published decode ``sign * (q / 15)^2 * exp((q_max - 128) / 6)`` in float64."""
    maxabs = math.exp((q_max - 128) / 6)
    return [(-1.0 if s else 1.0) * (q / 15) ** 2 * maxabs for s, q in zip(signs, qs, strict=True)]


# ------------------------------------------------------------------------------------ hand-computed blocks
# Each case: input values, the bytes worked out from the formula (Python's math module; the comments give
# 6 ln(max) + 129 and y_i = sqrt(|x_i| / maxabs) * 15 + 0.5, whose int() is q_i), and the q_i / sign bits
# the decoded values follow from.
HAND_BLOCKS = {
    # max (14/15)^2 = 0.8711: 6 ln + 129 = 128.172 -> q_max 128 (0x80), maxabs = 1. Values (k/15)^2 give
    # y = k + 0.5 -> q = k (half a step from either boundary). Negative: elements 1, 3, 5, 6 -> 0x6A.
    "mixed_signs": (
        [(14 / 15) ** 2, -(1 / 15) ** 2, (7 / 15) ** 2, -(10 / 15) ** 2, 0.0, -(3 / 15) ** 2,
         -(12 / 15) ** 2, (5 / 15) ** 2],
        "80 6A E1 7A 03 C5", [14, 1, 7, 10, 0, 3, 12, 5]),
    # max 1000: 6 ln 1000 + 129 = 170.45 -> 170 (0xAA), maxabs = e^7 = 1096.63; y(1000) = 14.82 -> 14, the
    # small ones have y in [0.50, 0.53) -> 0. Negative: elements 2, 6 -> 0x44 (kept though q = 0: -0.0).
    "one_huge": (
        [1e-3, 2e-3, -1e-3, 1000.0, 5e-3, 0.0, -3e-3, 1e-4],
        "AA 44 00 0E 00 00", [0, 0, 0, 14, 0, 0, 0, 0]),
    # ln(0) = -inf clips to q_max 0; every q = 0.
    "all_zeros": ([0.0] * 8, "00 00 00 00 00 00", [0] * 8),
    # -0.0 keeps its sign bit (elements 0, 3, 7 -> 0x89) in an otherwise zero block.
    "negative_zeros": (
        [-0.0, 0.0, 0.0, -0.0, 0.0, 0.0, 0.0, -0.0],
        "00 89 00 00 00 00", [0] * 8),
    # max 3e-10: 6 ln + 129 = -2.56 -> int -2 -> clipped to q_max 0, maxabs = e^(-128/6) = 5.4331e-10.
    # y = 11.65, 6.94, 9.60, 0.5, 11.65, 0.5 (1e-45: a float32 subnormal), 5.05, 10.68. Negative: 1, 4, 7.
    "tiny_clipped": (
        [3e-10, -1e-10, 2e-10, 0.0, -3e-10, 1e-45, 5e-11, -2.5e-10],
        "00 92 B6 90 B0 5A", [11, 6, 9, 0, 11, 0, 5, 10]),
    # max 6e-10: 6 ln + 129 = 1.60 -> q_max 1, maxabs = e^(-127/6) = 6.4185e-10; y = 15.003, 6.42, 8.87,
    # 12.34 (the first within 0.003 of 15: float32 error is ~1e-6 of a step). Negative: element 1.
    "tiny_q1": (
        [6e-10, -1e-10, 2e-10, 4e-10, 0.0, 0.0, 0.0, 0.0],
        "01 02 F6 8C 00 00", [15, 6, 8, 12, 0, 0, 0, 0]),
    # Decreasing magnitudes: max 100, 6 ln 100 + 129 = 156.63 -> 156 (0x9C), maxabs = e^(28/6) = 106.34;
    # y = 15.05, 10.79, 7.77, 5.10, 3.75, 2.56, 1.95, 0.5. Negative: 1, 3, 5, 7 (-0.0) -> 0xAA.
    "ladder": (
        [100.0, -50.0, 25.0, -10.0, 5.0, -2.0, 1.0, -0.0],
        "9C AA FA 75 32 10", [15, 10, 7, 5, 3, 2, 1, 0]),
}


@pytest.mark.parametrize("name", list(HAND_BLOCKS))
def test_hand_computed_block(name: str) -> None:
    values, expected_hex, qs = HAND_BLOCKS[name]
    x = torch.tensor(values, dtype=torch.float32)
    encoded = squinch.encode(x)
    assert _hex(encoded) == expected_hex
    assert _hex(encode_reference(x)) == expected_hex
    q_max, sign_byte = encoded[0].item(), encoded[1].item()
    signs = [(sign_byte >> i) & 1 for i in range(8)]
    decoded = squinch.decode(encoded, 8)
    torch.testing.assert_close(decoded.double(), torch.tensor(_expected_decode(q_max, signs, qs), dtype=torch.float64),
                               rtol=2.5e-7, atol=0)  # S and the product are each rounded to float32 once
    # Where q = 0 the decoded value is an exact zero carrying the input's sign bit.
    zeros = torch.tensor(qs) == 0
    assert torch.equal(decoded[zeros], torch.zeros(int(zeros.sum())))
    assert torch.equal(torch.signbit(decoded), torch.signbit(x))


def test_saturated_block() -> None:
    """Finite blocks clip at q_max 254 (6 ln(1e10) + 129 = 267.2; FLT_MAX gives 661.3) and saturate at e^21."""
    x = torch.tensor([1e10, -1.0, 2e9, 0.0, 0.0, 0.0, 0.0, -FLT_MAX])
    # maxabs = e^(126/6) = e^21 = 1.3188e9; y = 41.8, 0.5004, 18.97, 0.5 x 4, 7.6e15 -> 15, 0, 15, 0, ..., 15.
    assert _hex(squinch.encode(x)) == "FE 82 F0 F0 00 0F"
    decoded = squinch.decode(squinch.encode(x), 8)
    e21 = math.exp(21)
    expected = torch.tensor([e21, -0.0, e21, 0.0, 0.0, 0.0, 0.0, -e21], dtype=torch.float64)
    torch.testing.assert_close(decoded.double(), expected, rtol=2.5e-7, atol=0)
    assert torch.equal(torch.signbit(decoded), torch.signbit(x))


def test_padding_to_whole_blocks() -> None:
    """11 values -> 2 blocks (12 bytes); the second is [0.5, -0.25, 0.125] plus five zeros of padding."""
    first = HAND_BLOCKS["mixed_signs"][0]
    x = torch.tensor([*first, 0.5, -0.25, 0.125])
    encoded = squinch.encode(x)
    # Block 1: max 0.5, 6 ln 0.5 + 129 = 124.84 -> 124 (0x7C), maxabs = e^(-4/6) = 0.51342;
    # y = 15.30, 10.97, 7.90 -> 15, 10, 7; padding y = 0.5 -> 0. Negative: element 1 -> 0x02.
    assert _hex(encoded) == "80 6A E1 7A 03 C5 7C 02 FA 70 00 00"
    assert squinch.encoded_numel(11) == 12
    decoded = squinch.decode(encoded, 11)
    assert decoded.shape == (11,)
    torch.testing.assert_close(decoded[8:].double(), torch.tensor(_expected_decode(124, [0, 1, 0], [15, 10, 7]),
                                                                   dtype=torch.float64), rtol=2.5e-7, atol=0)
    assert torch.equal(decoded[:8], squinch.decode(squinch.encode(torch.tensor(first)), 8))
    with pytest.raises(ValueError, match="need 12 bytes"):
        squinch.decode(encoded[:6], 11)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_block(bad: float) -> None:
    """A block with a NaN or +-Inf is FF 00 00 00 00 00 and decodes to eight NaNs; neighbours are untouched."""
    block = [1.0, -2.0, bad, 3.0, 0.0, -0.0, 4.0, 5.0]
    x = torch.tensor([*HAND_BLOCKS["ladder"][0], *block, *HAND_BLOCKS["mixed_signs"][0]])
    encoded = squinch.encode(x)
    assert _hex(encoded) == "9C AA FA 75 32 10 FF 00 00 00 00 00 80 6A E1 7A 03 C5"
    decoded = squinch.decode(encoded, 24)
    assert torch.isnan(decoded[8:16]).all()
    assert torch.isfinite(decoded[:8]).all() and torch.isfinite(decoded[16:]).all()


def test_low_precision_inputs_encode_like_their_float32_values() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g) * 10
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        assert torch.equal(squinch.encode(low), squinch.encode(low.float()))
    assert torch.equal(squinch.encode(x.double()), squinch.encode(x))  # float64 is rounded to float32 first
    empty = squinch.encode(torch.empty(0))
    assert empty.numel() == 0 and squinch.decode(empty, 0).numel() == 0


# -------------------------------------------------------------------------- the published formula in float64

def _boundary_values() -> torch.Tensor:
    """float32 values at and next to every q_max threshold exp((k - 129) / 6) and every q_i boundary."""
    values = []
    shares = torch.tensor([1.0, -0.7, 0.3, 0.05, -0.0, 0.9, -0.5, 1e-3])  # each one the max of its own block
    for k in range(1, 255):
        t = torch.tensor(math.exp((k - 129) / 6), dtype=torch.float32)
        for v in (torch.nextafter(t, torch.tensor(0.0)), t, torch.nextafter(t, torch.tensor(INF))):
            values += list(v * shares)
    for q_max in (0, 1, 60, 128, 129, 200, 253, 254):
        maxabs = math.exp((q_max - 128) / 6)
        # A block max just below the next threshold keeps q_max; the boundaries are (2j - 1)^2 maxabs / 900.
        top = torch.tensor(math.exp((q_max - 128) / 6) * 0.9999, dtype=torch.float32)
        for j in range(1, 16):
            b = torch.tensor((2 * j - 1) ** 2 * maxabs / 900, dtype=torch.float32)
            for v in (torch.nextafter(b, torch.tensor(0.0)), b, torch.nextafter(b, torch.tensor(INF))):
                values += [top, v, -v, v, top * 0.5, v, -v, v]  # whole blocks sharing the max `top`
    for q_max in range(255):
        # The float32 products (2j - 1)^2 * S the codec compares against, for every q_max.
        top = torch.nextafter(squinch.QMAX_THRESHOLDS[q_max + 1], torch.tensor(0.0))
        for j in range(1, 16):
            b = torch.tensor(float((2 * j - 1) ** 2)) * squinch.SCALES[q_max]
            for v in (torch.nextafter(b, torch.tensor(0.0)), b, torch.nextafter(b, torch.tensor(INF))):
                values += [top, v, -v, v, top * 0.5, v, -v, v]
    flat = torch.stack([v.reshape(()) for v in values])
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8))


def _formula_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = 4096
    magnitudes = torch.exp(torch.empty(n).uniform_(-60, 60, generator=g))  # e^-60 .. e^60
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return {
        "normal": torch.randn(n, generator=g),
        "uniform": torch.rand(n, generator=g) * 2 - 1,
        "cauchy": torch.empty(n).cauchy_(generator=g),
        "many_magnitudes": magnitudes * signs,
        "boundaries": _boundary_values(),
    }


def _formula_q_max(x: torch.Tensor) -> tuple[list[int], list[float]]:
    """Per block ``clip(int(6 ln m + 129), 0, 254)`` and ``6 ln m + 129`` in float64 with math."""
    values = x.double().tolist()
    q_maxes, raws = [], []
    for b in range(0, len(values), 8):
        m = max(abs(v) for v in values[b:b + 8])
        raw = 6 * math.log(m) + 129 if m > 0 else -math.inf
        q_maxes.append(0 if raw == -math.inf else min(max(int(raw), 0), 254))
        raws.append(raw)
    return q_maxes, raws


def _formula_levels(values: list[float], q_maxes: list[int]) -> tuple[list[int], list[float]]:
    """Per value ``min(int(y), 15)`` and ``y = sqrt(|x| / maxabs) * 15 + 0.5`` in float64 with math, for the
    given per-block ``q_max`` (the reference's, so a q_max disagreement is not counted again per value)."""
    qs, ys = [], []
    for i, v in enumerate(values):
        maxabs = math.exp((q_maxes[i // 8] - 128) / 6)
        y = math.sqrt(abs(v) / maxabs) * 15 + 0.5
        qs.append(min(int(y), 15))
        ys.append(y)
    return qs, ys


@pytest.mark.parametrize("dist", list(_formula_inputs()))
def test_reference_equals_published_formula(dist: str) -> None:
    """Byte 0 equals clip(int(6 ln(max) + 129), 0, 254) exactly (the thresholds are exact); the nibbles equal
    min(int(sqrt(|x| / maxabs) * 15 + 0.5), 15) except where y lies within float32 rounding of an integer."""
    x = _formula_inputs()[dist]
    encoded = encode_reference(x).view(-1, 6).long()
    ref_q_max = encoded[:, 0].tolist()
    ref_q = torch.stack([encoded[:, 2:] >> 4, encoded[:, 2:] & 15], dim=2).reshape(-1).tolist()
    ref_sign = ((encoded[:, 1:2] >> torch.arange(8)) & 1).reshape(-1)
    q_maxes, raws = _formula_q_max(x)
    bad_q_max = [(b, raws[b], q_maxes[b], ref_q_max[b]) for b in range(len(raws))
                 if q_maxes[b] != ref_q_max[b] and not abs(raws[b] - round(raws[b])) < 1e-9]
    assert not bad_q_max, f"q_max differs from the formula (block, 6 ln m + 129, formula, reference): {bad_q_max[:5]}"
    assert torch.equal(ref_sign.bool(), torch.signbit(x))
    qs, ys = _formula_levels(x.double().tolist(), ref_q_max)
    # A y within 2e-6 of an integer may round either way: relative threshold rounding 1.2e-7 moves y by
    # (y - 0.5) * 1.2e-7 / 2 < 1e-6.
    mismatches = [(i, ys[i], qs[i], ref_q[i]) for i in range(len(qs)) if qs[i] != ref_q[i]]
    bad_q = [m for m in mismatches if not (abs(m[1] - round(m[1])) < 2e-6 and abs(m[2] - m[3]) == 1)]
    assert not bad_q, f"q_i differs from the formula away from a boundary (index, y, formula, ref): {bad_q[:5]}"
    if dist != "boundaries":
        assert len(mismatches) <= 2  # random values almost never sit on a boundary


# --------------------------------------------------------------------------------------------- error bound

def _bound_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = 1 << 16
    student = torch.distributions.StudentT(torch.tensor(2.0)).sample((n,))  # global RNG, seeded below
    magnitudes = torch.exp(torch.empty(n).uniform_(-80, 80, generator=g))  # beyond both clips
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    gradient_like = torch.randn(n, generator=g) * 1e-3
    gradient_like[torch.randint(0, n, (64,), generator=g)] *= 1e3  # rare outliers dominating their block
    return {
        "normal": torch.randn(n, generator=g),
        "uniform": torch.rand(n, generator=g) * 2 - 1,
        "student_t2": student,
        "cauchy": torch.empty(n).cauchy_(generator=g),
        "many_magnitudes": magnitudes * signs,
        "gradient_like": gradient_like,
        "bf16_normal": (torch.randn(n, generator=g) * 0.02).bfloat16(),
        "bf16_cauchy": torch.empty(n).cauchy_(generator=g).bfloat16(),
        "fp16_uniform": (torch.rand(n, generator=g) - 0.5).half(),
        "subnormal": torch.randn(n, generator=g) * 1e-40,
    }


@pytest.mark.parametrize("dist", ["normal", "uniform", "student_t2", "cauchy", "many_magnitudes", "gradient_like",
                                  "bf16_normal", "bf16_cauchy", "fp16_uniform", "subnormal"])
def test_round_trip_error_bound(dist: str) -> None:
    torch.manual_seed(2)
    x = _bound_inputs()[dist]
    n = x.numel() - 3  # not a multiple of 8: the last block is padded
    x = x[:n]
    exact = x.double()
    encoded = squinch.encode(x)
    decoded = squinch.decode(encoded, n).double()
    pad = (-n) % 8
    q_max = encoded.view(-1, 6)[:, 0].long()
    scale = squinch.SCALES.double()[q_max].repeat_interleave(8)[:n]
    saturated = (q_max == 254).repeat_interleave(8)[:n] & (exact.abs() > 961 * scale)
    assert (q_max < 255).all()
    err = (decoded - exact).abs()
    bound = (2 * torch.sqrt(scale * exact.abs()) + scale) * BOUND_SLACK
    ok = (err <= bound) | saturated
    assert ok.all(), f"{int((~ok).sum())} values exceed the bound, e.g. x={exact[~ok][:3]}, err={err[~ok][:3]}"
    # Saturated values decode to +-exp(21) with their sign.
    torch.testing.assert_close(decoded[saturated], torch.sign(exact[saturated]) * 900 * scale[saturated],
                               rtol=2.5e-7, atol=0)
    # Per block: at most 0.0738 of the block max (unclipped q_max), 61 S(0) for blocks clipped to 0.
    block_max = torch.nn.functional.pad(exact.abs(), (0, pad)).view(-1, 8).amax(dim=1)
    block_err = torch.nn.functional.pad(err, (0, pad)).view(-1, 8).amax(dim=1)
    unclipped = (q_max > 0) & (q_max < 254)
    assert (block_err[unclipped] <= BLOCK_BOUND * block_max[unclipped]).all()
    assert (block_err[q_max == 0] <= 61 * squinch.SCALES.double()[0] * BOUND_SLACK).all()
    if dist in ("normal", "uniform", "bf16_normal", "fp16_uniform"):
        assert unclipped.all()


def test_bound_is_tight_at_a_boundary() -> None:
    """Just above the boundary (2j - 1)^2 S the value rounds up and the error is the bound itself."""
    scale = squinch.SCALES[128].item()
    for j in (1, 8, 15):
        b = torch.tensor((2 * j - 1) ** 2 * scale, dtype=torch.float32)
        x = torch.stack([torch.tensor(0.9), torch.nextafter(b, torch.tensor(1.0)), *torch.zeros(6)])
        decoded = squinch.decode(squinch.encode(x), 8).double()
        err = (decoded[1] - x[1].double()).abs()
        bound = 2 * math.sqrt(scale * x[1].item()) + scale
        assert bound * (1 - 1e-5) <= err <= bound * BOUND_SLACK


# ------------------------------------------------------------------------ Triton kernels (interpreter, CPU)

TRITON_SIZES = [0, 1, 7, 8, 9, 63, 4095, 4096, 4097, 3 * 4096 + 5, 2 * 4096 + 8]


def _triton_inputs() -> dict[str, torch.Tensor]:
    """Sizes around the kernels' 512-block (4096-value) tile; non-finite, -0.0, subnormal and boundary values."""
    g = torch.Generator().manual_seed(5)
    cases = {}
    for n in TRITON_SIZES:
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
        if n >= 64:
            specials = torch.tensor([NAN, INF, -INF, -0.0, 1e-45, -3e-39, FLT_MAX, -FLT_MAX, 0.0])
            idx = torch.randperm(n, generator=g)[:specials.numel()]
            x[idx] = specials
            x[n // 2: n // 2 + 8] = 0.0  # an all-zero block
            x[n // 3: n // 3 + 8] = -0.0
        cases[f"f32_{n}"] = x
    cases["bf16_4097"] = (torch.randn(4097, generator=g) * 1e-2).bfloat16()
    cases["f16_1001"] = (torch.randn(1001, generator=g)).half()
    cases["boundaries"] = _boundary_values()
    return cases


def triton_interpreter_main(out_path: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: the Triton and reference encodings and decodings."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    g = torch.Generator().manual_seed(6)
    for name, x in _triton_inputs().items():
        n = x.numel()
        results[name] = {
            "triton_bytes": squinch.encode(x, backend="triton"), "ref_bytes": encode_reference(x),
        }
        ref_bytes = results[name]["ref_bytes"]
        results[name]["triton_decoded"] = squinch.decode(ref_bytes, n, backend="triton")
        results[name]["ref_decoded"] = decode_reference(ref_bytes, n)
    # Decoding arbitrary bytes (every q_max, 255 with non-zero nibbles and sign bits included).
    for n in (5, 4096 + 24):
        raw = torch.randint(0, 256, (squinch.encoded_numel(n),), dtype=torch.uint8, generator=g)
        q_maxes = raw.view(-1, 6)[:, 0]
        q_maxes.copy_(torch.arange(q_maxes.numel()) % 256)  # every q_max, 255 included
        results[f"random_bytes_{n}"] = {
            "triton_decoded": squinch.decode(raw, n, backend="triton"), "ref_decoded": decode_reference(raw, n)}
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory) -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable (pip install triton) so its interpreter cannot run on CPU")
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); import test_squinch_codec as t; "
            f"t.triton_interpreter_main({str(out)!r})")
    # TRITON_INTERPRET must be set before triton decorates the kernels: a fresh process guarantees it.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=here.parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that a NaN may carry any payload (both must be NaN at the same places)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("name", [*_triton_inputs(), "random_bytes_5", "random_bytes_4120"])
def test_triton_matches_reference(triton_results: dict, name: str) -> None:
    r = triton_results[name]
    if "triton_bytes" in r:
        assert r["triton_bytes"].dtype == torch.uint8
        mismatch = (r["triton_bytes"] != r["ref_bytes"]).nonzero().flatten()
        assert torch.equal(r["triton_bytes"], r["ref_bytes"]), f"bytes differ at {mismatch[:10].tolist()}"
    assert r["triton_decoded"].dtype == torch.float32
    assert r["triton_decoded"].shape == r["ref_decoded"].shape
    assert _same_floats(r["triton_decoded"], r["ref_decoded"])
