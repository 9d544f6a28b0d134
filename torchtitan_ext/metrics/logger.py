"""Console (rank 0, through the ``torchtitan_ext`` logger, with elapsed time and ETA), TensorBoard scalars,
metrics.jsonl and further sinks (W&B: ``wandb_sink``) for each logged step; MFU and GPU memory.

A resumed job redoes the steps after its checkpoint: their earlier records are dropped from metrics.jsonl
(and purged from TensorBoard) on start-up, so each step appears once, with the values of the run that kept it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from torchtitan_ext.errors import UserError

if TYPE_CHECKING:
    from torchtitan_ext.metrics.wandb_sink import MetricsSink

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (FLOP/s) used for MFU; GPUs not listed report no MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12}
ETA_WINDOW = 10  # logged steps whose rate gives the ETA
CONSOLE_FIELDS = {"loss": "loss {:.4f}", "val_loss": "val {:.4f}", "val_windows": "({:,.0f} windows)",
                  "grad_norm": "gnorm {:.3f}", "lr": "lr {:.2e}",
                  "tokens_per_sec": "tok/s {:,.0f}", "mfu": "mfu {:.1%}", "memory_gib": "mem {:.1f}GiB",
                  "memory_max_gib": "(max rank {:.1f})"}


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def flops_per_token(active_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (active non-embedding parameters + output head) for the matmuls of
    forward and backward, plus 12 x layers x heads x head_dim x seq_len for attention scores and values
    (counted without the causal half, as in PaLM and torchtitan)."""
    return 6 * active_params + 12 * n_layers * n_heads * head_dim * seq_len


class MetricsWriteFailed(UserError):
    """metrics.jsonl cannot be written (a full disk, a read-only filesystem): one line, exit code 2."""


class MetricsLogger:
    """Rank 0 writes each logged step to TensorBoard, metrics.jsonl, the ``sinks`` (e.g. ``wandb_sink.WandbSink``:
    anything with ``log(step, values)`` and ``close()``) and the console line, which ends with the wall time
    since this logger started and, given ``total_steps``, the estimated time to it from the recent steps' rate."""

    def __init__(self, dump_folder: str, rank: int, tensorboard: bool, jsonl: bool, resume_step: int = 0,
                 total_steps: int = 0, sinks: Sequence[MetricsSink] = ()):
        self.rank = rank
        self.tb = None
        self.jsonl = None
        self.sinks = list(sinks)
        self.total_steps = total_steps
        self.start = time.monotonic()
        self.recent: deque[tuple[int, float]] = deque([(resume_step, self.start)], maxlen=ETA_WINDOW + 1)
        if rank != 0:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            self.tb = _tensorboard(folder / "tb", purge_step=resume_step + 1)
        if jsonl:
            drop_after(folder / "metrics.jsonl", resume_step)
            self.jsonl = open(folder / "metrics.jsonl", "a", buffering=1)

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.rank != 0:
            return
        if self.tb is not None:
            try:
                for k, v in values.items():
                    self.tb.add_scalar(k, v, step)
            except OSError as e:  # the writer thread's failure, raised again here
                folder, self.tb = self.tb.log_dir, None
                raise MetricsWriteFailed(f"writing TensorBoard events to {folder} failed at step {step}: "
                                         f"{os_error_text(e)}") from None
        if self.jsonl is not None:
            try:
                self.jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
            except OSError as e:
                path, self.jsonl = self.jsonl.name, None
                raise MetricsWriteFailed(f"writing {path} failed at step {step}: {os_error_text(e)}") from None
        for sink in self.sinks:
            sink.log(step, values)
        log.info("  ".join([*_console_fields(step, values), *self._timing(step)]))

    def console(self, step: int, values: dict[str, float], note: str = "") -> None:
        """A console line alone (rank 0), written nowhere else and leaving the ETA's window as it is: the first
        step of a run whose ``metrics.log_freq`` would keep it silent for a while."""
        if self.rank != 0:
            return
        log.info("  ".join([*_console_fields(step, values), f"elapsed {hms(time.monotonic() - self.start)}",
                            *([note] if note else [])]))

    def _timing(self, step: int) -> list[str]:
        """``elapsed H:MM:SS`` and, with a step total, ``eta H:MM:SS`` at the rate of the last ETA_WINDOW
        logged steps (the first line: since the start)."""
        now = time.monotonic()
        if step > self.recent[-1][0]:
            self.recent.append((step, now))
        parts = [f"elapsed {hms(now - self.start)}"]
        (first_step, first_time), (last_step, last_time) = self.recent[0], self.recent[-1]
        if self.total_steps and last_step > first_step:
            rate = (last_time - first_time) / (last_step - first_step)
            parts.append(f"eta {hms(rate * max(self.total_steps - step, 0))}")
        return parts

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for out in (self.tb, self.jsonl, *sinks):
            if out is not None:
                with contextlib.suppress(OSError):  # a full disk was said when the write failed
                    out.close()


