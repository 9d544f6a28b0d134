"""Preemption: SIGTERM (Slurm's time limit, spot reclaim) or SIGUSR1 (``sbatch --signal``) asks the job to stop.

The handler only sets a flag. After each step every rank contributes its flag to one all-reduce (MAX), so
a signal delivered to a single rank still stops all of them after the same step; the trainer then saves a
checkpoint and exits 0, and a requeued job resumes from it exactly.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self, device: torch.device):
        self.device = device
        self.signal: int | None = None
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum

    def requested(self) -> bool:
        """True on every rank once any rank has received a signal (a collective: call it on all ranks)."""
        flag = torch.tensor(0 if self.signal is None else 1, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

