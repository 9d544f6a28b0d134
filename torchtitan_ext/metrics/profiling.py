"""``[profiling]``: a torch.profiler trace of steps start_step..end_step (one Chrome trace JSON per rank) and,
on CUDA, a memory snapshot of the same steps (``torch.cuda.memory`` history, a pickle for
https://pytorch.org/memory_viz).

The trainer calls ``step(n)`` at the start of each step and ``finish()`` however training ends; the profiler
runs only while a step of the range runs, so the trace holds those steps' events and no others. Each step is
one ``ProfilerStep#<n>`` range in the trace.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from torchtitan_ext.config.job_config import ProfilingSection
from torchtitan_ext.errors import ConfigError

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept by the CUDA caching allocator's history


class Profiling:
    """Starts at ``start_step``, annotates each step, writes the trace (and snapshot) after ``end_step``."""

    def __init__(self, cfg: ProfilingSection, dump_folder: str, rank: int, device: torch.device,
                 log: Callable[[str], None]):
        if cfg.enabled and cfg.end_step < cfg.start_step:  # a step range that selects nothing
            raise ConfigError(f"profiling.end_step = {cfg.end_step} must be >= profiling.start_step = "
                              f"{cfg.start_step}")
        self.cfg, self.rank, self.log = cfg, rank, log
        self.folder = Path(dump_folder) / cfg.folder
        self.cuda = device.type == "cuda"
        self.memory = cfg.enabled and cfg.memory_snapshot and self.cuda
        if cfg.enabled and cfg.memory_snapshot and not self.cuda:
            log("profiling.memory_snapshot skipped: CUDA memory snapshots need a GPU (the trace is still written)")
        self.prof: profile | None = None
        self.range: record_function | None = None

    def step(self, step: int) -> None:
        """Called at the start of ``step``, before its forward pass."""
        if not self.cfg.enabled:
            return
        self._end_range()
        if step == self.cfg.start_step and self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                                with_stack=self.cfg.with_stack)
            self.prof.__enter__()
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        elif step > self.cfg.end_step:
            self.finish()
        if self.prof is not None:
            self.range = record_function(f"ProfilerStep#{step}")
            self.range.__enter__()

    def _end_range(self) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None

    def finish(self) -> None:
        """Write what was recorded (also when training ends inside the range); idempotent."""
        if self.prof is None:
            return
        self._end_range()
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        span = f"steps{self.cfg.start_step}-{self.cfg.end_step}"
        trace = self.folder / f"rank{self.rank}_{span}.json"
        self.prof.export_chrome_trace(str(trace))
        self.prof = None
        written = [trace]
        if self.memory:
            snapshot = self.folder / f"rank{self.rank}_{span}_memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.log(f"profiling: wrote {', '.join(map(str, written))}")
