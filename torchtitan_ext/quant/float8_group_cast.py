"""Per-group, column-wise float8 casts for the weight gradient of a float8 grouped GEMM.

The weight gradient of expert g is ``grad_out[g rows].T @ x[g rows]``: a GEMM over that expert's token rows. In
float8 rowwise form each operand needs one scale per (expert, column), over the expert's rows, and its data in
column-major order (``torch._scaled_grouped_mm`` reads the 2-d operands of a reduction over groups that way).
torchao 0.17 does this with one program per (column block, expert) that walks the expert's rows, so with
uneven routing (the hottest of 64 experts getting about ten times the mean rows) the hottest expert's programs
set the kernel's time, many times its bytes' worth.

Here the grid runs over fixed 64 x 128 tiles whatever the groups, so a hot expert spreads over as many programs
as its rows fill. Token groups start and end on multiples of 16 rows (the GEMM's own requirement), so a 16-row
slice lies in one group: pass 1 folds each tile's column maxima into the (group, column) table with one atomic
max per column (one per 16-row slice where a group boundary crosses the tile); pass 2 casts each tile with its
rows' groups' scales and stores it transposed (column-major). Scales are computed between the passes as torchao
computes its own (float64 division, rounded down to a power of two), and the cast is Triton's, as in torchao's
kernel, so the two give the same bits on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from torchtitan_ext.quant.float8_scales import E4M3, scales_from_amax

TILE_ROWS = 64  # rows per program of either pass
BLOCK_COLS = 128


@triton.jit
def _group_of(row, ends_ptr, n_groups, GROUPS_POW2: tl.constexpr):
    """The group holding ``row``: how many group ends are <= it."""
    g = tl.arange(0, GROUPS_POW2)
    ends = tl.load(ends_ptr + g, mask=g < n_groups, other=2147483647)
    return tl.sum((ends <= row).to(tl.int32), axis=0)


@triton.jit
def _groups_of(rows, ends_ptr, n_groups, GROUPS_POW2: tl.constexpr):
    """The group holding each of ``rows``."""
    g = tl.arange(0, GROUPS_POW2)
    ends = tl.load(ends_ptr + g, mask=g < n_groups, other=2147483647)
    return tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)


@triton.jit
def _round_to_e4m3(v):
    """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32, so that
    the cast to float8 that follows is exact: Triton's CPU interpreter rounds ties away and drops the carry
    into the exponent, where the GPU's cast rounds to nearest even. An e4m3
    value has 3 mantissa bits, so near ``v`` the grid step is 2^(exponent(v) - 3), and 2^-9 below the normal
    range; adding and subtracting 1.5 x 2^(23 + that exponent) rounds to the step in float32 arithmetic."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.maximum(exponent - 3, -9)
    magic = ((step + 23 + 127) << 23 | (1 << 22)).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def _group_col_amax_kernel(x_ptr, ends_ptr, amax_ptr, n_rows, n_cols, n_groups, stride_row,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUPS_POW2: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    ok = (rows[:, None] < n_rows) & col_ok[None, :]
    ax = tl.abs(tl.load(x_ptr + rows[:, None] * stride_row + cols[None, :], mask=ok, other=0.0).to(tl.float32))
    first = _group_of(row0, ends_ptr, n_groups, GROUPS_POW2)
    last = _group_of(row0 + ROWS - 16, ends_ptr, n_groups, GROUPS_POW2)
    if first == last:  # the usual case: the whole tile in one group, one atomic max per column
        tl.atomic_max(amax_ptr + first * n_cols + cols, tl.max(ax, axis=0), mask=col_ok & (first < n_groups))
    else:  # a group boundary inside the tile: one per 16-row slice (each lies in one group)
        for s in tl.static_range(0, ROWS, 16):
            g = _group_of(row0 + s, ends_ptr, n_groups, GROUPS_POW2)
            in_slice = (rows >= row0 + s) & (rows < row0 + s + 16)
            slice_max = tl.max(tl.where(in_slice[:, None], ax, 0.0), axis=0)
            tl.atomic_max(amax_ptr + g * n_cols + cols, slice_max, mask=col_ok & (g < n_groups))


@triton.jit
def _group_col_cast_kernel(x_ptr, ends_ptr, scales_ptr, out_ptr, n_rows, n_cols, n_groups, stride_row,
                           FP8_MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                           GROUPS_POW2: tl.constexpr, INTERPRETED: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    first = _group_of(row0, ends_ptr, n_groups, GROUPS_POW2)
    last = _group_of(row0 + ROWS - 16, ends_ptr, n_groups, GROUPS_POW2)
    ok = (rows[:, None] < n_rows) & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if first == last:  # the usual case: one group, one row of scales for the tile
        scale = tl.load(scales_ptr + first * n_cols + cols, mask=col_ok & (first < n_groups), other=0.0)
        y = x * scale[None, :]
    else:  # a group boundary inside the tile: each row's own group's scales
        group = _groups_of(rows, ends_ptr, n_groups, GROUPS_POW2)
        ok = ok & (group[:, None] < n_groups)
        y = x * tl.load(scales_ptr + group[:, None] * n_cols + cols[None, :], mask=ok, other=0.0)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX)
    if INTERPRETED:  # the CPU interpreter's float8 cast does not round to nearest even: round first
        y = _round_to_e4m3(y)
    # stored transposed, so that each column's rows are contiguous (column-major) and the stores coalesce
    y_t = tl.trans(y.to(out_ptr.dtype.element_ty))
    ok_t = tl.trans(ok)
    tl.store(out_ptr + cols[:, None] * n_rows + rows[None, :], y_t, mask=ok_t)


@torch.library.custom_op("torchtitan_ext::group_colwise_cast", mutates_args=())
def group_colwise_cast(x: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, cols), row-major, in float8 e4m3 with one scale per (group, column), group g being rows
    ``ends[g - 1]:ends[g]`` (int32 ends, multiples of 16, the last one = rows). Returns the data (rows, cols)
    column-major (strides (1, rows)) and the scales, (groups x cols) flat in float32, as
    ``torch._scaled_grouped_mm`` takes them: data = saturate(x * scale), x ~ data / scale. A custom op: opaque
    to torch.compile (``_fake`` gives its outputs' shapes)."""
    if x.ndim != 2 or x.stride(1) != 1:
        raise ValueError(f"group_colwise_cast: expected a row-major 2-d tensor, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    rows, cols = x.shape
    groups = ends.numel()
    groups_pow2 = triton.next_power_of_2(max(groups, 1))
    amax = torch.zeros(groups, cols, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, TILE_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _group_col_amax_kernel[grid](x, ends, amax, rows, cols, groups, x.stride(0), ROWS=TILE_ROWS, BLOCK=BLOCK_COLS,
                                 GROUPS_POW2=groups_pow2)
    scales = scales_from_amax(amax)
    out = torch.empty_strided((rows, cols), (1, rows), dtype=E4M3, device=x.device)
    _group_col_cast_kernel[grid](x, ends, scales, out, rows, cols, groups, x.stride(0),
                                 FP8_MAX=torch.finfo(E4M3).max, ROWS=TILE_ROWS, BLOCK=BLOCK_COLS,
                                 GROUPS_POW2=groups_pow2, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1")
    return out, scales.reshape(-1)


@group_colwise_cast.register_fake
def _fake(x: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    return (torch.empty_strided((rows, cols), (1, rows), dtype=E4M3, device=x.device),
            x.new_empty(ends.numel() * cols, dtype=torch.float32))
