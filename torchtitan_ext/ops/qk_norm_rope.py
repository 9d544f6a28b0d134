"""QK-norm and partial RoPE in one pass: ``rope(rmsnorm(x) * w)`` per (token, head) row of q or k.

Unfused, the head-wise RMSNorm and the rotation (split, four products, concatenation) each read and write
the whole q / k tensor. One Triton program per row loads it once, normalises it, rotates the first
``2 * half`` dims by the position's (cos, sin) and stores the result. The backward rotates the gradient
back (the transposed rotation), then applies the RMSNorm backward; ``dw`` is summed from per-program
partials. Custom ops, so torch.compile treats them as opaque calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """x (batch, seq, heads, head_dim); cos/sin (1 or batch, seq, half)."""
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    half = cos.shape[-1]
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    x1, x2, rest = n[..., :half], n[..., half:2 * half], n[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


@triton.jit
def _fwd(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr, heads, seq, cs_batch_stride, dim, half, eps,
         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (batch, seq, head) flattened
    tok = row // heads
    cs_off = (tok // seq) * cs_batch_stride + (tok % seq) * half
    cols = tl.arange(0, BLOCK)
    m = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    tl.store(rstd_ptr + row, rstd)
    n = x * rstd * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    # partner column for the rotation: i < half pairs with i + half, and back
    lo = cols < half
    hi = (cols >= half) & (cols < 2 * half)
    partner = tl.where(lo, cols + half, cols - half)
    pm = (lo | hi) & m
    xp = tl.load(x_ptr + row * dim + partner, mask=pm, other=0.0).to(tl.float32)
    n_p = xp * rstd * tl.load(w_ptr + partner, mask=pm, other=0.0).to(tl.float32)
    j = tl.where(lo, cols, cols - half)
    c = tl.load(cos_ptr + cs_off + j, mask=pm, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off + j, mask=pm, other=0.0).to(tl.float32)
    out = tl.where(lo, n * c - n_p * s, tl.where(hi, n * c + n_p * s, n))
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd(x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, g_ptr, dx_ptr, dw_ptr, heads, seq, cs_batch_stride, dim, half,
         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tok = row // heads
    cs_off = (tok // seq) * cs_batch_stride + (tok % seq) * half
    cols = tl.arange(0, BLOCK)
    m = cols < dim
    lo = cols < half
    hi = (cols >= half) & (cols < 2 * half)
    partner = tl.where(lo, cols + half, cols - half)
    pm = (lo | hi) & m
    j = tl.where(lo, cols, cols - half)
    c = tl.load(cos_ptr + cs_off + j, mask=pm, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off + j, mask=pm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * dim + cols, mask=m, other=0.0).to(tl.float32)
    gp = tl.load(g_ptr + row * dim + partner, mask=pm, other=0.0).to(tl.float32)
    # transposed rotation: dn_lo = g_lo c + g_hi s, dn_hi = g_hi c - g_lo s
    dn = tl.where(lo, g * c + gp * s, tl.where(hi, g * c - gp * s, g))
    rstd = tl.load(rstd_ptr + row)
    xhat = tl.load(x_ptr + row * dim + cols, mask=m, other=0.0).to(tl.float32) * rstd
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(dw_ptr + row * dim + cols, dn * xhat, mask=m)
    gw = dn * w
    dx = rstd * (gw - xhat * tl.sum(gw * xhat, axis=0) / dim)
    tl.store(dx_ptr + row * dim + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)


def _shape(x: torch.Tensor, cos: torch.Tensor) -> tuple[int, int, int, int]:
    b, t, h, d = x.shape
    return b * t * h, h, t, (0 if cos.shape[0] == 1 else t * cos.shape[-1])


@torch.library.custom_op("tte::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    rows, heads, seq, stride = _shape(x, cos)
    out = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    _fwd[(rows,)](x, weight.contiguous(), cos.contiguous(), sin.contiguous(), out, rstd, heads, seq, stride,
                  x.shape[-1], cos.shape[-1], eps, BLOCK=triton.next_power_of_2(x.shape[-1]))
    return out, rstd


@qk_norm_rope_fwd.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("tte::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rstd: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    rows, heads, seq, stride = _shape(x, cos)
    dx = torch.empty_like(x)
    dw_rows = torch.empty(rows, x.shape[-1], dtype=torch.float32, device=x.device)
    _bwd[(rows,)](x, weight.contiguous(), cos.contiguous(), sin.contiguous(), rstd, g.contiguous(), dx, dw_rows,
                  heads, seq, stride, x.shape[-1], cos.shape[-1], BLOCK=triton.next_power_of_2(x.shape[-1]))
    return dx, dw_rows.sum(0).to(weight.dtype)


@qk_norm_rope_bwd.register_fake
def _(x, weight, cos, sin, rstd, g):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, cos, sin, _ = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])


def _backward(ctx, g, _drstd):
    x, weight, cos, sin, rstd = ctx.saved_tensors
    dx, dw = qk_norm_rope_bwd(x, weight, cos, sin, rstd, g)
    return dx, dw, None, None, None


qk_norm_rope_fwd.register_autograd(_backward, setup_context=_setup)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """rope(rmsnorm(x) * weight) through the Triton kernels; shapes as ``qk_norm_rope_reference``."""
    return qk_norm_rope_fwd(x, weight, cos, sin, eps)[0]
