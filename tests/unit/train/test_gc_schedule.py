"""The garbage collector on a step schedule: cycles wait for the scheduled step, then go; automatic collection
comes back after training."""

from __future__ import annotations

import gc
import weakref

from torchtitan_ext.train.gc_schedule import GarbageCollection


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_cycles_are_freed_at_the_scheduled_steps_only():
    assert gc.isenabled()
    collector = GarbageCollection(every=3)
    try:
        assert not gc.isenabled()
        garbage = _cycle()
        for _ in range(2000):  # far past generation 0's threshold: an automatic collection would have run
            _cycle()
        for step in (1, 2):
            collector.step(step)
            assert garbage() is not None, f"freed at step {step}, before the schedule"
        collector.step(3)
        assert garbage() is None
    finally:
        collector.close()
    assert gc.isenabled()


def test_zero_leaves_automatic_collection_alone():
    collector = GarbageCollection(every=0)
    assert gc.isenabled()
    collector.step(50)
    collector.close()
    assert gc.isenabled()
