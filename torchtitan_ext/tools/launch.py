"""``python -m torchtitan_ext.launch [torchrun options --] [trainer arguments]``: torchrun for the trainer
(``launch/train.sh`` runs it), answering like ``python -m torchtitan_ext.train`` does.

* Before any worker starts, the config, the overrides and the dump folder are checked in this process, with
  the trainer's own loader and folder claim (probe; lock and another run's files when this machine runs the
  whole job) and without importing torch: a mistake is one ``error:`` line and exit code 2 within a second,
  not one line per worker and restart.
* Restarts (torchrun's ``--max_restarts``) are for crashes. A worker that refused its job (a user error, exit
  code 2), stopped it to protect its checkpoints (3), ran out of device memory (4) or was interrupted twice
  (130) would do the same again:
  the job ends at once. torchrun has no option for this; the agent below zeroes its remaining restarts when
  it sees such a failure, as torch's own agent does for a worker stuck in uninterruptible sleep.
* The job's exit code is the failed worker's (``128 + N`` for a worker killed by signal ``N``), not torchrun's
  1 and its ``ChildFailedError`` traceback; a crash adds one line naming the rank and its log file.
* SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 to this process go to every worker (torchrun starts each in its own
  session, so a terminal's Ctrl-C reaches only this process): the workers finish the step, save and exit 0,
  and so does the job. torchrun's agent would instead stop the workers itself, SIGKILL those still saving
  after its shutdown timeout, and end with a ``SignalException`` traceback and exit code 1. A stop request
  also ends the restarts. A second Ctrl-C is forwarded too: the workers stop at once (exit code 130).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from torchtitan_ext.cli import refusal, sigint_raises
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import (
    EXIT_INTERRUPTED,
    EXIT_OUT_OF_MEMORY,
    EXIT_STOPPED,
    EXIT_USER,
    RunStopped,
    UserError,
)

TRAINER = "torchtitan_ext.train"
# A worker's exit codes that a restart would only repeat.
FINAL_EXIT_CODES = frozenset({EXIT_USER, EXIT_STOPPED, EXIT_OUT_OF_MEMORY, EXIT_INTERRUPTED})
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

USAGE = f"""usage: python -m torchtitan_ext.launch [torchrun options --] [trainer arguments]

{__doc__.split(':', 1)[1].strip()}

torchrun options: python -m torch.distributed.run --help (default: --standalone; --nproc_per_node: every
GPU, or 2 CPU processes without CUDA).
Trainer arguments: --config FILE [--section.key value ...]; python -m torchtitan_ext.train --help."""


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the trainer's arguments): the two sides of the first ``--``; without one, every
    argument is the trainer's."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return [], argv


def single_node(torchrun_argv: list[str]) -> bool:
    """torchrun's options start every process of the job on this machine (``--standalone``, or ``--nnodes 1``,
    torchrun's default)."""
    if "--standalone" in torchrun_argv:
        return True
    for i, arg in enumerate(torchrun_argv):
        name, eq, value = arg.partition("=")
        if name == "--nnodes":
            value = value if eq else (torchrun_argv[i + 1] if i + 1 < len(torchrun_argv) else "")
            return value in ("1", "1:1")
    return True


def preflight(trainer_argv: list[str], whole_job: bool) -> JobConfig:
    """What the trainer checks before it writes anything, done once here: the config and its overrides, the
    float8 keys against each other, the tracking mode, the dump folder and the cache (writable) and, when this
    machine runs the ``whole_job``, the folder's claim: not locked by a live run, no other run's files in the
    way of a start from step 0 (the lock is taken and let go at once; the workers take it again). On several
    machines the one whose worker becomes rank 0 claims the folder, and another node, starting later, would
    find that run's lock and files."""
    from torchtitan_ext.checkpoint.run_folder import RunLock, check_fresh_start, probe_writable
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.metrics.wandb_sink import check_tracking
    from torchtitan_ext.quant.float8_config import check_float8_config

    cfg = parse_args(trainer_argv)
    check_float8_config(cfg.float8, cfg.training.fused_linear_ce, cfg.parallelism.tp)
    check_tracking(cfg)
    probe_writable(cfg.job.dump_folder, "job.dump_folder")
    probe_writable(cfg.data.cache_dir, "data.cache_dir")
    if whole_job:
        RunLock.acquire(cfg.job.dump_folder, print).release()
        if not cfg.job.overwrite:  # job.overwrite moves the old files aside: the workers' rank 0 does that
            check_fresh_start(cfg, 0, print)
    return cfg


