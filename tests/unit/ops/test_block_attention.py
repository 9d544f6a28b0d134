"""Block attention and its LSE merge against whole-sequence attention in float64 (CPU, one process): the
kernels the ring runs at each step, all chunks in one process."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.ops.attention import dense_attention
from torchtitan_ext.ops.block_attention import block_backward, block_forward, merge
from torchtitan_ext.ops.visibility import document_visibility, visibility_mask


def _qkv(b=2, h=4, hk=2, t=24, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hk, hk)]


@pytest.mark.parametrize("masked", [False, True])
def test_merged_blocks_equal_whole_attention_forward_and_backward(masked):
    q, k, v = _qkv()
    t = q.shape[2]
    if masked:
        mask = visibility_mask(*document_visibility([5, 11, 8])).expand(2, t, t)
    else:
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(2, t, t)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, ref_lse = dense_attention(qr, kr, vr, mask, scale=0.3)
    dout, dlse = torch.randn_like(ref), torch.randn_like(ref_lse)
    ((ref * dout).sum() + (ref_lse * dlse).sum()).backward()

    cuts = [0, 7, 16, 24]  # three uneven key blocks
    out = lse = None
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        out_i, lse_i = block_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], "masked", mask[:, :, lo:hi], 0.3)
        out, lse = merge(out, lse, out_i, lse_i)
    torch.testing.assert_close(out, ref.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-12, rtol=1e-12)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        g = block_backward(dout, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, "masked", mask[:, :, lo:hi], 0.3,
                           dlse)
        dq += g[0]
        dk[:, :, lo:hi], dv[:, :, lo:hi] = g[1], g[2]
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_causal_and_full_kinds_equal_their_masks():
    q, k, v = _qkv(t=12)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None].expand(2, 12, 12)
    for kind, mask in (("causal", causal), ("full", torch.ones_like(causal))):
        got = block_forward(q, k, v, kind)
        want = block_forward(q, k, v, "masked", mask)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_block_no_query_sees_adds_nothing():
    q, k, v = _qkv(t=6)
    out, lse = block_forward(q, k, v, "causal")
    out_i, lse_i = block_forward(q, k, v, "masked", torch.zeros(2, 6, 6, dtype=torch.bool))
    assert torch.all(out_i == 0) and torch.all(lse_i == float("-inf"))
    merged, merged_lse = merge(out, lse, out_i, lse_i)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
