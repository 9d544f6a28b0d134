"""Data parallelism: FSDP2 (``fully_shard``, HSDP on a 2-D mesh) or DDP for plain replication."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from torchtitan_ext.models.mode import MoDE

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh | None, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True, experts_mesh: DeviceMesh | None = None,
               moe_mesh: DeviceMesh | None = None, tp: int = 1, experts_unmanaged: bool = False) -> None:
    """Shard every transformer block, then the root (embeddings, final norm, output head).

    ``mesh`` is 1-D for FSDP and 2-D (replicate, shard) for HSDP; ``None`` shards only the MoDE layers (TP
    without data-parallel sharding). Under expert parallelism each block's experts are first sharded on
    their own ``experts_mesh`` (the data-parallel ranks left after EP). Under tensor parallelism a MoDE
    layer runs on each TP rank's own slice of the sequence, so its other parameters are sharded on
    ``moe_mesh`` (data-parallel x TP ranks): their gradients are summed over those ranks and divided by
    the data-parallel degree only (the mesh size over ``tp``).

    ``experts_unmanaged``: expert parallelism spans every data-parallel rank (no replica, no pipeline), so each
    expert lives on one rank only and its gradient needs no reduction: FSDP leaves the experts alone. A unit
    over one rank would still copy every expert weight into a bf16 buffer before each forward and backward and
    copy its gradient through an fp32 reduce buffer after, and run its hooks on the host in every layer; the
    grouped GEMMs cast the weights themselves (``GroupedExperts.local_weights``).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def shard(module: nn.Module, on: DeviceMesh, reshard: bool = reshard_after_forward) -> None:
        fully_shard(module, mesh=on, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored or None)

    ignored: set[nn.Parameter] = set()
    for block in model.layers.values():
        moe = block.feed_forward if isinstance(block.feed_forward, MoDE) else None
        if moe is not None and experts_unmanaged:
            ignored |= set(moe.experts.parameters())
        elif moe is not None and experts_mesh is not None:
            shard(moe.experts, experts_mesh)
        if moe is not None and moe_mesh is not None:
            shard(moe, moe_mesh)
            moe.set_force_sum_reduction_for_comms(True)
            moe.set_gradient_divide_factor(moe_mesh.size() / tp)
        if mesh is not None:
            shard(block, mesh)
    if mesh is not None:
        # The root is used last in forward and first in backward: keeping it unsharded saves one all-gather.
        shard(model, mesh, reshard=False)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """Plain data parallel over the flattened ``dp`` mesh (used for Squinch's compressed all-reduce)."""
    device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, process_group=mesh.get_group(), device_ids=device_ids,
                                   bucket_cap_mb=100, gradient_as_bucket_view=True)
