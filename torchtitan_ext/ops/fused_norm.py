"""Residual add fused with RMSNorm: ``h = x + y; n = h * rsqrt(mean(h^2) + eps) * w`` in one pass.

The unfused block reads and writes the residual stream three times (add, norm statistics, normalise);
here one Triton program per group of rows loads x and y once and writes h and n, keeping the per-row
reciprocal RMS (float32) for the backward. The backward is one pass too: ``dh`` (the gradient of h from
later layers) plus the norm's gradient, and per-program partial sums of ``dw`` reduced by torch.

Both directions are ``torch.library`` custom ops, so torch.compile treats them as opaque calls;
``add_rms_norm_reference`` is the plain-torch definition the tests compare against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def add_rms_norm_reference(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + y
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, (n * weight.float()).to(h.dtype)


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, w_ptr, h_ptr, n_ptr, rstd_ptr, rows, dim, eps,
                ROWS_PER_PROG: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    cmask = cols < dim
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for i in range(ROWS_PER_PROG):
        row = tl.program_id(0).to(tl.int64) * ROWS_PER_PROG + i
        if row < rows:
            off = row * dim + cols
            h = tl.load(x_ptr + off, mask=cmask, other=0.0).to(tl.float32) + \
                tl.load(y_ptr + off, mask=cmask, other=0.0).to(tl.float32)
            h_out = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + off, h_out, mask=cmask)
            hf = h_out.to(tl.float32)  # normalise the rounded sum, as the unfused model does
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / dim + eps)
            tl.store(rstd_ptr + row, rstd)
            tl.store(n_ptr + off, (hf * rstd * w).to(n_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, rstd_ptr, dh_ptr, dn_ptr, dx_ptr, dw_part_ptr, rows, dim,
                ROWS_PER_PROG: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    cmask = cols < dim
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS_PER_PROG):
        row = tl.program_id(0).to(tl.int64) * ROWS_PER_PROG + i
        if row < rows:
            off = row * dim + cols
            rstd = tl.load(rstd_ptr + row)
            xhat = tl.load(h_ptr + off, mask=cmask, other=0.0).to(tl.float32) * rstd
            dn = tl.load(dn_ptr + off, mask=cmask, other=0.0).to(tl.float32)
            dw += dn * xhat
            g = dn * w
            dx = rstd * (g - xhat * tl.sum(g * xhat, axis=0) / dim)
            dx += tl.load(dh_ptr + off, mask=cmask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
    tl.store(dw_part_ptr + tl.program_id(0).to(tl.int64) * dim + cols, dw, mask=cmask)


def _launch_shape(rows: int, device: torch.device) -> int:
    """Rows per program: about 8 programs per SM on a GPU (fewer ``dw`` partials), one row in the interpreter."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, triton.cdiv(rows, sms * 8))


@torch.library.custom_op("tte::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    x2, y2 = x.reshape(-1, dim).contiguous(), y.reshape(-1, dim).contiguous()
    rows = x2.shape[0]
    h, n = torch.empty_like(x2), torch.empty_like(x2)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    per = _launch_shape(rows, x.device)
    _fwd_kernel[(triton.cdiv(rows, per),)](x2, y2, weight.contiguous(), h, n, rstd, rows, dim, eps,
                                           ROWS_PER_PROG=per, BLOCK=triton.next_power_of_2(dim))
    return h.view(x.shape), n.view(x.shape), rstd


@add_rms_norm_fwd.register_fake
def _(x, y, weight, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tte::add_rms_norm_bwd", mutates_args=())
def add_rms_norm_bwd(h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor,
                     dn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dim = h.shape[-1]
    h2 = h.reshape(-1, dim)
    rows = h2.shape[0]
    dx = torch.empty_like(h2)
    per = _launch_shape(rows, h.device)
    grid = triton.cdiv(rows, per)
    dw_part = torch.empty(grid, dim, dtype=torch.float32, device=h.device)
    _bwd_kernel[(grid,)](h2, weight.contiguous(), rstd, dh.reshape(-1, dim).contiguous(),
                         dn.reshape(-1, dim).contiguous(), dx, dw_part, rows, dim,
                         ROWS_PER_PROG=per, BLOCK=triton.next_power_of_2(dim))
    return dx.view(h.shape), dw_part.sum(0).to(weight.dtype)


@add_rms_norm_bwd.register_fake
def _(h, weight, rstd, dh, dn):
    return torch.empty_like(h), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[0], inputs[2], output[2])


def _backward(ctx, dh, dn, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dh = torch.zeros_like(h) if dh is None else dh
    dn = torch.zeros_like(h) if dn is None else dn
    dx, dw = add_rms_norm_bwd(h, weight, rstd, dh, dn)
    return dx, dx, dw, None


add_rms_norm_fwd.register_autograd(_backward, setup_context=_setup)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rmsnorm(x + y) * weight) through the Triton kernels."""
    return add_rms_norm_fwd(x, y, weight, eps)[:2]
