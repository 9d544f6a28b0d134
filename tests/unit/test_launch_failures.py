"""Which failed worker the launcher names when several fail together (``tools/launch.py``)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from torchtitan_ext.tools.launch import _root_cause_first


def _failures(**by_rank: tuple[int, int]) -> dict[int, SimpleNamespace]:
    return {int(rank[1:]): SimpleNamespace(exitcode=code, timestamp=when) for rank, (code, when) in by_rank.items()}


def test_a_killed_worker_is_named_before_the_peers_its_death_stopped():
    # rank 1 killed: no error file, so its time is when the agent noticed, after rank 0 exited on the broken link
    failures = _failures(r0=(1, 100), r1=(-signal.SIGKILL, 101))
    assert min(failures.items(), key=_root_cause_first)[0] == 1


def test_otherwise_the_earliest_then_the_lowest_rank():
    assert min(_failures(r0=(1, 105), r1=(1, 101), r2=(1, 103)).items(), key=_root_cause_first)[0] == 1
    assert min(_failures(r0=(1, 101), r1=(1, 101)).items(), key=_root_cause_first)[0] == 0
    killed = _failures(r0=(-signal.SIGKILL, 104), r1=(1, 100), r2=(-signal.SIGTERM, 102))
    assert min(killed.items(), key=_root_cause_first)[0] == 2
