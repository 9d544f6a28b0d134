"""Preemption: SIGTERM (Slurm's time limit, spot reclaim), SIGUSR1 (``sbatch --signal``) or SIGINT (Ctrl-C) asks
the job to stop.

The handler only sets a flag. After each step every rank contributes its flag to one all-reduce (MAX), so
a signal delivered to a single rank still stops all of them after the same step; the trainer then saves a
checkpoint and exits 0, and a requeued job resumes from it exactly. With several ranks the reduced flag is
read one step later (the reduction queued behind step N is done by the time step N+1 is queued), so the
check never makes the GPU wait for the host; a signal stops the job one step later than on one rank.

Before training begins nothing needs saving: until the trainer installs its handlers (``raise_on_signal``,
from the entry point) a signal raises ``StartupInterrupted`` where the job is; after that, the trainer asks
``check_startup`` once more before its first write (the resume), so a signal during start-up or resume ends
the job with exit 0 and one line, having written nothing.

Ctrl-C is a stop request like SIGTERM (finish the step, save, exit 0), never a ``KeyboardInterrupt`` in the
middle of a load or a save. A second Ctrl-C while the job is already stopping raises ``InterruptedAgain`` at
once: the job ends without finishing the step or the save (a partial ``step-N.tmp`` is removed, the previous
checkpoint stays), with one line and exit code 130 (``EXIT_INTERRUPTED``, 128 + SIGINT).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import torch
import torch.distributed as dist

from torchtitan_ext.errors import EXIT_INTERRUPTED, EXIT_OK

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StartupInterrupted(BaseException):
    """A preemption signal before training began: nothing written, exit 0. A BaseException, so that no
    ``except Exception`` on the way (a checkpoint load's fallback) takes it for a failure."""

    exit_code = EXIT_OK


class InterruptedAgain(StartupInterrupted):
    """A second Ctrl-C while the job was already stopping: it ends at once, without saving; exit code 130."""

    exit_code = EXIT_INTERRUPTED


@contextmanager
def handlers_restored() -> Iterator[None]:
    """The process's handlers of ``SIGNALS`` put back as they were when the run ends. A run called in process (a
    test, a notebook) otherwise leaves its stop-request handler behind, and a process forked later inherits it:
    a ``multiprocessing`` pool's worker then survives the SIGTERM that ``Pool.terminate`` ends it with."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def raise_on_signal() -> None:
    """Until ``Preemption`` replaces them: SIGTERM / SIGUSR1 raise ``StartupInterrupted`` at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise StartupInterrupted(f"preempted ({signal.Signals(signum).name}) during start-up: nothing written; "
                                 f"exiting")

    for sig in SIGNALS:
        signal.signal(sig, stop)


class Preemption:
    def __init__(self, device: torch.device):
        self.device = device
        self.several = dist.is_initialized() and dist.get_world_size() > 1  # flags are reduced over the ranks
        self.signal: int | None = None
        self.reduced: torch.Tensor | None = None  # the flags reduced after the previous step
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            raise InterruptedAgain("interrupted again (SIGINT): stopping at once, without finishing the step or "
                                   "saving; a resume starts from the last published checkpoint")
        if self.signal is None or signum == signal.SIGINT:
            self.signal = signum

    def _any_rank(self) -> torch.Tensor:
        # torch.full fills on the device: no host-to-device copy that would wait for the queued step
        flag = torch.full((), 0 if self.signal is None else 1, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def check_startup(self) -> None:
        """Blocking, on every rank: raise ``StartupInterrupted`` when a signal has reached any rank so far."""
        if self._any_rank().item() if self.several else self.signal is not None:
            raise StartupInterrupted(f"preempted ({self.source()}) during start-up or resume: nothing written; exiting")

    def source(self) -> str:
        """What stopped the job, as this rank saw it: the signal it received, or "signal on another rank"."""
        return signal.Signals(self.signal).name if self.signal is not None else "signal on another rank"

    def requested(self) -> bool:
        """Call once after every step on every rank; the same answer on all of them: True once a signal
        reached any rank (with several ranks, as of the previous step)."""
        if not self.several:
            return self.signal is not None
        stop = self.reduced is not None and bool(self.reduced.item())
        self.reduced = self._any_rank()
        return stop
