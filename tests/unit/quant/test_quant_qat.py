"""QAT fake quantisation and clamping, INT8 forward linears: hand-computed values, clamping fractions,
and short training runs of both against bf16/fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_ext.models.ffn import FeedForward
from torchtitan_ext.quant.int8 import Int8Linear, apply_int8_forward, int8_matmul, reference_int8_linear
from torchtitan_ext.quant.qat import QATFeedForward, clamp_limits, fake_quant


def test_fake_quant_by_hand():
    # limit 1.27: step 0.01; 0.123 -> 0.12, -0.456 -> -0.46, 2.0 clamps to 1.27, -5 to -1.27
    x = torch.tensor([0.123, -0.456, 2.0, -5.0, 0.0], dtype=torch.float64, requires_grad=True)
    y = fake_quant(x, 1.27)
    assert y.tolist() == pytest.approx([0.12, -0.46, 1.27, -1.27, 0.0])
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]  # straight-through inside, zero where clipped
    # round trip: values on the grid come back unchanged
    grid = torch.arange(-127, 128, dtype=torch.float64) * (4.0 / 127)
    torch.testing.assert_close(fake_quant(grid, 4.0), grid)


def test_clamp_limits_formula():
    w = torch.full((8, 16), 0.5)
    assert clamp_limits(w, "static", 4.0) == (4.0, 16.0)
    lin, lout = clamp_limits(w, "dynamic", 3.0)
    assert float(lin) == pytest.approx(3.0 * 0.5 * 4.0)  # factor x rms(w) x sqrt(fan_in)
    assert float(lout) == pytest.approx(36.0)


def _middle_zero_fraction(clamp: str) -> float:
    torch.manual_seed(0)
    ffn = FeedForward(64, 256, "relu2")
    with torch.no_grad():
        ffn.w1.weight.normal_(0, 0.02).mul_(0.1)  # w_in scaled down 10x
    qat = QATFeedForward(ffn, clamp, 4.0)
    x = F.rms_norm(torch.randn(512, 64), (64,))
    h, q_out = qat.middle(x)
    active = h > 0
    return (q_out[active] == 0).float().mean().item()


def test_static_clamp_zeroes_small_middles_dynamic_does_not():
    static, dynamic = _middle_zero_fraction("static"), _middle_zero_fraction("dynamic")
    print(f"fraction of positive middle values quantised to 0: static {static:.3f}, dynamic {dynamic:.3f}")
    assert static > 0.95
    assert dynamic < 0.3  # expected ~0.2: h^2 < limit_out / 254 for 0 < h < 0.25 sigma


def test_int8_matmul_exact_and_linear_matches_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, 40), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (40, 7), generator=g, dtype=torch.int8)
    assert torch.equal(int8_matmul(a, b), a.long() @ b.long())
    lin = torch.nn.Linear(40, 24, bias=False)
    x = torch.randn(3, 5, 40, generator=g)
    ref_float = lin(x)
    lin.__class__ = Int8Linear
    y = lin(x)
    torch.testing.assert_close(y.double(), reference_int8_linear(x, lin.weight), rtol=1e-6, atol=1e-6)
    assert (y - ref_float).abs().max() < 0.02 * ref_float.abs().max()  # int8 error is small
    # backward: straight-through, from the unquantised tensors
    xr = x.clone().requires_grad_()
    lin(xr).sum().backward()
    torch.testing.assert_close(xr.grad, torch.ones(3, 5, 24) @ lin.weight.detach())
    torch.testing.assert_close(lin.weight.grad, torch.ones(15, 24).t() @ x.reshape(15, 40))


def test_apply_int8_forward_swaps_block_linears_only():
    from torchtitan_ext.models.args import ModelArgs
    from torchtitan_ext.models.decoder import Decoder
    model = Decoder(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_hidden=64))
    assert apply_int8_forward(model) == 2 * (4 + 3)
    assert type(model.output) is torch.nn.Linear


def test_export_packing_by_hand():
    from torchtitan_ext.quant.export import pack, quantize_rows, unpack
    levels = torch.tensor([-31, 0, 31, 5, -7], dtype=torch.int8)
    packed = pack(levels, 6)
    # offsets 0, 31, 62, 36 in one 24-bit word, then 24 and three zero pads: 3 bytes per 4 values
    word = 0 | 31 << 6 | 62 << 12 | 36 << 18
    assert packed[:3].tolist() == [word & 255, word >> 8 & 255, word >> 16 & 255] and len(packed) == 6
    assert torch.equal(unpack(packed, 6, 5), levels)
    assert torch.equal(unpack(pack(levels, 8), 8, 5), levels)
    q, s = quantize_rows(torch.tensor([[1.27, -0.5, 0.0], [0.0, 0.0, -2.54]]), 8)
    assert q.tolist() == [[127, -50, 0], [0, 0, -127]]
    assert s.float().flatten().tolist() == pytest.approx([0.01, 0.02], rel=1e-3)
