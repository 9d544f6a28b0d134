"""Data parallelism: FSDP2 (``fully_shard``, HSDP on a 2-D mesh) or DDP for plain replication."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True, skip: set[nn.Module] | None = None) -> None:
    """Shard every transformer block, then the root (embeddings, final norm, output head).

    ``mesh`` is 1-D for FSDP and 2-D (replicate, shard) for HSDP. Blocks found in ``skip`` were already
    wrapped by another parallelism (expert parallel shards its experts on its own mesh).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    skip = skip or set()
    for block in model.layers.values():
        if block not in skip:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root is used last in forward and first in backward: keeping it unsharded saves one all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """Plain data parallel over the flattened ``dp`` mesh (used for Squinch's compressed all-reduce)."""
    device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, process_group=mesh.get_group(), device_ids=device_ids,
                                   bucket_cap_mb=100, gradient_as_bucket_view=True)
