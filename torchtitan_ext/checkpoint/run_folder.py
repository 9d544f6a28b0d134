"""A dump folder belongs to one run.

* ``probe_writable``: the dump folder and ``data.cache_dir`` are created and a probe file written and removed
  before any work, so a path that is not a directory, read-only, not permitted or full ends the job with one
  line naming it and the OS error (exit 2).
* ``RunLock``: rank 0 holds ``fcntl.flock`` on ``<dump>/.lock`` (host, pid, start time) for the run's life; a
  second job on the folder stops with one line naming the holder. The kernel drops the lock when its process
  dies, so a lock file still naming a holder that no longer holds it (a killed job) is taken over with one line.
* ``check_fresh_start``: a job that would start from step 0 in a folder that already holds another run's
  checkpoints or metrics stops with one line, unless ``job.overwrite = true``, which moves the old files aside
  into ``<dump>/previous-<UTC time>/`` (nothing is deleted). A restarted worker of the same elastic job
  (``TORCHELASTIC_RESTART_COUNT`` > 0) continues the same run and is let through.
* ``RunIdentity``: ``<dump>/run.json`` records what the run is (model arguments, seq_len, global batch, seed,
  data sources) at its first start; a resume names each change in one line. A damaged run.json (truncated,
  not JSON, not a record) is never replaced silently: it is renamed to ``run-damaged-<UTC time>.json`` with
  one line saying so, and the start begins a new record.
* ``keep_config``: each start's resolved config is kept: ``config.toml`` for the current one, the earlier ones
  as ``config-<UTC time>.toml``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan_ext.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
RUN_FILE = "run.json"
PREVIOUS_PREFIX = "previous-"
_STAYS = {LOCK_FILE, "logs"}  # never moved aside: the lock, and the append-only per-rank logs


class FolderUnusable(UserError):
    """The dump folder or the cache cannot be created or written."""


class FolderInUse(UserError):
    """Another live job holds the dump folder's lock."""


class FolderHoldsAnotherRun(UserError):
    """A job that would start from step 0 found another run's checkpoints or metrics."""


class NothingToTrain(Exception):
    """The resumed step is already ``training.steps``: the job ends with exit 0, having written nothing."""


def utc_stamp(t: float | None = None) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if t is None else t))


