"""An exponential moving average of the parameters, in float32, sharded like them.

Each shadow is a float32 copy of a parameter with the same placements (an FSDP/TP DTensor stays a DTensor),
so updates are local (no gathers) and the checkpoint stores and reshards it like the model. From
``start_step`` every ``every`` steps: ``ema = decay * ema + (1 - decay) * param``; at the first such step the
average starts as a copy of the parameters. ``swapped_in`` lends the average to the model (evaluation,
exporters) and restores the trained weights afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from torchtitan_ext.parallel.compile import clean_fqn


class EMA:
    def __init__(self, parts: list[nn.Module], decay: float, every: int = 1, start_step: int = 0):
        self.decay, self.every, self.start_step = decay, every, start_step
        self.params: dict[str, nn.Parameter] = {clean_fqn(n): p for m in parts for n, p in m.named_parameters()}
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.started = False

    @torch.no_grad()
    def update(self, step: int, applied: torch.Tensor | None = None) -> None:
        """After the optimizer step of 1-based ``step``. ``applied``: a device scalar, 0 when the optimizer
        skipped the step (the average then stays as it is, without a host read)."""
        if step < self.start_step or (step - self.start_step) % self.every:
            return
        weight = 1.0 - self.decay if applied is None else (1.0 - self.decay) * applied.float()
        for n, p in self.params.items():
            if self.started:
                self.shadow[n].lerp_(p.detach().float(), weight)
            else:  # a skipped step left the weights as they were: starting from them is the same
                self.shadow[n].copy_(p.detach())
        self.started = True

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside the block (the trained weights once it started)."""
        if not self.started:
            yield
            return
        with torch.no_grad():
            saved = {n: p.detach().clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    # Stateful, for the checkpoint's ``states`` dict.
    def state_dict(self) -> dict:
        return {"started": torch.tensor(int(self.started)), **{f"shadow.{n}": t for n, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.started = bool(int(state["started"]))
        with torch.no_grad():
            for n, t in self.shadow.items():
                if state[f"shadow.{n}"] is not t:
                    t.copy_(state[f"shadow.{n}"])
