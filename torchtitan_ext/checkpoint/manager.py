"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Each save writes ``step-N.tmp/`` and is renamed to ``step-N/`` by rank 0 only once DCP has written its
metadata, i.e. once every rank's data is on disk; a crash mid-save leaves a ``.tmp`` folder that is ignored
and cleared on the next start, so the latest complete checkpoint is never touched. DCP stores parameters
by FQN with their global shapes, so a checkpoint loads under any other layout or world size.

With Squinch error feedback, each rank's compression residuals (rank-local, layout-specific state that DCP's
replicated-tensor semantics do not fit) go beside DCP's files into ``squinch_residuals/rank-<r>.pt`` with a
layout fingerprint, written before the folder is published. A resume under the same layout restores them, so
the run continues exactly; under another layout, or from a checkpoint without them, every rank restarts its
residuals from zero and rank 0 logs one line saying why.

A published ``step-N/`` that cannot be loaded (its ``.metadata`` or a shard file missing or truncated) is
skipped with one line naming it and the checkpoint used instead; when every one is unreadable the job stops
(``CheckpointUnreadable``, exit 2) rather than silently training from step 0, unless
``checkpoint.allow_fresh_start``. An async save still pending when the job ends (normally or by an
exception) is waited for and published if DCP finished writing it, else removed, never left half-done.

A resume checks what it resumes: the model's parameters (names and global shapes, over every rank's stages)
are compared with the checkpoint's before loading, and a missing, unexpected or reshaped parameter stops the
job with one line naming it and both values (``CheckpointMismatch``, exit 2) instead of loading what fits.

Resuming an older step is a branch: the checkpoints newer than the one loaded are moved aside to
``abandoned-<UTC time>/`` (one line), never deleted, so "latest" is always this run's newest save and
``keep_latest_k`` counts this run's saves. A save that fails with an OS error (no space, read-only) removes
its partial ``step-N.tmp``, leaves the previous checkpoint as it was and stops the job with one line naming
the path and the error (``CheckpointWriteFailed``, exit 2).

