"""Loss-spike guard (Zen report): when a loss exceeds ``factor`` x the mean of the previous ``window``
losses, the LR is scaled by ``lr_scale`` for the next ``window`` steps."""

from __future__ import annotations

from collections import deque


class SpikeGuard:
    def __init__(self, factor: float = 1.5, window: int = 100, lr_scale: float = 0.5, enabled: bool = True):
        self.factor, self.window, self.lr_scale, self.enabled = factor, window, lr_scale, enabled
        self.history: deque[float] = deque(maxlen=window)
        self.cut_remaining = 0
        self.spikes = 0

    def observe(self, loss: float) -> bool:
        """Record this step's loss; returns True when it is a spike (which starts a new LR cut)."""
        spike = (self.enabled and len(self.history) == self.window
                 and loss > self.factor * sum(self.history) / len(self.history))
        if self.cut_remaining > 0:
            self.cut_remaining -= 1
        if spike:
            self.cut_remaining = self.window
            self.spikes += 1
        self.history.append(loss)
        return spike

    @property
    def lr_factor(self) -> float:
        return self.lr_scale if self.cut_remaining > 0 else 1.0

    def state_dict(self) -> dict:
        return {"history": list(self.history), "cut_remaining": self.cut_remaining, "spikes": self.spikes}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.cut_remaining = state["cut_remaining"]
        self.spikes = state["spikes"]