class _Workers:
    """The agent's current workers, and the stop signal forwarded to them: a worker started after the signal
    (a restart, or workers still starting when it came) is sent it as it appears."""

    def __init__(self) -> None:
        self.agent = None  # set by the agent when torchrun creates it
        self.stop: int | None = None
        self.reached: set[int] = set()

    def pids(self) -> list[int]:
        if self.agent is None:
            return []
        return [w.id for w in self.agent.get_worker_group().workers if w.id is not None]

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.stop = signum
        for pid in self.pids():
            self._send(pid, signum)

    def catch_up(self) -> None:
        if self.stop is not None:
            for pid in self.pids():
                if pid not in self.reached:
                    self._send(pid, self.stop)

    def _send(self, pid: int, signum: int) -> None:
        self.reached.add(pid)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it has just ended
            pass


def _agent_class(workers: _Workers, log: logging.Logger) -> type:
    """torchrun's local agent with the restart policy of the module docstring."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            workers.agent = self

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            workers.catch_up()
            if result.state == WorkerState.FAILED:
                codes = {f.exitcode for f in result.failures.values()}
                if workers.stop is not None or codes & FINAL_EXIT_CODES:
                    self._remaining_restarts = 0
                elif self._remaining_restarts > 0:
                    rank, failure = min(result.failures.items(), key=_root_cause_first)
                    most = worker_group.spec.max_restarts
                    log.info(f"worker rank {rank} failed ({_exit_text(failure.exitcode)}): restarting every worker "
                             f"from the latest checkpoint (restart {most - self._remaining_restarts + 1} of {most})")
            return result

    return Agent


def _root_cause_first(item: tuple[int, object]) -> tuple[bool, int, int]:
    """Sort key of (rank, failure): a worker killed by a signal before one that exited, then the earliest. A
    killed worker leaves no error file, so its timestamp is when the agent noticed, after its peers have
    exited on the broken connection (their error files' times, in whole seconds)."""
    rank, failure = item
    return failure.exitcode >= 0, failure.timestamp, rank


def _exit_text(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def with_process_count(torchrun_argv: list[str]) -> list[str]:
    """torchrun's options with ``--nproc_per_node`` when they lack it: every visible GPU, or 2 CPU processes
    (gloo) without CUDA. With CUDA, NVLink SHARP (NVLS) is off unless ``NCCL_NVLS_ENABLE`` says otherwise."""
    import torch

    if any(a.split("=")[0] in ("--nproc_per_node", "--nproc-per-node") for a in torchrun_argv):
        return torchrun_argv
    if torch.cuda.is_available():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        return [*torchrun_argv, "--nproc_per_node", str(torch.cuda.device_count())]
    return [*torchrun_argv, "--nproc_per_node", "2"]


def run_workers(torchrun_argv: list[str], trainer_argv: list[str], dump_folder: str) -> int:
    """torchrun with the project's agent; the job's exit code."""
    os.environ.setdefault("LOGLEVEL", "ERROR")  # torchelastic's own warnings (closing signals sent): noise here
    torchrun_argv = with_process_count(torchrun_argv)
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    log = logging.getLogger("torchtitan_ext.launch")
    workers = _Workers()
    launcher_api.LocalElasticAgent = _agent_class(workers, log)  # launch_agent builds the agent by this name
    args = torchrun.parse_args([*torchrun_argv, "-m", TRAINER, *trainer_argv])
    args.signals_to_handle = "SIGHUP,SIGQUIT"  # the stop signals are this process's (_Workers.handle)
    for sig in FORWARDED:
        signal.signal(sig, workers.handle)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = min(e.failures.items(), key=_root_cause_first)
        code = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
        if code not in FINAL_EXIT_CODES:  # a crash: the worker printed its traceback; say where and which
            print(f"error: worker rank {rank} on {failure.hostname} failed ({_exit_text(failure.exitcode)}); its "
                  f"output: {Path(dump_folder) / 'logs' / f'rank-{rank}.log'}", file=sys.stderr, flush=True)
        return code
    return 0


def main(argv: list[str] | None = None) -> int:
    """Check the job, then run its workers; the exit code. Ctrl-C during the check is one line and exit code
    130 however this process was started (``cli.sigint_raises``); then the signal is the workers'."""
    with sigint_raises():
        return _check_and_run(sys.argv[1:] if argv is None else argv)


def _check_and_run(argv: list[str]) -> int:
    from torchtitan_ext.cli import setup_logging
    from torchtitan_ext.config.loader import help_text
    from torchtitan_ext.tools.train import default_job

    torchrun_argv, trainer_argv = split_argv(argv)
    if argv in (["-h"], ["--help"]) or {"-h", "--help"} & set(torchrun_argv):
        print(USAGE)
        return 0
    if {"-h", "--help"} & set(trainer_argv):  # launch/train.sh --help: the trainer's keys
        print(help_text())
        return 0
    setup_logging(rank=0)
    try:
        trainer_argv = default_job(trainer_argv)
        cfg = preflight(trainer_argv, whole_job=single_node(torchrun_argv))
    except (UserError, OSError, argparse.ArgumentError, RunStopped) as e:
        line, code = refusal(e)
        print(line, file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT): stopped at once", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return run_workers(torchrun_argv or ["--standalone"], trainer_argv, cfg.job.dump_folder)
