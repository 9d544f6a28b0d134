"""The teacher pass's progress (issue 64): rewritten in place on a terminal; in a log file one line every few
seconds and one at each shard's end, never carriage returns."""

from __future__ import annotations

import io

from torchtitan_ext.tools.teacher import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_a_line_every_period_and_at_each_shards_end():
    log, clock = io.StringIO(), _Clock()
    progress = Progress(log, period=5.0, clock=clock)
    for done in range(1, 11):  # a chunk per second
        clock.now = float(done)
        progress("train_000.bin", done, 10, 1000.0)
    clock.now = 11.0
    progress("train_001.bin", 4, 4, 2000.0)
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == ["train_000.bin: 5/10 windows, 1,000 tokens/s",
                                           "train_000.bin: 10/10 windows, 1,000 tokens/s",
                                           "train_001.bin: 4/4 windows, 2,000 tokens/s"]


def test_a_terminal_gets_one_line_per_shard_rewritten_in_place():
    tty = _Terminal()
    progress = Progress(tty, period=5.0, clock=_Clock())
    for done in (1, 2, 3):
        progress("train_000.bin", done, 3, 10.0)
    assert tty.getvalue() == ("\rtrain_000.bin: 1/3 windows, 10 tokens/s\rtrain_000.bin: 2/3 windows, 10 tokens/s"
                              "\rtrain_000.bin: 3/3 windows, 10 tokens/s\n")
