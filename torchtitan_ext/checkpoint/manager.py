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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan_ext.config.job_config import CheckpointSection

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
        steps = complete_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise FileNotFoundError(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                    f"{self.folder}/step-{self.cfg.load_step} (found: {steps or 'none'})")
            step = self.cfg.load_step
        elif not steps:
            return 0
        else:
            step = steps[-1]
        dcp.load(self.states, checkpoint_id=str(self.folder / f"step-{step}"))
        if self.residuals is not None:
            self._load_residuals(self.folder / f"step-{step}")
        return step

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