def _console_fields(step: int, values: dict[str, float]) -> list[str]:
    return [f"step {step:>6}", *(fmt.format(values[key]) for key, fmt in CONSOLE_FIELDS.items() if key in values)]


def _tensorboard(folder: Path, purge_step: int):
    """A SummaryWriter in ``folder``; a failure to write its first events (a full disk at the start of a resume)
    is one line. Its writer thread's own traceback is silenced (``_quiet_tensorboard_thread``): the writer raises
    the same error again in the main thread, where :meth:`MetricsLogger.log` says it."""
    from torch.utils.tensorboard import SummaryWriter

    if threading.excepthook is not _quiet_tensorboard_thread:
        global _previous_excepthook
        _previous_excepthook, threading.excepthook = threading.excepthook, _quiet_tensorboard_thread
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        return SummaryWriter(log_dir=str(folder), purge_step=purge_step)
    except OSError as e:
        for created in set(folder.iterdir()) - before if folder.is_dir() else ():  # its empty or torn event file
            created.unlink(missing_ok=True)
        raise MetricsWriteFailed(f"writing TensorBoard events to {folder} failed: {os_error_text(e)}") from None


_previous_excepthook = threading.excepthook


def _quiet_tensorboard_thread(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: an OSError that ends TensorBoard's writer thread prints nothing (the main
    thread reports it in one line); anything else goes to the previous hook."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
        return
    _previous_excepthook(args)


def hms(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded), e.g. ``0:01:23``."""
    s = max(int(seconds), 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def drop_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= ``step`` (and no torn last line) in the JSONL file at ``path``."""
    if not path.is_file():
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line, record in step_records(path) if record["step"] <= step))
    tmp.replace(path)


def validated_at(path: Path, step: int) -> bool:
    """The JSONL file at ``path`` records a validation loss for ``step``."""
    return path.is_file() and any(r["step"] == step and "val_loss" in r for _, r in step_records(path))


def step_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(line, record) of each JSON object with an int ``step`` in the JSONL file at ``path``, skipping the
    others and a torn last line of a killed run."""
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            yield line, record


class _Tee(io.TextIOBase):
    """A text stream that writes to the console stream and to a log file. Logging is never what crashes: when
    the file cannot be written (a full disk, a read-only filesystem), the console says so in one line and the
    tee goes on with the console alone."""

    def __init__(self, stream: TextIO, file: TextIO, path: Path, failed: list[str]):
        self.stream, self.file, self.path, self.failed = stream, file, path, failed

    def _to_file(self, write: Callable[[], object], mid_line: bool = False) -> None:
        if self.failed:
            return
        try:
            write()
        except OSError as e:
            self.failed.append(os_error_text(e))
            self.stream.write(f"{chr(10) if mid_line else ''}warning: cannot write the rank log {self.path}: "
                              f"{self.failed[0]}; logging to the console only\n")

    def write(self, s: str) -> int:
        self.stream.write(s)
        self._to_file(lambda: self.file.write(s), mid_line=bool(s) and not s.endswith("\n"))
        return len(s)

    def flush(self) -> None:
        self.stream.flush()
        self._to_file(self.file.flush)


def os_error_text(e: OSError) -> str:
    """``No space left on device (ENOSPC)``."""
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    return f"{e.strerror or e} ({code})"


@contextlib.contextmanager
def rank_log(dump_folder: str, rank: int) -> Iterator[Path]:
    """Within the block, copy this process's Python stdout and stderr (messages, warnings, and the traceback
    of an exception leaving the block) to ``<dump_folder>/logs/rank-<rank>.log``: the console shows rank 0,
    the files show every rank (the log messages of ranks > 0 reach their file through the logging handler
    of ``cli.setup_logging``, not the console). A file that cannot be written is said once on the console and
    left (``_Tee``); it never raises."""
    path = Path(dump_folder) / "logs" / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = sys.stdout, sys.stderr
    failed: list[str] = []  # shared by both tees: the file is said to be broken once
    file = open(path, "a", buffering=1)
    sys.stdout, sys.stderr = _Tee(sys.stdout, file, path, failed), _Tee(sys.stderr, file, path, failed)
    try:
        yield path
    except BaseException:
        if not failed:
            with contextlib.suppress(OSError):
                traceback.print_exc(file=file)  # the console gets it from the interpreter, once
        raise
    finally:
        sys.stdout, sys.stderr = saved
        with contextlib.suppress(OSError):  # closing flushes: a full disk must not raise here either
            file.close()
