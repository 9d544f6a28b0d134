"""Experts placed on the expert-parallel ranks by measured load.

Under expert parallelism every rank waits in each all-to-all for the rank whose experts received the most
tokens; with uneven routing the rank holding the hot experts computes many more routed rows than the others,
and they wait for it. Every ``every`` steps this module sums each MoDE layer's routed tokens per expert over
the data-parallel ranks, swaps experts between the most and the least loaded rank while that lowers the larger
of the two loads, and moves the swapped experts' weights and optimizer states (and EMA shadows) to their new
ranks. The layer's ``expert_slot`` map says where each expert now sits; routing, losses and load metrics still
speak of experts, so the model computes exactly what it computed before the move.

Checkpoints keep the experts in their own order: ``canonical()`` moves them home around a save and back after,
so a checkpoint resumes and exports under any layout and without this module.

Scope: expert parallelism over every data-parallel rank with the experts outside FSDP (``ParallelDims.
experts_alone``): each expert lives on exactly one rank, as one row of its layer's local ``w1`` / ``w2`` /
``w3``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_ext.models.mode import MoDE


def plan_swaps(load: list[float], slot_of: list[int], ranks: int) -> list[int]:
    """A new ``slot_of`` (expert -> slot; rank r holds slots r * n, ..., (r + 1) * n - 1): swap an expert of
    the most loaded rank with one of the least loaded while that lowers the larger of their two loads, the
    swap closest to evening them out first. Deterministic, so every rank plans the same placement."""
    n_experts = len(load)
    per_rank = n_experts // ranks
    slot_of = list(slot_of)
    rank_load = [0.0] * ranks
    for e, s in enumerate(slot_of):
        rank_load[s // per_rank] += load[e]
    for _ in range(n_experts * ranks):  # each swap lowers the sum of squared rank loads, so the loop ends anyway
        hi = max(range(ranks), key=lambda r: (rank_load[r], -r))
        lo = min(range(ranks), key=lambda r: (rank_load[r], r))
        gap = rank_load[hi] - rank_load[lo]
        on_hi = [e for e in range(n_experts) if slot_of[e] // per_rank == hi]
        on_lo = [e for e in range(n_experts) if slot_of[e] // per_rank == lo]
        moves = [(abs(gap - 2 * (load[i] - load[j])), i, j) for i in on_hi for j in on_lo
                 if 0 < load[i] - load[j] < gap]
        if not moves:
            break
        _, i, j = min(moves)
        slot_of[i], slot_of[j] = slot_of[j], slot_of[i]
        rank_load[hi] -= load[i] - load[j]
        rank_load[lo] += load[i] - load[j]
    return slot_of


def move_rows(local: torch.Tensor, source: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows after a placement change: global row s (rank r holds rows r * n ... (r + 1) * n - 1
    of the ``local`` blocks) becomes the old global row ``source[s]``. Rows that change rank travel in one
    all-to-all; the others are copied locally. Returns a new tensor."""
    rank, ranks, n = dist.get_rank(group), dist.get_world_size(group), local.shape[0]
    mine = range(rank * n, (rank + 1) * n)
    send = [[s for s in range(len(source)) if s // n == peer and source[s] // n == rank] for peer in range(ranks)]
    recv = [[s for s in mine if source[s] // n == peer] for peer in range(ranks)]
    out = torch.empty_like(local)
    own = recv[rank]
    if own:
        out[[s - rank * n for s in own]] = local[[source[s] - rank * n for s in own]]
    send[rank], recv[rank] = [], []
    rows = [source[s] - rank * n for peer in range(ranks) for s in send[peer]]
    sent = local[rows] if rows else local.new_empty((0, *local.shape[1:]))
    got = local.new_empty((sum(len(r) for r in recv), *local.shape[1:]))
    dist.all_to_all_single(got, sent.contiguous(), [len(r) for r in recv], [len(r) for r in send], group=group)
    arriving = [s - rank * n for peer in range(ranks) for s in recv[peer]]
    if arriving:
        out[arriving] = got
    return out


class ExpertPlacement:
    """Places the experts of ``layers`` (this rank's MoDE layers) on the ranks of the expert-parallel
    ``group`` by load. ``companions(param)``: the other tensors shaped like an expert weight that must move
    with it (optimizer states, EMA shadows). ``load_group``: the ranks whose routed tokens count (the
    data-parallel ranks: they must all plan the same placement)."""

    def __init__(self, layers: list[MoDE], group: dist.ProcessGroup, load_group: dist.ProcessGroup | None,
                 companions: Callable[[torch.nn.Parameter], list[torch.Tensor]], min_gain: float = 0.02):
        self.layers, self.group, self.load_group = layers, group, load_group
        self.companions, self.min_gain = companions, min_gain
        self.ranks = dist.get_world_size(group)
        # each layer's expert -> slot map, also on the host (the layers start in expert order)
        self.slots = [list(range(layer.n_experts)) for layer in layers]

    def rebalance(self) -> dict[str, float]:
        """Plan from each layer's routed load since its counter was last reset and move the experts that
        change rank; one host read for all layers. Returns the metrics (experts moved, the most loaded
        rank's share of the tokens before and after, averaged over the layers)."""
        loads = torch.stack([layer.load for layer in self.layers]).double()
        if self.load_group is not None:
            dist.all_reduce(loads, group=self.load_group)
        moved, before, after = 0, 0.0, 0.0
        for i, load in enumerate(loads.tolist()):
            old = self.slots[i]
            new = plan_swaps(load, old, self.ranks)
            share_old, share_new = self._top_share(load, old), self._top_share(load, new)
            if share_new > share_old * (1 - self.min_gain):  # not worth the move
                new, share_new = old, share_old
            before, after = before + share_old, after + share_new
            if new != old:
                moved += sum(a != b for a, b in zip(old, new, strict=True))
                self._place(i, new)
        n = max(len(self.layers), 1)
        return {"moe/placement/experts_moved": float(moved), "moe/placement/top_rank_share_before": before / n,
                "moe/placement/top_rank_share_after": after / n}

    @contextlib.contextmanager
    def canonical(self) -> Iterator[None]:
        """Every expert at its own index (as checkpoints hold them) inside the block, the placement after."""
        placed = list(self.slots)
        for i, layer in enumerate(self.layers):
            self._place(i, list(range(layer.n_experts)))
        try:
            yield
        finally:
            for i, slots in enumerate(placed):
                self._place(i, slots)

    def _top_share(self, load: list[float], slot_of: list[int]) -> float:
        per_rank = len(load) // self.ranks
        by_rank = [0.0] * self.ranks
        for e, s in enumerate(slot_of):
            by_rank[s // per_rank] += load[e]
        return max(by_rank) / max(sum(by_rank), 1.0)

    @torch.no_grad()
    def _place(self, i: int, slot_of: list[int]) -> None:
        """Move layer ``i``'s experts (weights and companions) so that expert e sits at ``slot_of[e]``."""
        layer, old = self.layers[i], self.slots[i]
        if old == slot_of:
            return
        source = [0] * len(slot_of)  # new slot -> old slot of the expert that goes there
        for e, s in enumerate(slot_of):
            source[s] = old[e]
        for param in layer.experts.parameters():
            for t in [param, *self.companions(param)]:
                local = t.to_local() if isinstance(t, DTensor) else t
                local.copy_(move_rows(local, source, self.group))
        layer.expert_slot.copy_(torch.tensor(slot_of, device=layer.expert_slot.device))
        self.slots[i] = list(slot_of)
