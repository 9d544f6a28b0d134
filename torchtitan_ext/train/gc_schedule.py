"""Python's garbage collector on a fixed step schedule instead of whenever allocations cross its thresholds.

An automatic full collection walks every live Python object (compiled graphs, float8 tensor subclasses, the
data pipeline) and stops the rank for a noticeable time; in a collective-bound job every other rank waits for
it, and each rank collects at its own moment. With the collector off during training and a young-generation
collection every ``every`` steps on every rank at once, the pauses are short, aligned and predictable.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """``every`` > 0: automatic collection off until ``close``, a full collection now (what the model build
    left), and a collection of generations 0-1 at each step that is a multiple of ``every``. ``every`` = 0:
    Python's automatic collection, untouched."""

    def __init__(self, every: int):
        self.every = every
        self.was_enabled = gc.isenabled()
        if every > 0:
            gc.disable()
            gc.collect()

    def step(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.every > 0 and self.was_enabled:
            gc.enable()
