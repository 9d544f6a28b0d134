"""The attention core of the decoder: softmax(scale q k^T + mask) v over (batch, heads, seq, head_dim), the
scale 1 / sqrt(head_dim) (``scale=None``) or the caller's (muP's 1 / head_dim, ``ModelArgs.attention_scale``).

* no mask on CUDA: a fused causal kernel (cuDNN or Flash, ``kernel``) called through its aten op, which also
  returns the log-sum-exp it computes for its own backward; ``kernel = "sdpa"`` leaves the choice to
  ``F.scaled_dot_product_attention`` (the ``training.attention_backend`` context), which returns no LSE;
* no mask on CPU: torch's fused CPU kernel, which returns the LSE too;
* a visibility mask on CUDA: FlexAttention with the batch's ``BlockMask`` (fully masked tiles skipped; it
  returns its LSE);
* a visibility mask elsewhere: a dense boolean mask, since FlexAttention has no CPU backward.

So the LSE metric costs one mean over (batch, heads, seq) per layer and no second attention pass, and the
same kernel runs on every step, logged or not. ``need_lse`` asks for a differentiable LSE (attention Z-reg),
which FlexAttention (CUDA) or the dense path (CPU) give. GQA never copies K/V: the fused kernels and
FlexAttention take fewer K/V heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_ext.ops.visibility import block_masks, causal_block_mask, visibility_mask

_flex_compiled = None
FUSED_KERNELS = ("cudnn", "flash", "sdpa")


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
    """(out, lse) with explicit scores (CPU and references); ``mask`` bool (batch, seq_q, seq_k), None for
    causal."""
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


def fused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                           kernel: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal (out, lse) from one fused kernel; the LSE is not differentiable. ``kernel``: "cudnn" or
    "flash" on CUDA; on CPU torch's flash kernel for CPU whatever ``kernel`` says. The CUDA kernels take
    16-bit inputs: under autocast the inputs are cast to its dtype (as SDPA does; a float32 norm may come
    before RoPE), and float32 inputs outside autocast go to SDPA's own choice, which returns no LSE."""
    b, h, t, _ = q.shape
    if not q.is_cuda:  # the CPU kernel takes fewer K/V heads as they are (GQA)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse.detach().reshape(b, h, t)
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != h, scale=scale), None
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                      scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    return out, lse.detach().reshape(b, h, t)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, need_lse: bool = False,
              scale: float | None = None, kernel: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (batch, heads, seq, head_dim), lse (batch, heads, seq) or None). ``mask`` is None (causal), a
    bool tensor or a BlockMask (``build_mask``); ``need_lse`` asks for the differentiable LSE; ``scale``
    multiplies the logits (None: 1 / sqrt(head_dim)); ``kernel`` picks the causal CUDA kernel (module
    docstring). Without ``need_lse`` the LSE is returned where the kernel gives it for free, else None."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor) or (mask is None and need_lse and not q.is_cuda):
        if need_lse:
            return dense_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa, scale=scale), None
    if mask is None and not need_lse:
        if kernel == "sdpa" and q.is_cuda:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale), None
        return fused_causal_attention(q, k, v, scale, kernel)
    if mask is None:  # causal with a differentiable LSE on CUDA: FlexAttention with a causal block mask
        mask = causal_block_mask(q.shape[2], q.device)
    out, lse = _flex(q, k, v, mask, return_lse=True, scale=scale)
    return out, (lse if need_lse else lse.detach())


@torch.no_grad()
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """The LSE alone, for the metric where the kernel gives none: a dense CPU mask (small runs and tests)."""
    return dense_attention(q, k, v, mask, scale)[1]
