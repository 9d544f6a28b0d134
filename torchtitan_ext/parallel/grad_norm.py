"""Gradient clipping on the global norm of gradients that may be sharded over several meshes."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip in place and return the global L2 norm.

    Gradients sharded the same way are reduced together (DTensor computes the cross-rank sum); groups on
    different meshes (experts vs the rest) are combined as squares; pipeline stages hold disjoint
    parameters, so their squares are summed over ``pp_group``.
    """
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    device = next(iter(groups.values()))[0].device if groups else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        # Scale the local shards: grads may live on different meshes (experts vs the rest).
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for grads in groups.values() for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].dtype))
    return total
