"""Float8 MoDE experts (``float8.experts``): the three grouped GEMMs of every ``GroupedExperts`` in float8
e4m3 with rowwise scales, through ``torch._scaled_grouped_mm`` (sm90) with torchao 0.17's prototype cast
kernels and our own per-group column-wise cast (``_Float8GroupedMM``) on CUDA, and emulated (float8-rounded
operands, high-precision matmuls) elsewhere or when asked.

Scales (torchao's, power-of-two, one per row of the GEMM's reduction): forward, one per token row of the input
and one per (expert, output feature) of the weight; input gradient, one per row of the output gradient and
one per (expert, input feature); weight gradient (a GEMM over tokens), one per (expert, column) of each
operand, over that expert's token rows.

The kernel needs every expert's token group to start and end on a multiple of 16 rows (the weight gradient
runs over tokens) and torchao 0.17 does not pad (``pad_token_groups_for_grouped_mm=True`` asserts "not yet
supported"). ``Float8GroupedExperts`` therefore gathers the expert-sorted rows into a buffer of a size fixed
by the row count (rows + 15 per expert, rounded up to 16: static shapes, no host sync, so the block compiles
as one graph), each group padded with zero rows to a multiple of 16 and the last group taking the spare rows.
Zero rows stay zero through the SwiGLU, add nothing to any scale or weight gradient, and are dropped by the
gather back, whose backward hands them a zero gradient. Routing, the ``load`` counts and the combine see the
unpadded rows only. Both gathers are gathers in their backward too (no scatter, no atomics).

The swapped module keeps ``w1``, ``w2``, ``w3``: checkpoints, FSDP, expert-parallel sharding by expert and the
Hugging Face export are unchanged.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.mode import GroupedExperts
from torchtitan_ext.quant.float8_scales import E4M3, scales_from_amax

logger = logging.getLogger(__name__)

ALIGN = 16  # rows per token group: torch._scaled_grouped_mm's requirement on sm90


def padded_rows(rows: int, groups: int) -> int:
    """The padded buffer's row count: enough for any split of ``rows`` into ``groups`` padded groups."""
    return -(-(rows + (ALIGN - 1) * groups) // ALIGN) * ALIGN


class PadPlan(NamedTuple):
    """Where rows go. ``src[p]``: the input row of padded row p (``rows``, a zero row, where ``valid`` is
    False); ``dest[i]``: the padded row of input row i; ``ends``: padded group ends, multiples of 16."""
    src: torch.Tensor
    dest: torch.Tensor
    ends: torch.Tensor


def pad_plan(counts: torch.Tensor, rows: int) -> PadPlan:
    """The plan for ``rows`` expert-sorted rows, ``counts[g]`` in group g; static shapes, no host read."""
    total = padded_rows(rows, counts.numel())
    counts = counts.long()
    ends = counts.cumsum(0)
    sizes = (counts + ALIGN - 1) // ALIGN * ALIGN
    padded_starts = sizes.cumsum(0) - sizes
    padded_ends = torch.cat([padded_starts[1:], padded_starts.new_full((1,), total)])  # last: the spare rows
    row = torch.arange(rows, device=counts.device)
    group = torch.searchsorted(ends, row, right=True)
    dest = row + (padded_starts - (ends - counts))[group]
    prow = torch.arange(total, device=counts.device)
    pgroup = torch.searchsorted(padded_ends, prow, right=True)
    offset = prow - padded_starts[pgroup]
    src = torch.where(offset < counts[pgroup], ends[pgroup] - counts[pgroup] + offset, rows)
    return PadPlan(src, dest, padded_ends)


def _gather(x: torch.Tensor, index: torch.Tensor, zero_row: bool) -> torch.Tensor:
    """``x[index]``; with ``zero_row``, index ``len(x)`` reads a row of zeros."""
    if zero_row:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return x[index]


class _GatherRows(torch.autograd.Function):
    """Rows ``x[index]`` whose backward is the gather ``grad[back]``: pad and unpad are each other's adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor, pad: bool) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.pad = pad
        return _gather(x, index, zero_row=pad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return _gather(grad, back, zero_row=not ctx.pad), None, None, None


def pad_rows(x: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """Expert-sorted rows -> the padded buffer (zero rows between groups)."""
    return _GatherRows.apply(x, plan.src, plan.dest, True)


def unpad_rows(y: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """The padded buffer -> the real rows; the padding rows get a zero gradient."""
    return _GatherRows.apply(y, plan.dest, plan.src, False)


def fake_quantize(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded to float8 e4m3 with one power-of-two scale per slice along ``dim`` (``scales_from_amax``),
    returned unscaled in float32 (float64 for float64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    scale = scales_from_amax(x.abs().amax(dim=dim, keepdim=True)).to(compute)
    fp8_max = torch.finfo(E4M3).max
    return (x.to(compute) * scale).clamp(-fp8_max, fp8_max).to(E4M3).to(compute) / scale


def _group_masks(rows: int, ends: torch.Tensor) -> torch.Tensor:
    """(groups, rows, 1) booleans: row r belongs to group g."""
    group = torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)
    return (group[None, :] == torch.arange(ends.numel(), device=ends.device)[:, None])[..., None]


class _EmulatedFloat8GroupedMM(torch.autograd.Function):
    """torchao's float8 rowwise grouped GEMM (forward, input and weight gradients), each GEMM on the
    float8-rounded operands in float32 / float64; one masked GEMM per group, so no host read of the ends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w_t, ends)
        with torch.autocast(x.device.type, enabled=False):
            masks = _group_masks(x.shape[0], ends)
            xq, wq = fake_quantize(x, -1), fake_quantize(w_t, -2)
            out = sum(torch.where(masks[g], xq @ wq[g], 0) for g in range(w_t.shape[0]))
        # Cast only to change the dtype: torch 2.11's Dynamo hands backward a zero gradient when an
        # autograd.Function's forward returns a tensor that a no-op .to() gave back as itself.
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w_t, ends = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            masks = _group_masks(x.shape[0], ends)
            gq, wq = fake_quantize(grad, -1), fake_quantize(w_t.transpose(-2, -1), -2)
            grad_x = sum(torch.where(masks[g], gq @ wq[g], 0) for g in range(w_t.shape[0]))
            grad_w = torch.stack([fake_quantize(torch.where(m, x, 0), 0).T @ fake_quantize(torch.where(m, grad, 0), 0)
                                  for m in masks])
        return grad_x.to(x.dtype), grad_w.to(w_t.dtype), None


