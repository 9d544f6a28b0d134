"""MoDE's Switch balancing loss over whole sequences where each rank routes a part of every sequence.

Context parallelism hands each CP rank a part of every sequence, and tensor parallelism's sequence parallel
hands each TP rank a slice of that part; a MoDE layer routes the tokens it holds. The load fractions of the
Switch loss must count the whole sequences' routed copies, as Megatron-Core sums them over its TP x CP
sequence group: the layer's ``routed_counts`` part is swapped for one that sums its counts over those ranks.
The mean router probability stays each rank's own (its tokens' share of the whole sequences' mean), so the
ranks' gradients average (CP) or sum with the 1 / tp weight (TP) to one process's. The counts are integers
without gradient; the sum is a functional all-reduce, which traces into a compiled routing graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from torchtitan_ext.models.mode import MoDE, RoutedCounts


class SequenceRoutedCounts(RoutedCounts):
    """The routed copies per expert summed over ``groups`` (the CP ranks, then the TP ranks: together every
    rank holding a part of the same sequences)."""

    def __init__(self, groups: list[dist.ProcessGroup]):
        super().__init__()
        self.groups = groups

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            counts = funcol.all_reduce(counts, "sum", group)
        return counts


def apply_sequence_balancing(model: nn.Module, groups: list[dist.ProcessGroup]) -> None:
    """Swap the whole sequences' routed counts (summed over ``groups``) into every MoDE layer of ``model``."""
    for module in model.modules():
        if isinstance(module, MoDE):
            module.routed_counts = SequenceRoutedCounts(groups)
