"""The FFN's gated activations as single Triton passes: SwiGLU ``silu(a) * b`` and squared ReLU ``relu(a)^2``.

Unfused, SwiGLU writes silu(a) and then the product (and autograd keeps both inputs plus the
intermediate); the fused forward reads a and b once and writes one output, and the backward recomputes
silu from a and writes both input gradients in one pass. Custom ops, so torch.compile leaves them opaque.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_BLOCK = 1024


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def relu2_reference(a: torch.Tensor) -> torch.Tensor:
    return F.relu(a).square()


@triton.jit
def _swiglu_fwd(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    a = tl.load(a_ptr + off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(a_ptr, b_ptr, g_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    a = tl.load(a_ptr + off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(da_ptr + off, (g * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + off, (g * a * s).to(db_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_fwd(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    r = tl.maximum(tl.load(a_ptr + off, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + off, (r * r).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_bwd(a_ptr, g_ptr, da_ptr, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    r = tl.maximum(tl.load(a_ptr + off, mask=mask, other=0.0).to(tl.float32), 0.0)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(da_ptr + off, (2.0 * r * g).to(da_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


@torch.library.custom_op("tte::swiglu_fwd", mutates_args=())
def swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(a)
    _swiglu_fwd[_grid(a.numel())](a, b, out, a.numel(), BLOCK=_BLOCK)
    return out


def _like_first(a, *rest):
    """Fake (meta) implementation of the ops whose one output is shaped like their first input."""
    return torch.empty_like(a)


swiglu_fwd.register_fake(_like_first)


@torch.library.custom_op("tte::swiglu_bwd", mutates_args=())
def swiglu_bwd(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, g = a.contiguous(), b.contiguous(), g.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    _swiglu_bwd[_grid(a.numel())](a, b, g, da, db, a.numel(), BLOCK=_BLOCK)
    return da, db


@swiglu_bwd.register_fake
def _(a, b, g):
    return torch.empty_like(a), torch.empty_like(b)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


swiglu_fwd.register_autograd(lambda ctx, g: swiglu_bwd(*ctx.saved_tensors, g), setup_context=_save_inputs)


@torch.library.custom_op("tte::relu2_fwd", mutates_args=())
def relu2_fwd(a: torch.Tensor) -> torch.Tensor:
    a = a.contiguous()
    out = torch.empty_like(a)
    _relu2_fwd[_grid(a.numel())](a, out, a.numel(), BLOCK=_BLOCK)
    return out


relu2_fwd.register_fake(_like_first)


@torch.library.custom_op("tte::relu2_bwd", mutates_args=())
def relu2_bwd(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    a, g = a.contiguous(), g.contiguous()
    da = torch.empty_like(a)
    _relu2_bwd[_grid(a.numel())](a, g, da, a.numel(), BLOCK=_BLOCK)
    return da


relu2_bwd.register_fake(_like_first)
relu2_fwd.register_autograd(lambda ctx, g: relu2_bwd(*ctx.saved_tensors, g), setup_context=_save_inputs)
