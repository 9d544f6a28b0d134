"""Materialise a meta-device model that may already be sharded, and initialise it so that every weight
depends only on the seed and its FQN, never on world size or layout."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan_ext.models.decoder import fill_param_
from torchtitan_ext.parallel.compile import clean_fqn


def _row_sharded_only(p: DTensor) -> bool:
    """True when each rank holds one contiguous block of rows (FSDP's Shard(0), maybe replicated)."""
    return all(pl.is_replicate() or (type(pl) is Shard and pl.dim == 0) for pl in p.placements)


@torch.no_grad()
def materialize_and_init(model: nn.Module, device: torch.device, seed: int, plan: dict) -> None:
    """``plan`` maps clean FQNs to (kind, std) as ``Decoder.init_plan()`` gives them."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        fqn = clean_fqn(name)
        kind, std = plan[fqn]
        if not isinstance(param, DTensor):
            fill_param_(fqn, param, kind, std, seed)
            continue
        local = param.to_local()
        if _row_sharded_only(param):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                  param.placements)
            if local.numel():
                fill_param_(fqn, local, kind, std, seed, rows=slice(offset[0], offset[0] + shape[0]))
        else:  # tensor-parallel column shards and the like: build the whole tensor, keep our piece
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            fill_param_(fqn, full, kind, std, seed)
            local.copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                          src_data_rank=None).to_local())
