"""The global norm of gradients that may be sharded over several meshes, and clipping by it."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local_grads(params: list[torch.nn.Parameter]) -> dict:
    """Gradients grouped by how they are sharded (experts and the rest may live on different meshes)."""
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    return groups


@torch.no_grad()
def grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm, the same on every rank, as a float32 device scalar (no host read).

    Gradients sharded the same way are reduced together (DTensor computes the cross-rank sum); groups on
    different meshes are combined as squares; pipeline stages hold disjoint parameters, so their squares
    are summed over ``pp_group``.
    """
    groups = _local_grads(params)
    device = next(iter(groups.values()))[0].device if groups else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


EPS = 1e-6  # added to the norm, as torch's clip_grad_norm_ does


def clip_divisor(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grads_``'s rule as a divisor (at least 1): what fused AdamW's ``grad_scale`` divides gradients by."""
    return ((total + EPS) / max_norm).clamp(min=1.0)


@torch.no_grad()
def clip_grads_(params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the local shards of every gradient by the clipping factor of the global ``norm`` (torch's rule: at
    most 1)."""
    local = [g.to_local() if isinstance(g, DTensor) else g for grads in _local_grads(params).values()
             for g in grads]
    torch._foreach_mul_(local, (max_norm / (norm + EPS)).clamp(max=1.0).to(local[0].dtype))
