"""Attention over one (query block, key block) pair, its LSE merge, and its backward from the merged result.

Ring attention splits softmax attention over key blocks: each block gives a partial output ``out_i`` and
its log-sum-exp ``lse_i`` per query; the whole attention is ``out = sum_i exp(lse_i - lse) out_i`` with
``lse = logsumexp_i lse_i`` (``merge``). The backward of every block needs only the merged ``out`` and
``lse``: with ``P = exp(S - lse)`` (the block's share of the global softmax), ``D = rowsum(dout * out)``
and ``dS = P * (dP - D + dlse)`` the block's gradients are the flash-attention backward's.

A block is one of three kinds: ``full`` (every key visible), ``causal`` (a diagonal block, query i sees key
j <= i) or ``masked`` (a bool (batch, q, k) tensor on CPU, a FlexAttention ``BlockMask`` on CUDA).
Tensors are (batch, heads, seq, head_dim); GQA's K/V have fewer heads and are never copied.

* the dense path (CPU, and any float64): explicit scores, exact in float64;
* CUDA: full and causal bf16 / fp16 blocks run the Flash kernel's forward and backward (aten ops that take
  and return the LSE); masked blocks, float32 blocks and blocks whose LSE has a gradient run FlexAttention
  (backward by recomputing the block's forward and differentiating it with the gradients the merge gives
  its ``out_i`` and ``lse_i``). No CUDA path holds a (seq x seq) score matrix.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_ext.ops.attention import _flex

KINDS = ("full", "causal", "masked")


class Block(NamedTuple):
    """One (query rows, key rows) pair of a ring step, rows within the local queries and the held keys."""
    q_rows: slice
    k_rows: slice
    kind: str
    mask: object = None  # the "masked" kind's bool tensor or BlockMask


def _dense(q: torch.Tensor) -> bool:
    return not q.is_cuda or q.dtype == torch.float64


def _on_flash(q: torch.Tensor, kind: str) -> bool:
    """Full and causal bf16 / fp16 blocks run the Flash kernel; the rest on CUDA FlexAttention."""
    return kind != "masked" and q.dtype in (torch.bfloat16, torch.float16)


def _flex_mask(kind: str, mask, q: torch.Tensor):
    from torchtitan_ext.ops.visibility import causal_block_mask

    if kind == "causal":
        return causal_block_mask(q.shape[2], q.device)
    return mask if kind == "masked" else None


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, kind: str, mask, scale: float) -> torch.Tensor:
    """Masked logits (batch, kv_heads, group, q, k); invisible pairs -inf."""
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    scores = (q.view(b, hk, h // hk, tq, d) @ k[:, :, None].transpose(-1, -2)) * scale
    if kind == "causal":
        visible = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    elif kind == "masked":
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The LSE with -inf (a query that sees no key of the block) as 0, so exp(S - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, mask=None,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_i (batch, heads, q, head_dim) in q's dtype, lse_i (batch, heads, q) float32, float64 for float64
    inputs) of one block; a query that sees none of the block's keys has out_i 0 and lse_i -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, h, tq, d = q.shape
    if _dense(q):
        scores = _grouped_scores(q, k, kind, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - _finite(lse)[..., None]) @ v[:, :, None]
        return out.reshape(b, h, tq, d), lse.reshape(b, h, tq)
    if not _on_flash(q, kind):
        out, lse = _flex(q, k, v, _flex_mask(kind, mask, q), return_lse=True, scale=scale)
        return out, lse.float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, kind == "causal", scale=scale)[:2]
    return out, lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_i: torch.Tensor, lse_i: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) with one more block's (out_i, lse_i); ``out`` None starts it. The output is
    kept in the LSE's dtype (float32 for bf16 blocks) until the caller casts the final one."""
    out_i = out_i.to(lse_i.dtype)
    if out is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    safe = _finite(new)
    out = torch.exp(lse - safe)[..., None] * out + torch.exp(lse_i - safe)[..., None] * out_i
    return out, new


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, kind: str, mask=None, scale: float | None = None,
                   dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block from the MERGED ``out`` and ``lse`` of its queries (see the module text);
    ``dlse`` the gradient of the merged LSE (attention Z-reg), or None. dq has q's shape, dk / dv k's."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, h, tq, d = q.shape
    hk = k.shape[1]
    g = h // hk
    if _dense(q):
        scores = _grouped_scores(q, k, kind, mask, scale)
        p = torch.exp(scores - lse.view(b, hk, g, tq, 1).to(scores.dtype))
        do = dout.view(b, hk, g, tq, d).to(p.dtype)
        dv = (p.transpose(-1, -2) @ do).sum(2)
        dp = do @ v[:, :, None].transpose(-1, -2).to(p.dtype)
        row = (do * out.view(b, hk, g, tq, d).to(p.dtype)).sum(-1, keepdim=True)
        if dlse is not None:
            row = row - dlse.view(b, hk, g, tq, 1).to(p.dtype)
        ds = p * (dp - row) * scale
        dq = (ds @ k[:, :, None].to(p.dtype)).reshape(b, h, tq, d)
        dk = (ds.transpose(-1, -2) @ q.view(b, hk, g, tq, d).to(p.dtype)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if not _on_flash(q, kind) or dlse is not None:
        return _recomputed_backward(dout, q, k, v, out, lse, kind, mask, scale, dlse)
    no_rng = torch.empty(0, device=q.device, dtype=torch.long)  # dropout 0: the RNG state is not read
    # No cumulative sequence lengths (None): the dense, not the variable-length, kernel.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float().contiguous(), None, None, tq, k.shape[2], 0.0,
        kind == "causal", no_rng, no_rng, scale=scale)


def _recomputed_backward(dout, q, k, v, out, lse, kind, mask, scale, dlse):
    """FlexAttention blocks: recompute the block's (out_i, lse_i) with autograd and differentiate them with
    the merge's gradients, ``w dout`` for out_i and ``w (rowsum(dout (out_i - out)) + dlse)`` for lse_i
    (``w = exp(lse_i - lse)``, the block's share of each query's softmax)."""
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out_i, lse_i = _flex(qg, kg, vg, _flex_mask(kind, mask, q), return_lse=True, scale=scale)
        w = torch.exp(lse_i.float() - lse.float())
        d_out_i = (w[..., None] * dout.float()).to(out_i.dtype)
        row = (dout.float() * (out_i.float() - out.float())).sum(-1)
        d_lse_i = w * (row + (dlse.float() if dlse is not None else 0.0))
        return torch.autograd.grad((out_i, lse_i), (qg, kg, vg), (d_out_i, d_lse_i.to(lse_i.dtype)))