def _scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                       ends: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` with the cast scales (data = x * scale) turned into its dequantising ones."""
    return torch._scaled_grouped_mm(a, b, a_scales.reciprocal(), b_scales.reciprocal(), ends,
                                    out_dtype=torch.bfloat16, use_fast_accum=True)


class _Float8GroupedMM(torch.autograd.Function):
    """The float8 rowwise grouped GEMMs of one input with one or more weights on sm90 (``torch._scaled_grouped_mm``),
    forward and both gradients, with torchao 0.17's scales and GEMMs but cheaper casts:
      * the input is cast once for all its weights (a SwiGLU expert's w1 and w3), forward and backward;
      * the weight's forward cast is torchao's fused rowwise kernel on the (experts x out, in) view of the
        weight; torchao's own grouped GEMM casts it with five elementwise passes over the float32 weight;
      * the weight gradients' per-(expert, column) casts are ``group_colwise_cast`` (a grid over fixed tiles,
        not one program per expert), where torchao's per-expert kernel waits on the hottest expert.
    ``x``: (rows, in) bf16, row-major; ``ends``: int32 group ends, multiples of 16; each weight (experts, out,
    in). Returns one (rows, out) bf16 output per weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_2d_scale_and_cast as rowwise

        x_data, x_scales = rowwise(x, output_dtype=E4M3, round_scales_to_power_of_2=True)
        outs = []
        for w in weights:
            experts, out_features, in_features = w.shape
            w_data, w_scales = rowwise(w.reshape(experts * out_features, in_features), output_dtype=E4M3,
                                       round_scales_to_power_of_2=True)
            outs.append(_scaled_grouped_mm(x_data, w_data.view(w.shape).transpose(-2, -1), x_scales.squeeze(-1),
                                           w_scales.view(experts, out_features), ends))
        ctx.save_for_backward(x, ends, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_2d_scale_and_cast as rowwise
        from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_3d_transpose_rhs as columnwise_3d

        from torchtitan_ext.quant.float8_group_cast import group_colwise_cast

        x, ends, *weights = ctx.saved_tensors
        grad_x, grad_ws = None, []
        x_cols, x_col_scales = group_colwise_cast(x, ends)
        for w, grad in zip(weights, grads, strict=True):
            if grad is None:  # this output did not reach the loss
                grad_ws.append(None)
                continue
            grad = grad.contiguous()
            g_data, g_scales = rowwise(grad, output_dtype=E4M3, round_scales_to_power_of_2=True)
            wt_data, wt_scales = columnwise_3d(w.transpose(-2, -1), output_dtype=E4M3,
                                               round_scales_to_power_of_2=True)
            part = _scaled_grouped_mm(g_data, wt_data, g_scales.squeeze(-1), wt_scales.squeeze(1), ends)
            grad_x = part if grad_x is None else grad_x + part
            g_cols, g_col_scales = group_colwise_cast(grad, ends)
            grad_ws.append(_scaled_grouped_mm(g_cols.t(), x_cols, g_col_scales, x_col_scales, ends))  # (E, out, in)
        return grad_x, None, *grad_ws


def float8_grouped_mm(x: torch.Tensor, weights: tuple[torch.Tensor, ...], ends: torch.Tensor,
                      emulate: bool) -> tuple[torch.Tensor, ...]:
    """``grouped_mm`` of ``x`` with each weight (row block g of x times ``w[g].T``) in float8 rowwise; every
    end a multiple of 16.

    On CUDA ``_Float8GroupedMM`` in bf16 out (kept bf16 under autocast, as ``grouped_mm`` does); with
    ``emulate`` or off CUDA, ``_EmulatedFloat8GroupedMM`` per weight."""
    if emulate or not x.is_cuda:
        return tuple(_EmulatedFloat8GroupedMM.apply(x, w.transpose(-2, -1), ends) for w in weights)
    outs = _Float8GroupedMM.apply(x.bfloat16().contiguous(), ends.int(), *weights)
    return outs if torch.is_autocast_enabled("cuda") else tuple(out.to(x.dtype) for out in outs)


class Float8GroupedExperts(GroupedExperts):
    """``GroupedExperts`` with float8 rowwise grouped GEMMs on token groups padded to 16 rows; the same
    parameters. ``emulate``: the emulated GEMMs on any device (tests)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, emulate: bool = False):
        super().__init__(n_experts, dim, hidden)
        self.emulate = emulate

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.local_weights()
        plan = pad_plan(counts, x.shape[0])
        xp = pad_rows(x, plan)
        h1, h3 = float8_grouped_mm(xp, (w1, w3), plan.ends, self.emulate)
        (out,) = float8_grouped_mm(F.silu(h1) * h3, (w2,), plan.ends, self.emulate)
        return unpad_rows(out, plan)


def check_float8_experts(cfg: Float8Section, args: ModelArgs) -> None:
    """Refuse ``float8.experts`` with GEMM sizes the kernel cannot take (without ``float8.enabled``:
    ``float8.check_float8_config``)."""
    if not cfg.experts:
        return
    if args.n_experts and (args.dim % ALIGN or args.expert_hidden % ALIGN):
        raise ConfigError(f"float8.experts = true needs model.dim ({args.dim}) and the experts' hidden size "
                          f"({args.expert_hidden}: model.moe_hidden, else model.ffn_hidden) divisible by 16")


def _float8_copy(experts: GroupedExperts, emulate: bool) -> Float8GroupedExperts:
    """A Float8GroupedExperts holding ``experts``' own parameters (built on meta: nothing allocated)."""
    n_experts, hidden, dim = experts.w1.shape
    with torch.device("meta"):
        new = Float8GroupedExperts(n_experts, dim, hidden, emulate=emulate)
    for name, param in experts.named_parameters(recurse=False):
        setattr(new, name, param)
    return new


def convert_experts_to_float8(model: nn.Module, *, emulate: bool = False) -> list[str]:
    """Swap every ``GroupedExperts`` for a ``Float8GroupedExperts`` in place (before parallelize); returns
    their FQNs."""
    swapped = []
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is GroupedExperts:
                setattr(module, name, _float8_copy(child, emulate))
                swapped.append(f"{fqn}.{name}" if fqn else name)
    return swapped
