"""Activation checkpointing per transformer block: full recompute, or selective (keep matmul and
attention outputs, recompute the cheap pointwise ops around them).

The selective policy also keeps tensor parallelism's reduce-scatter outputs: recomputed, each block's backward
would run one more collective over the TP ranks (seen in the compiled backward graph on CPU: 3 reduce-scatters
instead of 2), and the partitioner would keep wo's and w2's full partial sums to feed it."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.parallel.ep import recompute_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._grouped_mm.default,  # MoDE experts on GPU
    torch.ops.aten._scaled_grouped_mm.default,  # MoDE experts in float8 (float8.experts)
    torch.ops._c10d_functional.reduce_scatter_tensor.default,  # TP's: no collective in the recomputation
    # Whole-tensor maxima: float8's tensorwise amaxes (a scalar each) are kept, so the recomputation does not
    # read every weight again to find its scale.
    torch.ops.aten.max.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int, moe_fsdp_units: bool = False) -> int:
    """``mode`` "full": recompute each block; "selective" with ``every`` = 0: op-level policy above in
    each block; "selective" with ``every`` = N: full recompute of every Nth block only.

    ``moe_fsdp_units``: the MoDE layers (or their experts) are FSDP units of their own (EP, or TP). The
    op-level policy cannot wrap a block holding one: torch's selective checkpointing then meets FSDP's hook
    ops a different number of times in the recomputation and stops (pytorch/pytorch#196862, not in torch
    <= 2.13). Those blocks are recomputed in full instead; returns how many were."""
    if mode != "none" and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        # The attention records its LSE metric as an attribute in forward: a compiled checkpointed block must
        # not replay that in the recomputation (eager checkpointing records the same value again, harmlessly).
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    in_full_instead = 0
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "none" or mode == "selective" and every > 0 and i % every:
            continue
        op_level = mode == "selective" and not every > 0
        if op_level and moe_fsdp_units and isinstance(block.feed_forward, MoDE):
            in_full_instead += 1
            op_level = False
        context = {"context_fn": partial(create_selective_checkpoint_contexts, _policy)} if op_level else {}
        if moe_fsdp_units and isinstance(block.feed_forward, MoDE):  # not traced by dynamo (compiled around
            context = {"context_fn": recompute_contexts}  # the experts): EP's recomputation reuses the routes
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **context)
    return in_full_instead
