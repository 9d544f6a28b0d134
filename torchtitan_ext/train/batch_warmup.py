"""Batch-size warmup: the global batch ramps from a start size to the full one, in whole micro-batches.

A micro-batch is ``local_batch_size x data-parallel degree`` sequences; a full step is ``full`` of them
(gradient accumulation). Step s (1-based) uses ``n(s) = clamp(floor(start + (full - start) * T / W), start,
full)`` micro-batches, where T is the tokens consumed before step s and W = ``training.batch_warmup_tokens``.
The schedule is a pure function of the step (recomputed on resume, no state): the loader advances one
micro-batch position per micro-batch, and the learning-rate schedule, token counters and MFU read the same
counts, so a run resumed mid-ramp continues exactly.
"""

from __future__ import annotations


class BatchWarmup:
    def __init__(self, full_micro: int, start_micro: int, micro_tokens: int, warmup_tokens: int, steps: int):
        """``full_micro`` / ``start_micro``: micro-batches per step at the end / start of the ramp;
        ``micro_tokens``: tokens of one micro-batch over all data-parallel ranks."""
        self.full, self.start, self.micro_tokens, self.warmup_tokens = full_micro, start_micro, micro_tokens, \
            warmup_tokens
        self._cum = [0]  # _cum[s]: micro-batches consumed by steps 1..s
        self._extend(steps)

    def _extend(self, steps: int) -> None:
        while len(self._cum) <= steps:
            consumed = self._cum[-1] * self.micro_tokens
            n = self.full
            if self.warmup_tokens > 0 and consumed < self.warmup_tokens:
                n = self.start + (self.full - self.start) * consumed // self.warmup_tokens
                n = min(max(n, self.start), self.full)
            self._cum.append(self._cum[-1] + n)

    def micro_batches(self, step: int) -> int:
        """Micro-batches of 1-based ``step``."""
        self._extend(step)
        return self._cum[step] - self._cum[step - 1]

    def tokens_through(self, step: int) -> int:
        """Tokens consumed by steps 1..step (all ranks)."""
        self._extend(step)
        return self._cum[step] * self.micro_tokens

    def effective_step(self, step: int) -> float:
        """Steps 1..step measured in full-batch steps: the learning-rate schedule's clock."""
        self._extend(step)
        return self._cum[step] / self.full
