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
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

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

from torchtitan_ext.config.job_config import CheckpointSection
from torchtitan_ext.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")
RESIDUALS_DIR = "squinch_residuals"


class RankLocalResiduals(Protocol):
    """What the manager saves per rank (``GradientCompression``'s error-feedback residuals)."""

    def residual_state(self) -> dict[str, torch.Tensor]: ...

    def load_residual_state(self, residuals: dict[str, torch.Tensor]) -> None: ...


class ModelParts:
    """The model (or this rank's pipeline stages) as one Stateful keyed by FQN."""

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        sd: dict = {}
        for m in self.parts:
            sd.update(get_model_state_dict(m))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for m in self.parts:
            set_model_state_dict(m, sd, options=StateDictOptions(strict=False))


class CheckpointUnreadable(UserError):
    """Checkpoints exist but none can be loaded (or the one ``load_step`` names cannot)."""


def unreadable_reason(e: BaseException) -> str:
    """One line on why ``dcp.load`` failed (its CheckpointException is a BaseException with a long text)."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def published_steps(folder: Path) -> list[int]:
    """Steps with a ``step-N/`` folder (complete or damaged), ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for d in folder.iterdir() if (m := _STEP_DIR.match(d.name)))


def complete_steps(folder: Path) -> list[int]:
    """Steps with a finished checkpoint in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    steps = []
    for d in folder.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


class CheckpointManager:
    """``states`` go through DCP; ``residuals`` (when given) are saved per rank under the fingerprint
    ``layout`` (a description of the parallel layout) and restored only under an equal one."""

    def __init__(self, cfg: CheckpointSection, dump_folder: str, states: dict[str, Any],
                 residuals: RankLocalResiduals | None = None, layout: str = "",
                 log: Callable[[str], None] = print):
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.states = states
        self.rank = dist.get_rank()
        self.residuals = residuals
        self.fingerprint = {"world_size": dist.get_world_size(), "rank": self.rank, "layout": layout}
        self.log = log
        self.pending: tuple[Future, Path, Path] | None = None
        self.async_group = None
        if cfg.enabled and cfg.async_mode == "async":
            self.async_group = dist.new_group(backend="gloo")  # host-side collectives off the training PG
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
                raise FileNotFoundError(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                    f"{self.folder}/step-{self.cfg.load_step} (found: {complete_steps(self.folder) or 'none'})")
            steps = [self.cfg.load_step]
        failed: list[str] = []
        for step in reversed(steps):
            path = self.folder / f"step-{step}"
            why = self._try_load(path)
            if why is None:
                if failed and self.rank == 0:
                    self.log(f"resuming from {path} instead (skipped unreadable: {', '.join(failed)})")
                if self.residuals is not None:
                    self._load_residuals(path)
                return step
            failed.append(path.name)
            if self.rank == 0:
                self.log(f"checkpoint {path} is unreadable ({why}); skipping it")
        if not failed:
            return 0
        if self.cfg.load_step >= 0:
            raise CheckpointUnreadable(f"checkpoint.load_step = {self.cfg.load_step}: {self.folder}/step-"
                                       f"{self.cfg.load_step} is unreadable")
        if not self.cfg.allow_fresh_start:
            raise CheckpointUnreadable(
                f"{self.folder}: every checkpoint is unreadable ({', '.join(failed)}); not starting over "
                f"from step 0 (set checkpoint.allow_fresh_start = true to do so, or checkpoint.folder)")
        if self.rank == 0:
            self.log(f"every checkpoint in {self.folder} is unreadable; starting from step 0 "
                     f"(checkpoint.allow_fresh_start = true)")
        return 0

    def _try_load(self, path: Path) -> str | None:
        """Load ``path`` into the states; the reason (the same on every rank) when any rank could not."""
        why = None
        if not (path / ".metadata").is_file():
            why = "its .metadata file is missing"
        else:
            try:
                dcp.load(self.states, checkpoint_id=str(path))
            except (Exception, CheckpointException) as e:  # any damage (missing/truncated shard, bad pickle)
                why = unreadable_reason(e)
        reasons: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, why)
        return next((r for r in reasons if r is not None), None)

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
        if self.rank == 0:
            self.log(f"error-feedback residuals restored from {path.parent}" if reason is None else
                     f"error-feedback residuals restart from zero: {reason}")

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int, wait: bool = False) -> None:
        self.finish_pending()
        tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
        self._save_residuals(tmp)  # synchronously, so an async save holds this step's residuals too
        if self.async_group is not None and not wait:
            future = dcp.async_save(self.states, checkpoint_id=str(tmp), process_group=self.async_group)
            self.pending = (future, tmp, final)
            return
        dcp.save(self.states, checkpoint_id=str(tmp))
        self._publish(tmp, final)

    def _save_residuals(self, tmp: Path) -> None:
        if self.residuals is None:
            return
        state = {"fingerprint": self.fingerprint, "residuals": self.residuals.residual_state()}  # CPU copies
        (tmp / RESIDUALS_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp / RESIDUALS_DIR / f"rank-{self.rank}.pt")

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, final = self.pending
        future.result()
        self.pending = None
        self._publish(tmp, final)

    def finish_or_abandon(self, timeout_s: float = 600.0) -> None:
        """On any exit path: wait for a pending async save (no collective, so a rank-local failure cannot
        hang here); rank 0 publishes it if DCP wrote its metadata (every rank's data is then on disk), else
        removes the partial folder."""
        if self.pending is None:
            return
        future, tmp, final = self.pending
        self.pending = None
        try:
            future.result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001  the save itself failed or is stuck: abandon it below
            self.log(f"pending checkpoint save {final.name} failed ({type(e).__name__}: {e})")
        if self.rank != 0:
            return
        if (tmp / ".metadata").is_file():
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self.log(f"pending checkpoint save finished on exit: {final}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"pending checkpoint save {final.name} abandoned on exit (incomplete, removed)")

    def _publish(self, tmp: Path, final: Path) -> None:
        dist.barrier()  # every rank's shard files are written before the folder becomes visible
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            if self.cfg.keep_latest_k > 0:
                for old in complete_steps(self.folder)[: -self.cfg.keep_latest_k]:
                    shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        dist.barrier()
