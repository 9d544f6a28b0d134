"""The attention core of the decoder: softmax(scale q k^T + mask) v over (batch, heads, seq, head_dim), the
scale 1 / sqrt(head_dim) (``scale=None``) or the caller's (muP's 1 / head_dim, ``ModelArgs.attention_scale``).

* no mask: causal ``F.scaled_dot_product_attention`` (cuDNN / Flash on GPU), today's fast path;
* a visibility mask on CUDA: FlexAttention with the batch's ``BlockMask`` (fully masked tiles skipped);
* a visibility mask elsewhere: a dense boolean mask, since FlexAttention has no CPU backward.

GQA never copies K/V: SDPA and FlexAttention take ``enable_gqa``, the dense path broadcasts a
(batch, kv_heads, group, seq, head_dim) view. Each path can also return the log-sum-exp of the attention
logits per query (batch, heads, seq), which attention Z-regularisation and the LSE metric use; every path
takes the same ``scale``, so the LSE is that of the logits the softmax saw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_ext.ops.visibility import block_masks, causal_block_mask, visibility_mask

_flex_compiled = None


def build_mask(start: torch.Tensor, limit: torch.Tensor):
    """The mask the attention core takes for a (start, limit) pair on this device: a BlockMask on CUDA, a
    bool (batch, seq_q, seq_k) tensor elsewhere."""
    return block_masks.get(start, limit) if start.is_cuda else visibility_mask(start, limit)


def _flex(q, k, v, block_mask, return_lse: bool, scale: float | None = None):
    """FlexAttention, compiled when called eagerly (its eager form materialises the scores)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if not torch.compiler.is_compiling():
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention)
        fn = _flex_compiled
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
              return_lse=return_lse)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with explicit scores; ``mask`` bool (batch, seq_q, seq_k), None for causal."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None]
    qg = q.view(b, hk, h // hk, t, d)
    scores = (qg @ k[:, :, None].transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)  # (b, hk, group, t, t)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v[:, :, None]
    return out.reshape(b, h, t, d), lse.reshape(b, h, t)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, need_lse: bool = False,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (batch, heads, seq, head_dim), lse (batch, heads, seq) or None). ``mask`` is None (causal), a
    bool tensor or a BlockMask (``build_mask``); ``need_lse`` asks for the differentiable LSE; ``scale``
    multiplies the logits (None: 1 / sqrt(head_dim))."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor) or (mask is None and need_lse and not q.is_cuda):
        if need_lse:
            return dense_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa, scale=scale), None
    if mask is None and not need_lse:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale), None
    if mask is None:  # causal with LSE on CUDA: FlexAttention with a causal block mask
        mask = causal_block_mask(q.shape[2], q.device)
    if need_lse:
        return _flex(q, k, v, mask, return_lse=True, scale=scale)
    return _flex(q, k, v, mask, return_lse=False, scale=scale), None


@torch.no_grad()
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None,
                  scale: float | None = None) -> torch.Tensor:
    """The LSE alone (for the metric on the fast path), without touching autograd. Causal attention (no mask)
    gets it from ``causal_lse``: a log step runs the same attention kernel as any other step."""
    if mask is None:
        return causal_lse(q, k, scale)
    return attention(q, k, v, mask, need_lse=True, scale=scale)[1]


def causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
               max_scores: int = 1 << 27) -> torch.Tensor:
    """The causal LSE (batch, heads, seq) from the logits, a block of queries at a time (at most
    ``max_scores`` float32 logits at once), beside the attention instead of replacing it: no FlexAttention
    (compiled even in an eager run; with it in the graph the zero-bubble schedules' split backward failed on
    GPUs) and no (seq x seq) buffer for every head at once."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    qg = q.view(b, hk, h // hk, t, d)
    keys_t = k[:, :, None].transpose(-1, -2)  # (b, hk, 1, d, t): each K/V head serves its group of queries
    scale = d ** -0.5 if scale is None else scale
    rows_per_block = max(1, min(t, max_scores // max(1, b * h * t)))
    lse = []
    for first in range(0, t, rows_per_block):
        last = min(first + rows_per_block, t)
        scores = (qg[..., first:last, :] @ keys_t[..., :last]).float() * scale  # (b, hk, group, rows, last)
        later = torch.arange(last, device=q.device)[None] > torch.arange(first, last, device=q.device)[:, None]
        lse.append(torch.logsumexp(scores.masked_fill(later, float("-inf")), dim=-1))
    return torch.cat(lse, dim=-1).reshape(b, h, t)
