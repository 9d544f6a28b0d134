"""Pipeline schedules the job cannot run are refused with one line before any work."""

from __future__ import annotations

import pytest

from torchtitan_ext.errors import ConfigError
from torchtitan_ext.parallel.pp import check_schedule


@pytest.mark.parametrize("schedule,virtual", [("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
def test_zero_bubble_schedules_refuse_op_level_selective_checkpointing(schedule, virtual):
    # Run, they end in torch's "Trying to backward an extra time ... selective activation checkpoint" on every
    # rank (seen on 2 CPU processes with the debug model): the weight-gradient pass is a second backward.
    with pytest.raises(ConfigError, match=rf"pp_schedule = '{schedule}'.*activation_checkpoint.mode = 'full'"):
        check_schedule(schedule, virtual, 4, 2, 8, op_level_sac=True)
    check_schedule(schedule, virtual, 4, 2, 8, op_level_sac=False)  # full / layer-level / no checkpointing


@pytest.mark.parametrize("schedule,virtual", [("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
def test_zero_bubble_schedules_refuse_compiled_blocks(schedule, virtual):
    # Run, torch's schedule constructor raises "not supported with stage modules that have used torch.compile"
    # on every rank (seen on 4 H100s in the multigpu tier, and on 2 CPU processes).
    with pytest.raises(ConfigError, match=rf"pp_schedule = '{schedule}'.*training.compile = false"):
        check_schedule(schedule, virtual, 4, 2, 8, compiled=True)


@pytest.mark.parametrize("schedule,virtual", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])
def test_one_backward_schedules_keep_op_level_selective_checkpointing(schedule, virtual):
    check_schedule(schedule, virtual, 4, 2, 8, op_level_sac=True, compiled=True)
