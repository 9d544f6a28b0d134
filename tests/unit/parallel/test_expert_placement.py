"""Experts placed by load (``parallel/expert_placement.py``): the plan evens the ranks' loads with few swaps,
the row exchange equals a global permutation (4 gloo processes), and a MoDE layer whose experts sit in another
order computes exactly what the layer in expert order computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from torchtitan_ext.models.flavors import FLAVORS
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.parallel.expert_placement import move_rows, plan_swaps


def _rank_loads(load: list[float], slot_of: list[int], ranks: int) -> list[float]:
    per_rank = len(load) // ranks
    out = [0.0] * ranks
    for e, s in enumerate(slot_of):
        out[s // per_rank] += load[e]
    return out


def test_plan_swaps_by_hand():
    # experts 0-3 on rank 0 (loads 10, 9, 1, 1: 21), 4-7 on rank 1 (1, 1, 1, 1: 4). The swap closest to evening
    # the ranks out moves 8.5 of the 17 between them: 10 <-> 1 moves 9, 9 <-> 1 moves 8 (both 0.5 off); the tie
    # goes to the lower expert numbers, (0, 4). Then 12 / 13: nothing moves less than the gap of 1.
    load = [10.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    slot_of = plan_swaps(load, list(range(8)), 2)
    assert slot_of == [4, 1, 2, 3, 0, 5, 6, 7]
    assert _rank_loads(load, slot_of, 2) == [12.0, 13.0]


def test_plan_swaps_keeps_a_balanced_placement_and_the_rank_sizes():
    assert plan_swaps([1.0] * 16, list(range(16)), 4) == list(range(16))
    gen = torch.Generator().manual_seed(0)
    load = (torch.rand(64, generator=gen) ** 4 * 1000).tolist()  # a few hot experts
    start = torch.randperm(64, generator=gen).tolist()
    slot_of = plan_swaps(load, start, 4)
    assert sorted(slot_of) == list(range(64))  # a permutation: 16 experts per rank
    before, after = max(_rank_loads(load, start, 4)), max(_rank_loads(load, slot_of, 4))
    assert after < before and after <= sum(load) / 4 * 1.05
    assert plan_swaps(load, start, 4) == slot_of  # every rank plans the same


def _move(rank: int, world: int, source: list[int]) -> torch.Tensor:
    rows = torch.arange(len(source) * 3, dtype=torch.float64).view(len(source), 3)
    n = len(source) // world
    return move_rows(rows[rank * n:(rank + 1) * n].clone(), source, dist.group.WORLD)


@pytest.mark.parametrize("source", [[5, 0, 7, 2, 1, 4, 3, 6], list(range(8)), [1, 0, 2, 3, 4, 5, 7, 6]],
                         ids=["across ranks", "identity", "within ranks"])
def test_move_rows_equals_the_global_permutation(source):
    got = torch.cat(run_distributed(_move, 4, source, timeout=120))
    rows = torch.arange(len(source) * 3, dtype=torch.float64).view(len(source), 3)
    assert torch.equal(got, rows[source])


def test_mode_with_experts_in_another_order_computes_the_same():
    args = dataclasses.replace(FLAVORS["mode_debug"], vocab_size=64, dim=32, n_experts=8, top_k=2,
                               moe_hidden=16)
    torch.manual_seed(0)
    ref = MoDE(args).double()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    placed = MoDE(args).double()
    placed.load_state_dict(ref.state_dict())
    slot_of = torch.tensor([3, 7, 0, 5, 1, 6, 2, 4])
    with torch.no_grad():
        placed.expert_slot.copy_(slot_of)
        for name in ("w1", "w2", "w3"):
            w = getattr(placed.experts, name)
            w[slot_of] = getattr(ref.experts, name).detach().clone()
    x = torch.randn(2, 5, args.dim, dtype=torch.float64)
    out_ref, out = ref(x), placed(x)
    assert torch.equal(out, out_ref)
    out_ref.square().sum().backward()
    out.square().sum().backward()
    assert torch.equal(placed.load, ref.load)  # loads stay per expert
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(placed.experts, name).grad[slot_of], getattr(ref.experts, name).grad,
                                   rtol=0, atol=0)
    torch.testing.assert_close(placed.router.weight.grad, ref.router.weight.grad, rtol=0, atol=0)


def test_compiled_dispatch_follows_a_moved_placement():
    """The trainer compiles ``dispatch_tokens`` (``parallel/compile.py``); a placement written into the layer
    between steps must reach the compiled graph (a buffer read each call, not a constant baked in)."""
    args = dataclasses.replace(FLAVORS["mode_debug"], vocab_size=64, dim=32, n_experts=8, top_k=2, moe_hidden=16)
    torch.manual_seed(0)
    moe = MoDE(args)
    compiled = torch.compile(moe.dispatch_tokens, fullgraph=True)
    x = torch.randn(12, args.dim)
    with torch.no_grad():
        for slot_of in ([0, 1, 2, 3, 4, 5, 6, 7], [3, 7, 0, 5, 1, 6, 2, 4]):
            moe.expert_slot.copy_(torch.tensor(slot_of))
            copies, counts, (order, *_) = compiled(x, x.shape)
            want_copies, want_counts, (want_order, *_) = moe.dispatch_tokens(x, x.shape)
            assert torch.equal(counts, want_counts) and torch.equal(order, want_order)
            assert torch.equal(copies, want_copies)
