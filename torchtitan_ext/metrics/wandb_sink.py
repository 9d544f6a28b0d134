"""``[metrics] wandb = true``: every logged step's values (what TensorBoard gets) to a Weights & Biases run,
from rank 0, with the resolved job config as the run's config.

The run id is made on a job's first start and saved in ``<dump_folder>/wandb_run_id``; a job resumed in the
same dump folder passes it back (``resume="allow"``) and so continues the same run. The run's files go under
``<dump_folder>/wandb``; with ``WANDB_MODE=offline`` they stay there (no network), for ``wandb sync`` later.

W&B keeps a run's history in step order: in online mode the steps a resumed job redoes after its checkpoint
(already in the run's history) are dropped by W&B with a warning, where metrics.jsonl and TensorBoard take the
new values.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError

RUN_ID_FILE = "wandb_run_id"
EXTRA = "tracking"  # pyproject.toml's optional-dependencies extra that holds the wandb pin


class MetricsSink(Protocol):
    """What ``MetricsLogger`` feeds beside TensorBoard and metrics.jsonl (rank 0 only)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def import_wandb():
    """The wandb module, or one ``ConfigError`` line naming the extra to install."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"metrics.wandb = true needs the wandb package: pip install -e '.[{EXTRA}]'"
                          ) from None
    return wandb


def check_mode(wandb) -> None:
    """``WANDB_MODE``, when set, is one W&B knows; else one ``ConfigError`` line naming it (``wandb.init`` raises
    a many-line pydantic error, and on rank 0 only)."""
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        return
    try:
        wandb.Settings(mode=mode)
    except ValueError:  # pydantic's ValidationError
        raise ConfigError(f"metrics.wandb: environment variable WANDB_MODE={mode!r}: expected online, offline or "
                          "disabled") from None


def run_id(dump_folder: str | Path) -> str:
    """The id saved in ``<dump_folder>/wandb_run_id`` (an existing folder), else a new one, saved there."""
    path = Path(dump_folder) / RUN_ID_FILE
    if path.is_file() and (saved := path.read_text().strip()):
        return saved
    new = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


class WandbSink:
    """One W&B run: ``log(step, values)`` per logged step, ``close()`` finishes the run."""

    def __init__(self, dump_folder: str, project: str, name: str, tags: Sequence[str], config: dict[str, Any]):
        wandb = import_wandb()
        folder = Path(dump_folder).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self.id = run_id(folder)
        # console="off": the trainer's own output already goes to dump_folder/logs (metrics.logger.rank_log)
        # and W&B's stdout redirection would wrap that tee.
        try:
            self.run = wandb.init(project=project, name=name or folder.name, tags=list(tags), config=config,
                                  id=self.id, resume="allow", dir=str(folder),
                                  settings=wandb.Settings(console="off"))
        except wandb.errors.Error as e:  # no API key, no network, a bad project: the user's to fix
            message = " ".join(str(e).split())
            raise ConfigError(f"metrics.wandb: wandb.init failed: {message} (WANDB_MODE=offline logs without "
                              f"an account or network)") from None

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def check_tracking(cfg: JobConfig) -> None:
    """What ``tracking_sinks`` will need, checked before a job touches its folder: with ``metrics.wandb``, the
    wandb package and a known ``WANDB_MODE`` (one ``ConfigError`` line each)."""
    if cfg.metrics.wandb:
        check_mode(import_wandb())


def tracking_sinks(cfg: JobConfig, rank: int) -> list[MetricsSink]:
    """The sinks ``[metrics]`` asks for: on rank 0 a ``WandbSink`` when ``metrics.wandb``; a missing wandb
    package fails on every rank (one ``ConfigError`` line), so that no rank waits for one that stopped."""
    m = cfg.metrics
    if not m.wandb:
        return []
    check_tracking(cfg)  # on every rank
    if rank != 0:
        return []
    return [WandbSink(cfg.job.dump_folder, m.wandb_project, m.wandb_run_name, m.wandb_tags, dataclasses.asdict(cfg))]