Every published folder holds ``checksums.json`` (``integrity.py``: each file's size and CRC-32, summed by the
rank that wrote it once the save is complete, before the rename), checked before a load reads anything: a
damaged, emptied or missing file is named in the one line and the step is skipped like one without
``.metadata``. A folder without the manifest (saved before it existed) loads unverified, said in one line.
An interrupt (Ctrl-C, a signal's exception) during a load or save is re-raised as itself, never taken for
damage. A verified checkpoint that still does not load, or whose parameters are not the model's, is not
damage either: the keys that changed since the last start (``<dump>/config.toml``: the optimizer, float8,
the parallel layout, the model) are named with the value to set (``CheckpointMismatch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torchtitan_ext.checkpoint.integrity import (
    ManifestUnreadable,
    checksum,
    files_written_by,
    first_damage,
    read_manifest,
    write_manifest,
)
from torchtitan_ext.checkpoint.run_folder import (
    STEP_DIR,
    complete_steps,
    os_error_text,
    published_steps,
    read_identity,
    unique,
    utc_stamp,
)
from torchtitan_ext.checkpoint.safe_reader import UnsafeCheckpointFile, checkpoint_metadata, safe_load
from torchtitan_ext.config.job_config import CheckpointSection
from torchtitan_ext.config.loader import model_table
from torchtitan_ext.errors import ConfigError, UserError

RESIDUALS_DIR = "squinch_residuals"


class ModelParts:
    """The model (or this rank's pipeline stages) as one Stateful keyed by FQN."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        return {k: v for m in self.parts for k, v in get_model_state_dict(m).items()}

    def load_state_dict(self, sd: dict) -> None:
        for m in self.parts:
            set_model_state_dict(m, sd, options=StateDictOptions(strict=False))


class CheckpointUnreadable(UserError):
    """Checkpoints exist but none can be loaded (or the one ``load_step`` names cannot)."""


class CheckpointMismatch(UserError):
    """The checkpoint's parameters are not the model's (a missing, unexpected or reshaped one)."""


class CheckpointWriteFailed(UserError):
    """A save failed with an OS error (no space, read-only, permission); the previous checkpoint is intact."""


def _shape_text(shape: tuple | None) -> str:
    return "absent" if shape is None else f"shape [{', '.join(map(str, shape))}]"


def model_mismatch(saved: dict[str, tuple], model: dict[str, tuple],
                   advice: str = "resume with the model settings that wrote it (see run.json)") -> str | None:
    """The first difference between the checkpoint's parameters and the model's (name -> shape), as text."""
    names = sorted(set(saved) | set(model), key=lambda n: (n not in model, n))
    diff = [n for n in names if saved.get(n, None) != model.get(n, None)]
    if not diff:
        return None
    n = diff[0]
    more = f" ({len(diff)} parameters differ in all)" if len(diff) > 1 else ""
    return f"parameter {n}: checkpoint {_shape_text(saved.get(n))}, model {_shape_text(model.get(n))}{more}; {advice}"


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed save (DCP wraps each rank's in a CheckpointException)."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, OSError):
                return exc
    cause = e.__cause__ or e.__context__
    return _os_error(cause) if cause is not None else None


def _no_space(tmp: Path) -> OSError | None:
    """The OSError a save hid: torch's zip writer turns a full disk into ``RuntimeError: ... unexpected pos``.
    A probe of 64 KiB written and synced beside the partial folder finds it; None when the probe succeeds."""
    probe = tmp.parent / f".space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(65536))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return OSError(e.errno, e.strerror, str(tmp))
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return None


def interrupt_in(e: BaseException) -> BaseException | None:
    """The interrupt inside a failed load or save (KeyboardInterrupt, a signal's exception: anything that is
    not an ``Exception``), which DCP wraps with real failures in a CheckpointException; None when there is none."""
    if not isinstance(e, CheckpointException):
        return None if isinstance(e, Exception) else e
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, BaseException) and (found := interrupt_in(exc)) is not None:
            return found
    return None


SHAPING_KEYS = ("optimizer.name", "float8.", "parallelism.", "model.", "ema.")  # what a checkpoint's contents follow


def config_changes(dump: Path, job: Any, prefixes: tuple[str, ...] = SHAPING_KEYS) -> list[str]:
    """The keys under ``prefixes`` whose value differs between the previous start's resolved config
    (``<dump>/config.toml``) and ``job``, each as ``key changed since the last start (old -> new): set key = old``."""
    if job is None:
        return []
    try:
        before = tomllib.loads((dump / "config.toml").read_text())
    except (OSError, ValueError):
        return []
    resolved = (read_identity(dump) or {}).get("model", {})  # the model the flavor gave, for unset keys
    lines = []
    for section in dataclasses.fields(job):
        values = dataclasses.asdict(getattr(job, section.name))
        saved = before.get(section.name, {})
        if section.name == "model":  # a key absent there was unset (None), as it may be in the job
            table = model_table(saved)
            saved = {key: table.get(key) for key in values}
        for key, value in values.items():
            name, old = f"{section.name}.{key}", saved.get(key, value)
            if old == value or not name.startswith(prefixes):
                continue
            old = resolved.get(key) if old is None else old  # unset: say the value the flavor gave
            advice = f"leave {name} unset" if old is None else f"set {name} = {json.dumps(old)}"
            lines.append(f"{name} changed since the last start ({_said(old)} -> {_said(value)}): {advice} to "
                         f"resume it")
    return lines


def _said(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def load_on_one_process(state: dict, checkpoint: Path, advice: str = "name an earlier step-N folder") -> None:
    """``dcp.load`` of ``state`` (the whole model, or any subset of the checkpoint's tensors) by one process
    without a process group, as the tools read a run's checkpoint; a truncated or missing shard or a bad
    pickle is one line naming the folder, followed by ``advice``; a file that would run code is refused
    (``UnsafeCheckpointFile``, naming it)."""
    try:
        files = read_manifest(checkpoint)
        damage = first_damage(checkpoint, files) if files is not None else None
    except ManifestUnreadable as e:
        damage = str(e)
    if damage is not None:
        raise ConfigError(f"{checkpoint}: damaged checkpoint ({damage}); {advice}")
    with warnings.catch_warnings():  # one process reading every rank's shards is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            safe_load(state, checkpoint)
        except UnsafeCheckpointFile:
            raise
        except (Exception, CheckpointException) as e:
            if (stop := interrupt_in(e)) is not None:
                raise stop from None
            raise ConfigError(f"{checkpoint}: cannot read this checkpoint ({unreadable_reason(e)}); {advice}") from e


def unreadable_reason(e: BaseException) -> str:
    """One line on why ``dcp.load`` failed (its CheckpointException is a BaseException with a long text: the
    first rank's own exception is said instead)."""
    if isinstance(e, CheckpointException) and e.failures:
        failure = next(iter(e.failures.values()))
        e = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


class CheckpointManager:
    """``states`` go through DCP; ``residuals`` (when given: ``residual_state`` / ``load_residual_state``) are
    saved per rank under the fingerprint ``layout`` (the parallel layout) and restored only under an equal one.
    ``job``: the whole job config, compared with the previous start's to name what changed when a checkpoint
    does not fit (default: the ``train_state``'s ``cfg``, when it has one)."""

    def __init__(self, cfg: CheckpointSection, dump_folder: str, states: dict[str, Any],
                 residuals: Any = None, layout: str = "",
                 log: Callable[[str], None] = print, job: Any = None):
        self.cfg = cfg
        self.dump = Path(dump_folder)
        self.folder = self.dump / cfg.folder
        self.job = job if job is not None else getattr(states.get("train_state"), "cfg", None)
        self.checked: dict[int, str] = {}  # step -> how its integrity is known ("verified", "unverified", "saved")
        self.states = states
        self.rank = dist.get_rank()
        self.residuals = residuals
        self.fingerprint = {"world_size": dist.get_world_size(), "rank": self.rank, "layout": layout}
        self.log = log
        self.log_once = log if self.rank == 0 else lambda line: None  # what holds for every rank: rank 0 says it
        self.pending: tuple[Future, Path, Path] | None = None
        # host-side collectives off the training PG
        self.async_group = dist.new_group(backend="gloo") if cfg.enabled and cfg.async_mode == "async" else None
        if cfg.enabled and self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    def load(self) -> int:
        """Load the latest complete checkpoint (or ``load_step``); returns its step, 0 when none."""
        if not self.cfg.enabled:
            return 0
        steps = published_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise CheckpointUnreadable(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                    f"{self.folder}/step-{self.cfg.load_step} (found: {complete_steps(self.folder) or 'none'})")
            steps = [self.cfg.load_step]
        failed: list[str] = []
        model_shapes = self._model_shapes() if steps else {}
        for step in reversed(steps):
            path = self.folder / f"step-{step}"
            why = self._try_load(path, model_shapes)
            if why is None:
                self.checked[step] = self._verified_as
                if failed:
                    self.log_once(f"resuming from {path} instead (skipped unreadable: {', '.join(failed)})")
                if self.residuals is not None:
                    self._load_residuals(path)
                if self.rank == 0:
                    self._set_aside_newer(step)
                return step
            failed.append(path.name)
            self.log_once(f"checkpoint {path} is unreadable ({why}); skipping it")
        if not failed:
            return 0
        if self.cfg.load_step >= 0:
            raise CheckpointUnreadable(f"checkpoint.load_step = {self.cfg.load_step}: {self.folder}/step-"
                                       f"{self.cfg.load_step} is unreadable")
        if not self.cfg.allow_fresh_start:
            raise CheckpointUnreadable(
                f"{self.folder}: every checkpoint is unreadable ({', '.join(failed)}); not starting over "
                f"from step 0 (set checkpoint.allow_fresh_start = true to do so, or checkpoint.folder)")
        self.log_once(f"every checkpoint in {self.folder} is unreadable; starting from step 0 "
                      f"(checkpoint.allow_fresh_start = true)")
        return 0

    def _model_shapes(self) -> dict[str, tuple]:
        """Every parameter of the model (all ranks' pipeline stages): name -> global shape."""
        model = self.states.get("model")
        mine = {} if model is None else {k: tuple(v.shape) for k, v in model.state_dict().items()
                                         if isinstance(v, torch.Tensor)}
        every: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return {k: v for d in every for k, v in (d or {}).items()}

    def _saved_shapes(self, path: Path) -> dict[str, tuple]:
        meta = checkpoint_metadata(path)
        return {k.removeprefix("model."): tuple(v.size) for k, v in meta.items()
                if k.startswith("model.") and hasattr(v, "size")}

    def _verify(self, path: Path) -> str | None:
        """Check ``path`` against its checksums (each rank a share of the files); the first damage found by
        any rank, the same on every rank. Sets ``_verified_as``; a folder without checksums is said once."""
        why, files = None, None
        if not (path / ".metadata").is_file():
            why = "its .metadata file is missing"
        else:
            try:
                files = read_manifest(path)
                if files is not None:
                    why = first_damage(path, files, self.rank, dist.get_world_size())
            except ManifestUnreadable as e:
                why = str(e)
        reasons: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, why)
        why = next((w for w in reasons if w is not None), None)
        self._verified_as = "verified" if files is not None else "unverified"
        if why is None and files is None:
            self.log_once(f"checkpoint {path} has no checksums (saved before they were written): loading it "
                          f"unverified")
        return why

    def _try_load(self, path: Path, model_shapes: dict[str, tuple] | None = None) -> str | None:
        """Load ``path`` into the states after checking its checksums; the reason (the same on every rank)
        when it is damaged or any rank could not load it. A checkpoint whose parameters are not the model's,
        or that is intact but does not load into this job's states, stops the job (``CheckpointMismatch``)
        naming the keys changed since the last start. An interrupt is re-raised, never taken for damage."""
        why = self._verify(path)
        if why is not None:
            return why
        failed = mismatch = refused = None
        try:
            if model_shapes:
                advice = "; ".join(config_changes(self.dump, self.job, ("model.", "float8.")))
                mismatch = model_mismatch(self._saved_shapes(path), model_shapes,
                                          *([advice] if advice else []))
            if mismatch is None:
                safe_load(self.states, path)
        except UnsafeCheckpointFile as e:  # not damage: a folder to refuse, not to skip for an older step
            refused = str(e)
        except (Exception, CheckpointException) as e:  # damage the checksums cannot see, or another job's state
            if (stop := interrupt_in(e)) is not None:
                raise stop from None
            failed = unreadable_reason(e)
        reasons: list[tuple | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, (failed, mismatch, refused))
        refused = next((r for _, _, r in reasons if r is not None), None)
        if refused is not None:
            raise UnsafeCheckpointFile(refused)
        mismatch = next((m for _, m, _ in reasons if m is not None), None)
        if mismatch is not None:
            raise CheckpointMismatch(f"{path}: {mismatch}")
        failed = next((w for w, _, _ in reasons if w is not None), None)
        changes = config_changes(self.dump, self.job) if failed is not None else []
        if changes:
            intact = " is intact (checksums verified) but" if self._verified_as == "verified" else ""
            raise CheckpointMismatch(f"{path}{intact} does not fit this job ({failed}): {'; '.join(changes)} "
                                     f"(or choose another job.dump_folder)")
        return failed

    def _set_aside_newer(self, loaded: int) -> None:
        """Resuming an older step is a branch: checkpoints past it move to ``abandoned-<UTC time>/``."""
        step = {d: int(m[1]) for d in self.folder.iterdir() if (m := STEP_DIR.match(d.name.removesuffix(".tmp")))}
        newer = sorted((d for d in step if step[d] > loaded), key=step.get)
        if not newer:
            return
        dest = unique(self.folder / f"abandoned-{utc_stamp()}")
        dest.mkdir()
        for d in newer:
            d.rename(dest / d.name)
        self.log(f"resumed from step-{loaded}, older than the newest checkpoint: moved "
                 f"{', '.join(d.name for d in newer)} aside to {dest} (not deleted)")

    def _load_residuals(self, checkpoint: Path) -> None:
        """Restore this rank's residuals if every rank can under the same layout; else all restart at zero."""
        path = checkpoint / RESIDUALS_DIR / f"rank-{self.rank}.pt"
        saved, reason = None, None
        if not path.parent.is_dir():
            reason = "the checkpoint has none"
        elif not path.is_file():
            reason = f"the checkpoint has none for rank {self.rank} (layout changed)"
        else:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved["fingerprint"] != self.fingerprint:
                reason = (f"layout changed (saved: {saved['fingerprint']['layout']}; "
                          f"now: {self.fingerprint['layout']})")
        reasons: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, reason)
        reason = next((r for r in reasons if r is not None), None)
        if reason is None:
            self.residuals.load_residual_state(saved["residuals"])
        self.log_once(f"error-feedback residuals restored from {path.parent}" if reason is None else
                      f"error-feedback residuals restart from zero: {reason}")

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int, wait: bool = False) -> None:
        self.finish_pending()
        tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
        try:
            self._save_residuals(tmp)  # synchronously, so an async save holds this step's residuals too
            if self.async_group is not None and not wait:
                future = dcp.async_save(self.states, checkpoint_id=str(tmp), process_group=self.async_group)
                self.pending = (future, tmp, final)
                return
            dcp.save(self.states, checkpoint_id=str(tmp))
            self._publish(tmp, final)
        except (Exception, CheckpointException) as e:
            raise self._save_failed(e, tmp, final) from None
        except BaseException:  # an interrupt raised outside DCP: the partial folder goes, the interrupt stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _save_failed(self, e: BaseException, tmp: Path, final: Path) -> BaseException:
        """An OS error: the partial folder removed, the error as one line; an interrupt: the partial folder
        removed, the interrupt itself; anything else as it is."""
        if (stop := interrupt_in(e)) is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return stop
        err = _os_error(e) or _no_space(tmp)
        if err is None:
            return e
        shutil.rmtree(tmp, ignore_errors=True)
        previous = complete_steps(self.folder)
        kept = f"the previous checkpoint {self.folder}/step-{previous[-1]} is intact" if previous else \
            "no earlier checkpoint"
        return CheckpointWriteFailed(f"saving checkpoint {final} failed: {os_error_text(err)} at "
                                     f"{err.filename or tmp}; removed the partial {tmp.name}; {kept}")

    def _save_residuals(self, tmp: Path) -> None:
        if self.residuals is None:
            return
        state = {"fingerprint": self.fingerprint, "residuals": self.residuals.residual_state()}  # CPU copies
        (tmp / RESIDUALS_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp / RESIDUALS_DIR / f"rank-{self.rank}.pt")

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        (future, tmp, final), self.pending = self.pending, None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            raise self._save_failed(e, tmp, final) from None
        self._publish(tmp, final)

    def integrity_note(self) -> str:
        """What is known of the newest checkpoint's integrity, for a stop that keeps it (one clause, never
        claiming more than was checked)."""
        steps = complete_steps(self.folder) if self.cfg.enabled else []
        if not steps:
            return "no checkpoint has been saved"
        path, how = self.folder / f"step-{steps[-1]}", self.checked.get(steps[-1])
        return {"verified": f"the latest checkpoint {path} matched its checksums when this job loaded it",
                "saved": f"the latest checkpoint {path} was written by this job with checksums, which a resume "
                         f"verifies",
                "unverified": f"the latest checkpoint {path} has no checksums and was loaded unverified"}.get(
            how, f"the latest checkpoint {path} was not checked by this job; a resume verifies its checksums")

    def finish_or_abandon(self, timeout_s: float = 600.0) -> None:
        """On any exit path: wait for a pending async save (no collective, so a rank-local failure cannot
        hang here); rank 0 publishes it if DCP wrote its metadata (every rank's data is then on disk), else
        removes the partial folder."""
        if self.pending is None:
            return
        (future, tmp, final), self.pending = self.pending, None
        try:
            future.result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001  the save itself failed or is stuck: abandon it below
            self.log(f"pending checkpoint save {final.name} failed ({type(e).__name__}: {e})")
        if self.rank != 0:
            return
        if (tmp / ".metadata").is_file():
            try:  # every rank's files are on disk: rank 0 sums them all
                write_manifest(tmp, checksum(tmp, [n for r in range(dist.get_world_size())
                                                   for n in files_written_by(tmp, r)]))
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                self.log(f"pending checkpoint save {final.name} abandoned on exit: writing its checksums failed "
                         f"({os_error_text(e)} at {e.filename or tmp}; removed)")
                return
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self.checked[int(final.name.removeprefix("step-"))] = "saved"
            self.log(f"pending checkpoint save finished on exit: {final}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"pending checkpoint save {final.name} abandoned on exit (incomplete, removed)")

    def _publish(self, tmp: Path, final: Path) -> None:
        """Each rank sums the files it wrote; rank 0 writes the manifest and renames the folder (after every
        rank's files are written: the gather waits for all of them). An OS error on any rank is the save's."""
        def as_args(e: OSError) -> tuple:  # an OSError as picklable arguments, to rebuild it on every rank
            return e.errno, e.strerror or str(e), str(e.filename or tmp)

        try:
            mine: dict | tuple = checksum(tmp, files_written_by(tmp, self.rank))
        except OSError as e:
            mine = as_args(e)
        every: list[dict | tuple | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        failed = next((x for x in every if isinstance(x, tuple)), None)
        if failed is None and self.rank == 0:
            try:
                write_manifest(tmp, {k: v for d in every for k, v in d.items()})
            except OSError as e:
                failed = as_args(e)
        if dist.get_world_size() > 1:
            said = [failed]
            dist.broadcast_object_list(said, src=0)
            failed = failed or said[0]
        if failed is not None:
            raise self._save_failed(OSError(*failed), tmp, final) from None
        self.checked[int(final.name.removeprefix("step-"))] = "saved"
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            # Retention counts this run's saves: checkpoints newer than the resumed one were moved aside
            # (``_set_aside_newer``), so ascending step order is the order of the saves.
            if self.cfg.keep_latest_k > 0:
                for old in complete_steps(self.folder)[: -self.cfg.keep_latest_k]:
                    shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        dist.barrier()
