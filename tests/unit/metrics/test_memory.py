"""The metrics line's largest-over-ranks memory figures (``metrics/memory.py``) on gloo processes."""

from __future__ import annotations

import torch
from dist_utils import run_distributed

from torchtitan_ext.metrics.memory import largest_over_ranks, peak_memory_metrics


def _largest(rank: int, world_size: int) -> dict[str, float]:
    # rank r's peaks: allocated grows with the rank, reserved falls with it, so each key's maximum is on
    # another rank and a reduction that mixed up the keys or summed would show
    return largest_over_ranks({"memory_gib": 10.0 + rank, "memory_reserved_gib": 40.5 - 3 * rank},
                              torch.device("cpu"))


def test_each_figure_is_its_maximum_over_the_ranks():
    results = run_distributed(_largest, 3)
    assert results == [{"memory_gib": 12.0, "memory_reserved_gib": 40.5}] * 3


def test_alone_or_on_cpu():
    values = {"memory_gib": 1.25}
    assert largest_over_ranks(values, torch.device("cpu")) == values  # no process group: unchanged
    assert peak_memory_metrics(torch.device("cpu")) == {}  # no CUDA peaks to report
