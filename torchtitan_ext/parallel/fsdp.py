"""Data parallelism: FSDP2 (``fully_shard``, HSDP on a 2-D mesh) or DDP for plain replication."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True, experts_mesh: DeviceMesh | None = None) -> None:
    """Shard every transformer block, then the root (embeddings, final norm, output head).

    ``mesh`` is 1-D for FSDP and 2-D (replicate, shard) for HSDP. Under expert parallelism each block's
    experts are first sharded on their own ``experts_mesh`` (the data-parallel ranks left after EP).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        experts = getattr(block.feed_forward, "experts", None)
        if experts_mesh is not None and experts is not None:
            fully_shard(experts, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root is used last in forward and first in backward: keeping it unsharded saves one all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """Plain data parallel over the flattened ``dp`` mesh (used for Squinch's compressed all-reduce)."""
    device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, process_group=mesh.get_group(), device_ids=device_ids,
                                   bucket_cap_mb=100, gradient_as_bucket_view=True)
