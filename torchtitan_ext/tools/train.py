"""``python -m torchtitan_ext.train --config FILE [--section.key value ...]``; without any argument, the
README's default job (``train_configs/debug.toml``, as ``launch/train.sh`` runs it).

User mistakes (config, layout, data files) end with one ``error:`` line and exit code 2; a diverged
run (NaN loss, or gradients non-finite for training.max_skipped_steps steps in a row) ends with exit
code 3; a preempted run (SIGTERM / SIGUSR1) saves and ends with 0 (during start-up or resume: without writing
anything); a resumed job with no step left to train ends with 0 and one line; a CUDA out-of-memory error ends with
exit code 4 and one line (where, the peaks, what would fit: ``train.out_of_memory``); anything else is a bug and
keeps its traceback (``torchtitan_ext.cli.run_tool``).

Rank 0 logs to the console; every rank's output (log messages, warnings, a traceback) also goes to
``<dump_folder>/logs/rank-<rank>.log``: rank 0's console through ``metrics.logger.rank_log``, the other
ranks' log messages through their logging handler, their stdout and stderr through ``rank_log``.

Before anything is written, the job claims the dump folder (``checkpoint.run_folder.claim``: probe, lock, no
other run's files); the run leaves without interpreter teardown (``cli.exit_now`` says why).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torchtitan_ext.cli import UsageError, run_tool, setup_logging
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.config.loader import help_text, parse_args

log = logging.getLogger("torchtitan_ext.train")

# No arguments at all: the README's default job, the one ``launch/train.sh`` runs without arguments.
DEFAULT_JOB = Path(__file__).resolve().parents[2] / "train_configs" / "debug.toml"


def default_job(argv: list[str]) -> list[str]:
    """``argv``, or for no arguments at all ``--config`` and the default job's file (one line when this
    installation has no ``train_configs/``)."""
    if argv:
        return argv
    if not DEFAULT_JOB.is_file():
        raise UsageError(f"no --config: give the job's TOML file (--config FILE; the default job "
                         f"{DEFAULT_JOB} is not in this installation); --help lists every key")
    log.info(f"no arguments: the default job, --config {DEFAULT_JOB}")
    return ["--config", str(DEFAULT_JOB)]


def _train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    cfg = parse_args(default_job(argv))
    from torchtitan_ext.train.preemption import handlers_restored

    with handlers_restored():
        return _run(cfg)


def _run(cfg: JobConfig) -> int:
    import torch
    import torch.distributed as dist

    from torchtitan_ext.checkpoint.run_folder import NothingToTrain, claim
    from torchtitan_ext.data.registry import describe_data
    from torchtitan_ext.metrics.logger import rank_log
    from torchtitan_ext.metrics.wandb_sink import check_tracking
    from torchtitan_ext.plan.out_of_memory import out_of_memory
    from torchtitan_ext.train.preemption import StartupInterrupted, raise_on_signal
    from torchtitan_ext.train.trainer import Trainer

    rank = int(os.environ.get("RANK", 0))
    check_tracking(cfg)  # WANDB_MODE=bogus: one line before the folder is touched
    raise_on_signal()  # a signal before training begins: exit 0, nothing written
    notes: list[str] = []
    try:
        lock = claim(cfg, rank, notes.append)  # before anything is written in the folder
        try:
            setup_logging(rank, Path(cfg.job.dump_folder) / "logs" / f"rank-{rank}.log")
            with rank_log(cfg.job.dump_folder, rank):
                described = [f"job: {cfg.job.description}"] if cfg.job.description else []
                for note in [*described, describe_data(cfg.data), *notes]:
                    log.info(note)
                trainer = None
                try:
                    trainer = Trainer(cfg)
                    trainer.train()
                except NothingToTrain as e:
                    log.info(str(e))
                    return 0
                except torch.OutOfMemoryError as e:
                    raise out_of_memory(e, cfg, None if trainer is None else trainer.step,
                                        dist.get_world_size() if dist.is_initialized() else 1) from None
            if dist.is_initialized():
                dist.barrier()  # gloo may abort at exit after FSDP2 work without it
        finally:
            if lock is not None:
                lock.release()
    except StartupInterrupted as e:  # a stop request (exit 0) or a second Ctrl-C (130), at any point
        log.info(str(e))
        return e.exit_code
    return 0


def main(argv: list[str] | None = None) -> int:
    """Train; the exit code (the process group is destroyed either way)."""
    return run_tool(_train, argv)
