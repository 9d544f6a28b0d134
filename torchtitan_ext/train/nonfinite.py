"""Steps whose gradients are not finite are skipped instead of applied.

A finite loss can still back-propagate Inf or NaN (an overflow in one layer's backward); one optimizer step
on such gradients writes NaN into every weight it touches, and the next checkpoint would save them. The
global gradient norm (the same on every rank) decides: a non-finite norm skips the step on all ranks
(``Optimizers.step``, on the device); this guard counts and logs the skips when the step's norm is read on
the host, and ``max_in_row`` skips in a row stop the job.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torchtitan_ext.errors import RunStopped


class NonFiniteGradients(RunStopped):
    """Too many consecutive steps had non-finite gradients; the run stops without saving."""


class NonFiniteGuard:
    def __init__(self, max_in_row: int, log: Callable[[str], None]):
        self.max_in_row, self.log = max_in_row, log
        self.in_row = 0
        self.total = 0

    def record(self, step: int, norm: float) -> None:
        """Account for ``step``, whose update was skipped if ``norm`` is not finite; raises after
        ``max_in_row`` skips in a row."""
        if math.isfinite(norm):
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        if self.in_row >= self.max_in_row:
            raise NonFiniteGradients(
                f"step {step}: gradient norm is {norm} for the {self.in_row}th step in a row "
                f"(training.max_skipped_steps = {self.max_in_row}); stopping without saving")
        self.log(f"step {step}: gradient norm is {norm}; update skipped ({self.in_row} in a row, "
                 f"{self.total} in all)")
