"""Loss-spike guard (Zen report): when a loss exceeds ``factor`` x the mean of the previous ``window``
losses, the LR is scaled by ``lr_scale`` for ``window`` steps.

The trainer reads each step's loss on the host one step late, while the GPU already runs the next step, so
the cut for a spike at step k covers steps k+2 .. k+1+window. The rule depends only on step numbers, not on
when a loss was read, so a resumed run and an uninterrupted one cut the same steps.
"""

from __future__ import annotations

from collections import deque


class SpikeGuard:
    def __init__(self, factor: float = 1.5, window: int = 100, lr_scale: float = 0.5, enabled: bool = True):
        self.factor, self.window, self.lr_scale, self.enabled = factor, window, lr_scale, enabled
        self.history: deque[float] = deque(maxlen=window)
        self.cut_from, self.cut_to = 1, 0  # the steps of the current LR cut, inclusive (none yet)
        self.spikes = 0

    def observe(self, step: int, loss: float) -> bool:
        """Record ``step``'s loss (steps in order); returns True when it is a spike, which cuts the LR of
        steps step+2 .. step+1+window (extending a cut that reaches step+1)."""
        spike = (self.enabled and len(self.history) == self.window
                 and loss > self.factor * sum(self.history) / len(self.history))
        if spike:
            if self.cut_to < step + 1:
                self.cut_from = step + 2
            self.cut_to = step + 1 + self.window
            self.spikes += 1
        self.history.append(loss)
        return spike

    def lr_factor(self, step: int) -> float:
        return self.lr_scale if self.cut_from <= step <= self.cut_to else 1.0

    def state_dict(self) -> dict:
        return {"history": list(self.history), "cut_from": self.cut_from, "cut_to": self.cut_to,
                "spikes": self.spikes}

    def load_state_dict(self, state: dict, step: int) -> None:
        """``step``: the checkpoint's step (checkpoints before step-numbered cuts saved the cut's length)."""
        self.history = deque(state["history"], maxlen=self.window)
        if "cut_remaining" in state:
            self.cut_from, self.cut_to = step + 1, step + state["cut_remaining"]
        else:
            self.cut_from, self.cut_to = state["cut_from"], state["cut_to"]
        self.spikes = state["spikes"]
