"""Peak device memory for the metrics line: this rank's, and the largest over all ranks.

Rank 0 writes the metrics, but it is not always the rank that peaks: under pipeline parallelism the last stage
holds the logits and the first the most in-flight activations, and under expert parallelism the rank with the
hottest experts receives the most rows. So the logged step carries both."""

from __future__ import annotations

import torch
import torch.distributed as dist

GIB = 2**30


def _alone() -> bool:
    """No process group, or a group of one."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def largest_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """``values`` with each figure replaced by its maximum over the default process group's ranks (one
    all-reduce; every rank must call it). Without a process group, or alone in it: ``values`` unchanged."""
    if _alone():
        return dict(values)
    keys = sorted(values)
    peaks = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return dict(zip(keys, peaks.tolist(), strict=True))


def peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """On a CUDA device: ``memory_gib`` / ``memory_reserved_gib`` (this rank's peak allocated / reserved, GiB)
    and, with more than one rank, ``memory_max_gib`` / ``memory_reserved_max_gib`` (the largest over the ranks).
    Elsewhere: empty. A collective: every rank calls it at the same step."""
    if device.type != "cuda":
        return {}
    local = {"memory_gib": torch.cuda.max_memory_allocated(device) / GIB,
             "memory_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
    if _alone():
        return local
    largest = largest_over_ranks(local, device)
    return {**local, "memory_max_gib": largest["memory_gib"], "memory_reserved_max_gib": largest["memory_reserved_gib"]}