def unique(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... when taken."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def os_error_text(e: OSError) -> str:
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    return f"{e.strerror or e} ({code})"


def probe_writable(path: str | Path, what: str) -> Path:
    """Create ``path`` and write, sync and remove a probe file in it; a failure is one line naming the path
    (the component that failed, when it is another) and the OS error."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{socket.gethostname()}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"probe\n" * 64)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        where = f" (at {e.filename})" if e.filename and Path(str(e.filename)) != path else ""
        raise FolderUnusable(f"{what} {path}: {os_error_text(e)}{where}") from None
    return path


def _holder_text(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) \
        else "unknown time"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HELD: dict[str, RunLock] = {}  # this process's locks: the same job asking again gets the one it holds


class RunLock:
    """``flock`` on ``<folder>/.lock`` held until ``release`` (or the process's end)."""

    @classmethod
    def acquire(cls, folder: str | Path, log: Callable[[str], None]) -> RunLock:
        folder = Path(folder).expanduser().resolve()
        held = _HELD.get(str(folder))
        if held is None or held.fd is None:
            held = _HELD[str(folder)] = cls(folder, log)
        return held

    def _read(self) -> dict:
        try:
            text = os.pread(self.fd, 4096, 0).decode(errors="replace").strip()
            return json.loads(text) if text else {}
        except (OSError, ValueError):
            return {"host": "?", "pid": "?"}

    def __init__(self, folder: Path, log: Callable[[str], None]):
        self.folder, self.path = folder, folder / LOCK_FILE
        try:
            self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise FolderUnusable(f"job.dump_folder {self.folder}: cannot open the lock file {self.path}: "
                                 f"{os_error_text(e)}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read()
            os.close(self.fd)
            self.fd = None
            raise FolderInUse(
                f"job.dump_folder {self.folder} is in use by another run ({_holder_text(holder)}; lock file "
                f"{self.path}): wait for it to end, or choose another job.dump_folder") from None
        except OSError as e:  # a filesystem without flock: say so once, carry on unguarded
            log(f"warning: cannot lock {self.path} ({os_error_text(e)}); this job does not guard the folder "
                f"against a second job")
        previous = self._read()
        if previous:
            gone = ("is no longer running" if previous.get("host") == socket.gethostname()
                    and isinstance(previous.get("pid"), int) and not _pid_alive(previous["pid"])
                    else "no longer holds it")
            log(f"took over the stale lock {self.path}: its holder ({_holder_text(previous)}) {gone}")
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}) + "\n"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, me.encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Empty the lock file (a clean end leaves no holder named) and unlock."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None
        _HELD.pop(str(self.folder), None)


# --- one run per folder ---------------------------------------------------------------------------------

STEP_DIR = re.compile(r"^step-(\d+)$")


def published_steps(folder: Path) -> list[int]:
    """Steps with a ``step-N/`` folder (complete or damaged), ascending: the one reading of a checkpoint
    folder that resuming, loading and the fresh-start check share."""
    if not folder.is_dir():
        return []
    return sorted(int(m[1]) for d in folder.iterdir() if (m := STEP_DIR.match(d.name)) and d.is_dir())


def complete_steps(folder: Path) -> list[int]:
    """Steps with a finished checkpoint in ``folder``, ascending."""
    return [s for s in published_steps(folder) if (folder / f"step-{s}" / ".metadata").is_file()]


def previous_run_files(dump: Path, checkpoint_folder: str) -> list[str]:
    """What another run left in ``dump`` that a start from step 0 would overwrite: checkpoints, metrics."""
    found = []
    for sub in dict.fromkeys((checkpoint_folder, "checkpoint")):
        steps = published_steps(dump / sub)
        if steps:
            found.append(f"{sub}/step-{steps[-1]}" + (f" and {len(steps) - 1} more" if len(steps) > 1 else ""))
    records = 0
    with contextlib.suppress(OSError), open(dump / "metrics.jsonl", "rb") as f:
        records = sum(1 for line in f if line.strip())
    if records:
        found.append(f"metrics.jsonl ({records} records)")
    tb = dump / "tb"
    if tb.is_dir() and any(tb.iterdir()):
        found.append("tb/")
    return found


def move_aside(dump: Path, keep: tuple[Path, ...] = ()) -> tuple[Path, list[str]]:
    """Move every entry of ``dump`` but the lock, the logs, earlier ``previous-*`` folders and ``keep`` into
    ``<dump>/previous-<UTC time>/``; returns (that folder, the names moved)."""
    root = dump.resolve()
    keep_names = {p.resolve().name for p in keep if p.resolve().parent == root}
    dest = unique(dump / f"{PREVIOUS_PREFIX}{utc_stamp()}")
    names = sorted(e.name for e in dump.iterdir()
                   if e.name not in _STAYS and e.name not in keep_names and not e.name.startswith(PREVIOUS_PREFIX))
    if names:
        dest.mkdir()
        for name in names:
            os.replace(dump / name, dest / name)
    return dest, names


def would_resume(cfg: Any) -> bool:
    """The job will load a checkpoint (or stop trying): checkpointing on and a ``step-N`` folder present."""
    c = cfg.checkpoint
    return bool(c.enabled and published_steps(Path(cfg.job.dump_folder).expanduser() / c.folder))


def check_fresh_start(cfg: Any, rank: int, log: Callable[[str], None]) -> None:
    """Stop a start from step 0 over another run's files, or (``job.overwrite``) move them aside first."""
    dump = Path(cfg.job.dump_folder).expanduser()
    if would_resume(cfg) or not dump.is_dir():
        return
    found = previous_run_files(dump, cfg.checkpoint.folder)
    if not found:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        if rank == 0:
            log(f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']} of this elastic job: continuing its run in "
                f"{dump} from step 0 (no checkpoint yet)")
        return
    why = ("checkpoint.enabled = false" if not cfg.checkpoint.enabled
           else f"no checkpoint in {dump / cfg.checkpoint.folder}")
    if not cfg.job.overwrite:
        raise FolderHoldsAnotherRun(
            f"job.dump_folder {dump} holds another run's files ({', '.join(found)}) and this job would start "
            f"from step 0 ({why}); set job.overwrite = true to move them aside into {dump}/previous-<UTC time>/, "
            f"or choose another job.dump_folder")
    if rank == 0:
        dest, names = move_aside(dump, keep=(Path(cfg.data.cache_dir).expanduser(),))
        log(f"job.overwrite = true: moved the previous run's files ({', '.join(names)}) aside to {dest}")


def claim(cfg: Any, rank: int, log: Callable[[str], None]) -> RunLock | None:
    """At the start of a job, before anything is written: probe the dump folder and the cache, take the lock
    (rank 0), and refuse (or move aside) another run's files for a start from step 0."""
    probe_writable(cfg.job.dump_folder, "job.dump_folder")
    probe_writable(cfg.data.cache_dir, "data.cache_dir")
    lock = RunLock.acquire(cfg.job.dump_folder, log) if rank == 0 else None
    try:
        check_fresh_start(cfg, rank, log)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


# --- the run's identity -----------------------------------------------------------------------------------

def identity(cfg: Any, model_args: Any, global_batch: int) -> dict:
    """What makes a run this run; recorded at its first start in run.json."""
    args = dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else dict(vars(model_args))
    d = cfg.data
    return {"model": json.loads(json.dumps(args, default=str)), "training.seq_len": cfg.training.seq_len,
            "training.global_batch_size": global_batch, "job.seed": cfg.job.seed,
            "data.dataset": d.dataset, "data.train_path": d.train_path,
            "data.domains": json.loads(json.dumps(d.domains, default=str)), "data.tokenizer": d.tokenizer}


_ALLOWED = {"training.global_batch_size": "the data continues from the same position in tokens",
            "data.domains": "the mixture changes from here; the data continues from the same position in tokens"}


def identity_changes(saved: dict, now: dict) -> list[str]:
    """One line per key that differs between the recorded identity and this job's."""
    lines = []
    for key in now:
        if key == "model":
            old, new = saved.get("model", {}), now["model"]
            for k in sorted(set(old) | set(new)):
                if old.get(k) != new.get(k):
                    lines.append(f"model.{k} changed since the run began: {old.get(k)!r} -> {new.get(k)!r}")
        elif key in saved and saved[key] != now[key]:
            why = _ALLOWED.get(key, "resuming with the new value")
            lines.append(f"{key} changed since the last start: {saved[key]!r} -> {now[key]!r} ({why})")
    return lines


def read_identity(dump: Path) -> dict | None:
    try:
        return json.loads((dump / RUN_FILE).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return None


def write_identity(dump: Path, ident: dict, step: int) -> None:
    """run.json: the identity at the first start, the current one, and each start's step."""
    path = dump / RUN_FILE
    record = _previous_record(path)
    record.setdefault("first_identity", ident)
    record["identity"] = ident
    record.setdefault("starts", []).append({"time": utc_stamp(), "step": step})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def _previous_record(path: Path) -> dict:
    """run.json's record ({} when there is none); a damaged one is renamed aside, said in one line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("starts", []), list):
            raise ValueError(f"a JSON {type(record).__name__}, not a run record")
    except ValueError as e:  # truncated, not JSON, not UTF-8, another structure
        aside = unique(path.with_name(f"run-damaged-{utc_stamp()}.json"))
        os.replace(path, aside)
        why = str(e).strip().splitlines()[0][:120] if str(e).strip() else "empty"
        log.info(f"warning: {path} is damaged ({type(e).__name__}: {why}); kept aside as {aside}; this start "
                 f"begins a new record, so the settings of the starts before it are not compared with this one's")
        return {}
    return record


def keep_config(dump: Path, text: str) -> None:
    """Write this start's resolved config as config.toml; an earlier one is kept as config-<its UTC time>.toml."""
    current = dump / "config.toml"
    if current.is_file():
        if current.read_text() == text:
            return
        os.replace(current, unique(dump / f"config-{utc_stamp(current.stat().st_mtime)}.toml"))
    tmp = current.with_name("config.toml.tmp")
    tmp.write_text(text)
    os.replace(tmp, current)
