"""The ring's per-chunk attention on the GPU, all chunks in one process (no process group): 64k tokens in
bf16 cut as 4 CP ranks would hold them, every ring step's blocks run by the fused block kernels and merged
by their LSE, the backward from the merged output and LSE. Output, LSE and q / k / v gradients against
float32 whole-sequence attention, no further from it than bf16 whole-sequence attention is; causal and
document masks, GQA."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.ops.attention import _flex
from torchtitan_ext.ops.block_attention import block_backward, block_forward, merge
from torchtitan_ext.ops.visibility import causal_block_mask, document_visibility, flex_block_mask
from torchtitan_ext.parallel.context_parallel import causal_steps, masked_steps
from torchtitan_ext.parallel.cp_layout import local_indices, shard_sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ, CP, HEADS, KV_HEADS, HDIM = 65536, 4, 8, 2, 64


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _whole(q, k, v, block_mask, dout):
    """(out, lse, dq, dk, dv) of whole-sequence FlexAttention in q's dtype."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = _flex(q, k, v, block_mask, return_lse=True)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _chunked(q, k, v, visibility, dout):
    """The same from the ring's steps, rank after rank: (out, lse, dq, dk, dv) in natural order."""
    shard = [(lambda x, r=r: shard_sequence(x, CP, r, dim=2)) for r in range(CP)]
    keys = None
    if visibility is not None:
        start, limit = (x.cuda() for x in visibility)
        keys = torch.stack([torch.stack((shard_sequence(start, CP, r), shard_sequence(limit, CP, r)))
                            for r in range(CP)])
    out, lse, dq = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device), torch.empty_like(q)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for rank in range(CP):
        index = local_indices(SEQ, CP, rank, q.device)
        steps = causal_steps(SEQ // CP, CP, rank) if keys is None else masked_steps(index, keys, rank)
        q_r, dout_r = shard[rank](q), shard[rank](dout)
        o = l = None  # noqa: E741
        for s, blocks in enumerate(steps):
            src = (rank - s) % CP
            k_s, v_s = shard[src](k), shard[src](v)
            assert len(blocks) == 1
            (blk,) = blocks
            o_i, l_i = block_forward(q_r[:, :, blk.q_rows], k_s[:, :, blk.k_rows], v_s[:, :, blk.k_rows],
                                     blk.kind, blk.mask)
            if o is None:
                o = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
                l = torch.full(q_r.shape[:3], float("-inf"), device=q.device)  # noqa: E741
            o[:, :, blk.q_rows], l[:, :, blk.q_rows] = merge(o[:, :, blk.q_rows], l[:, :, blk.q_rows], o_i, l_i)
        o = o.to(q.dtype)
        dq_r = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
        for s, blocks in enumerate(steps):
            src = (rank - s) % CP
            k_s, v_s = shard[src](k), shard[src](v)
            for blk in blocks:
                g = block_backward(dout_r[:, :, blk.q_rows], q_r[:, :, blk.q_rows], k_s[:, :, blk.k_rows],
                                   v_s[:, :, blk.k_rows], o[:, :, blk.q_rows], l[:, :, blk.q_rows], blk.kind,
                                   blk.mask)
                dq_r[:, :, blk.q_rows] += g[0].float()
                src_index = local_indices(SEQ, CP, src, q.device)[blk.k_rows]
                dk[:, :, src_index] += g[1].float()
                dv[:, :, src_index] += g[2].float()
        out[:, :, index], lse[:, :, index], dq[:, :, index] = o, l, dq_r.to(q.dtype)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_ring_chunks_at_64k_equal_whole_sequence_attention_bf16(mask):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, n, SEQ, HDIM, device="cuda", generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
    dout = torch.randn(1, HEADS, SEQ, HDIM, device="cuda", generator=gen)
    if mask == "causal":
        visibility, block_mask = None, causal_block_mask(SEQ, torch.device("cuda"))
    else:  # documents of uneven lengths crossing the chunk borders
        lengths = [5000, 12000, 300, 20000, 8236, 20000]
        visibility = document_visibility(lengths)
        block_mask = flex_block_mask(*(x.cuda() for x in visibility))
    reference = _whole(q, k, v, block_mask, dout)  # float32
    whole = _whole(q.bfloat16(), k.bfloat16(), v.bfloat16(), block_mask, dout.bfloat16())
    chunked = _chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), visibility, dout.bfloat16())
    for name, got, bf16, ref in zip(("out", "lse", "dq", "dk", "dv"), chunked, whole, reference, strict=True):
        err, bf16_err = _relerr(got, ref), _relerr(bf16, ref)
        assert err <= 2 * bf16_err + 1e-3, (name, err, bf16_err)
        assert torch.isfinite(got).all(), name
