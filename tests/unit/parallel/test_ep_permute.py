"""Expert parallelism's re-sorting of received rows (``parallel/ep.py``): the arithmetic gather index equals
the earlier argsort over a ``repeat_interleave`` (kept here as the reference), and the route planned from a
count exchange reads the device once."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.models.mode import inverse_permutation
from torchtitan_ext.parallel.ep import regroup_index


def _reference_order(received: torch.Tensor) -> torch.Tensor:
    """The dispatch's index before this change: each received row's block id by ``repeat_interleave``, then a
    stable argsort on the local expert (rows arrive ordered by (source, local expert))."""
    ep, n_local = received.shape
    block = torch.repeat_interleave(torch.arange(ep * n_local), received.flatten())
    return (block % n_local).argsort(stable=True)


def _random_counts(gen: torch.Generator, ep: int, n_local: int, empty_rank: bool) -> torch.Tensor:
    counts = torch.randint(0, 6, (ep, n_local), generator=gen)
    counts[torch.rand(ep, n_local, generator=gen) < 0.3] = 0  # empty (source, expert) blocks
    if n_local > 1:
        counts[:, int(torch.randint(0, n_local, (1,), generator=gen))] = 0  # a local expert nobody sends to
    if empty_rank:
        counts[int(torch.randint(0, ep, (1,), generator=gen))] = 0  # a source rank that sends nothing
    return counts


@pytest.mark.parametrize("ep, n_local", [(1, 1), (1, 4), (2, 1), (2, 4), (4, 2), (4, 16), (8, 3)])
def test_regroup_index_equals_argsort_reference(ep, n_local):
    gen = torch.Generator().manual_seed(ep * 100 + n_local)
    for trial in range(25):
        received = _random_counts(gen, ep, n_local, empty_rank=trial % 3 == 0)
        total = int(received.sum())
        order = regroup_index(received, total)
        ref = _reference_order(received)
        assert torch.equal(order, ref), (received, order, ref)
        # The transposed problem is the inverse: expert-major rows back to (source, expert) order.
        inv = regroup_index(received.t(), total)
        assert torch.equal(inv, inverse_permutation(ref))
        rows = torch.randn(total, 3, generator=gen, dtype=torch.float64)
        assert torch.equal(rows[order][inv], rows)


def test_regroup_index_all_empty_and_hand_case():
    assert regroup_index(torch.zeros(3, 2, dtype=torch.long), 0).numel() == 0
    # Sources 0 and 1, experts a and b; rows arrive as [0a 0a | 0b | 1a | (1b empty)] -> [0a 0a 1a | 0b].
    received = torch.tensor([[2, 1], [1, 0]])
    assert regroup_index(received, 4).tolist() == [0, 1, 3, 2]
    assert regroup_index(received.t(), 4).tolist() == [0, 1, 3, 2]
