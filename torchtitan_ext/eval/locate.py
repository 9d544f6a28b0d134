"""Which run and checkpoint a tool reads, found from the folder names alone: no torch import, so a tool says
that a folder holds no checkpoint before it spends seconds importing what would load one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torchtitan_ext.checkpoint.run_folder import complete_steps
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError


def find_checkpoint(path: str | Path, cfg: JobConfig | None = None) -> tuple[Path, Path]:
    """(dump folder, checkpoint folder) for a dump folder (latest or ``checkpoint.load_step``), its
    ``checkpoint/`` folder, or one ``step-N`` folder."""
    p = Path(path).expanduser()
    if (p / ".metadata").is_file():
        return p.parent.parent, p
    sub = p / (cfg.checkpoint.folder if cfg is not None else "checkpoint")
    dump, folder = (p, sub) if sub.is_dir() else (p.parent, p)
    steps = complete_steps(folder)
    want = cfg.checkpoint.load_step if cfg is not None else -1
    if want >= 0 and want not in steps:
        raise ConfigError(f"checkpoint.load_step = {want}: no complete checkpoint {folder}/step-{want} "
                          f"(found: {steps or 'none'})")
    if not steps:
        why = "" if p.is_dir() else "no such folder; "
        raise ConfigError(f"{p}: no complete checkpoint found there ({why}expected a dump folder with "
                          "checkpoint/step-N/)")
    return dump, folder / f"step-{want if want >= 0 else steps[-1]}"


def config_dump_folder(config: str | Path | None, cfg: JobConfig,
                       overrides: Sequence[str] = ()) -> tuple[Path, str | None]:
    """(dump folder, note or None) of a job read from ``--config config`` (the tools that read a trained run:
    eval, distill.teacher, quant.export): a run's own ``config.toml`` (a file beside ``config.toml`` and
    ``<checkpoint.folder>/``) is read where it is, with a note when its recorded ``job.dump_folder`` (relative to
    where the job ran) is another folder: a copied or moved dump folder, or a command run from elsewhere. Any
    other config, or a ``--job.dump_folder`` among the command line's ``overrides``, names the folder with
    ``job.dump_folder``."""
    recorded = Path(cfg.job.dump_folder).expanduser()
    if config is None or any(a == "--job.dump_folder" or a.startswith("--job.dump_folder=") for a in overrides):
        return recorded, None
    here = Path(config).expanduser().parent
    if not ((here / "config.toml").is_file() and (here / cfg.checkpoint.folder).is_dir()):
        return recorded, None
    if recorded.exists() and recorded.resolve() == here.resolve():
        return recorded, None
    where = "another folder" if recorded.exists() else "not a folder here"
    return here, f"the config file's folder; its job.dump_folder = '{cfg.job.dump_folder}' is {where}"
