"""The planner's counts for torch's zero-bubble pipeline orders (plan/estimate.py ``_activation_memory``), read
from the orders torch itself builds (``_calculate_single_rank_operations``, a private method: if torch renames
it, this test says so): every rank holds at most min(micro-batches, pp) x virtual stages (micro-batch, stage)
graphs between their forward and their weight pass, and the first rank never has more than one input pass
waiting for its weight pass."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.plan.estimate import GIB, plan


def _order(schedule: type, pp: int, micro: int, virtual: int) -> list[list[str]]:
    """Each rank's actions as F / I / W, from torch's own order builder (no process group needed)."""
    order = object.__new__(schedule)
    order.pp_group_size, order._n_microbatches, order.n_local_stages = pp, micro, virtual
    order.num_stages = pp * virtual
    order.number_of_rounds = max(1, micro // pp)
    order.microbatches_per_round = micro // order.number_of_rounds
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    return [[kinds[a.computation_type.name] for a in order._calculate_single_rank_operations(rank) if a is not None]
            for rank in range(pp)]


def _held_and_waiting(actions: list[str]) -> tuple[int, int]:
    """The most graphs alive at once (forwards not yet through their weight pass) and the most input passes
    waiting for their weight pass (the running one included)."""
    forward = backward_input = weight = most_held = most_waiting = 0
    for kind in actions:
        forward += kind == "F"
        backward_input += kind == "I"
        most_held = max(most_held, forward - weight)
        most_waiting = max(most_waiting, backward_input - weight)
        weight += kind == "W"
    return most_held, most_waiting


CASES = [(schedules.ScheduleZBVZeroBubble, pp, micro, 2) for pp in (2, 4, 8) for micro in (2 * pp, 4 * pp)]
CASES += [(schedules.ScheduleInterleavedZeroBubble, pp, micro, v) for pp in (2, 4) for v in (2, 3)
          for micro in (pp, 2 * pp, 4 * pp)]


@pytest.mark.parametrize(("schedule", "pp", "micro", "virtual"), CASES,
                         ids=[f"{c[0].__name__}-pp{c[1]}-m{c[2]}-v{c[3]}" for c in CASES])
def test_planner_counts_match_torch_orders(schedule, pp, micro, virtual):
    ranks = [_held_and_waiting(actions) for actions in _order(schedule, pp, micro, virtual)]
    assert max(held for held, _ in ranks) == min(micro, pp) * virtual
    assert ranks[0][1] == 1  # the first rank: each weight pass right after its input pass
    # later ranks defer theirs, the last one most: the planner's note gives its count
    assert max(waiting for _, waiting in ranks) == ranks[-1][1] > 1
    argv = (f"--data.tokenizer byte --model.flavor debug --model.n_layers {4 * pp * virtual} "
            f"--activation_checkpoint.mode full --training.compile false --parallelism.pp {pp} "
            f"--parallelism.dp_shard 1 --training.local_batch_size {micro} --parallelism.pp_microbatches {micro} "
            f"--parallelism.pp_virtual_stages {virtual} --parallelism.pp_schedule {schedule.__name__[8:]}")
    note = next(n for n in plan(parse_args(argv.split()), pp).notes if n.startswith("zero-bubble"))
    assert f"holds up to {ranks[-1][1]} " in note, note


def test_zero_bubble_weight_pass_costs_memory():
    """ZBV at the measured 8B row's shape: the weight pass's gradients and the stage's recomputation come on top
    of Interleaved1F1B's activations at the same AC (12-18 GiB more; measured on 2 H200s: ZBV 105.55 GiB with
    full AC, test_measured_rows.py)."""
    base = ("--data.tokenizer byte --model.flavor llama3_8b --training.seq_len 8192 --training.compile false "
            "--activation_checkpoint.mode full --parallelism.pp 2 --parallelism.dp_shard 1 "
            "--training.local_batch_size 8 --parallelism.pp_microbatches 8 --parallelism.pp_virtual_stages 2 "
            "--parallelism.pp_schedule ")
    zbv, interleaved = (plan(parse_args((base + s).split()), 2) for s in ("ZBVZeroBubble", "Interleaved1F1B"))
    extra = (zbv.memory["activations"] - interleaved.memory["activations"]) / GIB
    assert 12 < extra < 18, extra
