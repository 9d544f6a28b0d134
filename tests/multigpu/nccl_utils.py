"""Run the real trainer on N GPUs (torchrun, NCCL) and read back its per-step metrics; the ``multigpu`` tier's
counterpart of ``tests/trainer_utils.py`` (which forces CPU).

* ``run_trainer(dump, nproc, *overrides, gpus=...)``: ``python -m torch.distributed.run --standalone
  --nproc_per_node nproc -m torchtitan_ext.train`` with ``JOB`` + overrides on the GPUs ``gpus``
  (``CUDA_VISIBLE_DEVICES``); ``start_trainer`` the same as a ``Popen`` (to signal a worker).
* ``JobPool``: many such runs at once. The tier's jobs are small and spend most of their time starting up and
  compiling, so a pool runs them side by side, several processes sharing each GPU (each job its own NCCL
  communicators), capped at ``MULTIGPU_MAX_PROCS`` processes (default 6 per GPU).
* ``assert_close_losses``: per-step losses and gradient norms against a reference run, with every
  comparison's largest difference appended to ``$MULTIGPU_REPORT`` (a JSON line each) when that is set.

NVLink multicast stays off in every child (``NCCL_NVLS_ENABLE=0`` and friends): on the lent machines a program
that uses it can take the host's GPUs out of service.

``TORCHTITAN_EXT_MULTIGPU_ON_CPU=N`` runs the tier's plumbing on CPU instead: N pretend devices, gloo
processes, ``--job.device cpu`` and no compile (conftest then does not skip the tier), e.g.
``TORCHTITAN_EXT_MULTIGPU_ON_CPU=4 pytest tests/multigpu -k 'tp2 or fsdp'``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TEST_CACHE = Path(os.environ.get("TORCHTITAN_EXT_TEST_CACHE", Path.home() / ".cache" / "torchtitan_ext_tests"))
ON_CPU = int(os.environ.get("TORCHTITAN_EXT_MULTIGPU_ON_CPU", "0") or 0)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def device_count() -> int:
    """GPUs the tier may use (the pretend count on CPU)."""
    if ON_CPU:
        return ON_CPU
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = device_count()


def needs_gpus(n: int):
    """A mark skipping a test (or one parameter) on a machine with fewer than ``n`` GPUs."""
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, found {GPUS}")


# A tiny job that still gives the GPU real matrices: 8 blocks of width 512 (8 heads, 4 K/V heads, so TP 4
# divides them), sequences of 256 bytes, 8 sequences per step (every data-parallel degree up to 8 divides it).
# Deterministic kernels, so a layout's difference from one GPU is the layout's, not run-to-run noise. Float32
# parameters and compute: in bf16 (FSDP mixed precision against autocast on one GPU) the first step agreed within
# 1.3e-4 (loss) and 2.2e-4 (gradient norm) on 4 H100s, but the 20-step trajectories drifted apart by up to 46% at
# single steps (2026-11-27), which no bound can tell from a real fault; in float32 a layout differs only by its
# reduction order.
GLOBAL_BATCH = 8
JOB = [
    "--model.flavor", "debug", "--model.dim", "512", "--model.n_layers", "8", "--model.n_heads", "8",
    "--model.n_kv_heads", "4", "--model.ffn_hidden", "1536",
    "--data.tokenizer", "byte", "--data.cache_dir", str(TEST_CACHE),
    "--training.seq_len", "256", "--training.local_batch_size", str(GLOBAL_BATCH), "--training.steps", "20",
    "--training.deterministic", "true", "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1", "--metrics.tensorboard", "false", "--checkpoint.enabled", "false",
    "--eval.steps", "0", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
]
if ON_CPU:  # the plumbing check: a narrower model on shorter sequences, so gloo on a few cores keeps up
    JOB += ["--model.dim", "64", "--model.ffn_hidden", "192", "--training.seq_len", "64"]
# torch.compile on the GPU; on CPU (the plumbing check) it would only cost minutes.
COMPILE = [] if ON_CPU else ["--training.compile", "true"]


def gpu_list(n: int, first: int = 0) -> list[int]:
    """``n`` GPU indices starting at ``first``, wrapping around the machine's GPUs."""
    return [(first + i) % max(GPUS, 1) for i in range(n)]


def trainer_env(gpus: list[int] | None) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")  # many jobs compile at once
    env["CUDA_VISIBLE_DEVICES"] = "" if ON_CPU else ",".join(map(str, gpus or [0]))
    return env


def trainer_command(dump: Path, nproc: int, *overrides: str, max_restarts: int = 0) -> list[str]:
    device = ["--job.device", "cpu"] if ON_CPU else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max_restarts", str(max_restarts), "-m", "torchtitan_ext.train",
            *JOB, *device, "--job.dump_folder", str(dump), *overrides]


def start_trainer(dump: Path, nproc: int, *overrides: str, gpus: list[int] | None = None,
                  max_restarts: int = 0) -> subprocess.Popen:
    """The torchrun agent as a ``Popen`` (its children are the workers); output in ``dump``.log."""
    dump.parent.mkdir(parents=True, exist_ok=True)
    log = open(f"{dump}.log", "w")  # the child writes it; closed here when this function returns
    with log:
        return subprocess.Popen(trainer_command(dump, nproc, *overrides, max_restarts=max_restarts), cwd=REPO,
                                env=trainer_env(gpus if gpus is not None else gpu_list(nproc)), stdout=log,
                                stderr=subprocess.STDOUT, text=True)


def kill_job(agent: subprocess.Popen) -> None:
    """The agent's workers, then the agent."""
    for pid in children(agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.kill()
    agent.wait()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a torchrun agent's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def log_tail(dump: Path, chars: int = 6000) -> str:
    path = Path(f"{dump}.log")
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


JOB_TIMEOUT = float(os.environ.get("MULTIGPU_JOB_TIMEOUT", 480))  # checked by tests/conftest.py


def worker_stacks(agent: subprocess.Popen) -> str:
    """Every worker's Python stack (``py-spy dump``), where py-spy is installed: what a hung job waits on."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "(no py-spy on PATH: no stacks)"
    dumps = []
    for pid in children(agent.pid):
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        dumps.append(f"--- worker {pid}\n{out.stdout}{out.stderr}")
    return "\n".join(dumps)


def run_trainer(dump: Path, nproc: int, *overrides: str, gpus: list[int] | None = None, check: bool = True,
                timeout: float = JOB_TIMEOUT, max_restarts: int = 0) -> int:
    """Run the job to its end; its exit code (an AssertionError with the log's tail when ``check`` and not 0;
    on a timeout, with the workers' stacks too)."""
    proc = start_trainer(dump, nproc, *overrides, gpus=gpus, max_restarts=max_restarts)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = worker_stacks(proc)
        Path(f"{dump}.stacks").write_text(stacks)
        kill_job(proc)
        raise AssertionError(f"trainer timed out after {timeout} s:\n{log_tail(dump)}\nworker stacks:\n"
                             f"{stacks[-20000:]}") from None
    if check and code != 0:
        raise AssertionError(f"trainer failed ({code}):\n{log_tail(dump)}")
    return code


def seed_checkpoint(saved: Path, dump: Path, step: int) -> None:
    """A fresh dump folder holding only ``saved``'s step-``step`` checkpoint: a job there resumes from it."""
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(saved / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")


def read_metrics(dump: Path) -> list[dict]:
    """Per-step records from metrics.jsonl (training steps only)."""
    path = dump / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


class JobPool:
    """Runs jobs side by side; ``submit`` returns a Future of the job function's result. A job reserves
    ``nproc`` of the pool's process slots while it runs (after its dependencies, which it waits on itself) and
    gets the ``nproc`` GPUs running the fewest of the pool's processes (``MULTIGPU_MAX_PROCS`` = the GPU count:
    one process per GPU)."""

    def __init__(self, max_procs: int | None = None):
        default = 4 if ON_CPU else 10 * max(GPUS, 1)
        self.capacity = max_procs or int(os.environ.get("MULTIGPU_MAX_PROCS", default))
        self.free = self.capacity
        self.load = [0] * max(GPUS, 1)  # the pool's processes on each GPU
        self.cond = threading.Condition()
        self.executor = ThreadPoolExecutor(max_workers=64)

    def _reserve(self, nproc: int) -> list[int]:
        with self.cond:
            self.cond.wait_for(lambda: self.free >= min(nproc, self.capacity))
            self.free -= nproc
            gpus = sorted(range(len(self.load)), key=lambda g: self.load[g])[:nproc]
            for g in gpus:
                self.load[g] += 1
            return gpus

    def _release(self, nproc: int, gpus: list[int]) -> None:
        with self.cond:
            self.free += nproc
            for g in gpus:
                self.load[g] -= 1
            self.cond.notify_all()

    def submit(self, nproc: int, fn: Callable[[list[int]], object], after: list[Future] = (),
               name: str = "") -> Future:
        """``fn(gpus)`` once every future in ``after`` is done, holding ``nproc`` slots; its wall time goes to
        the report under ``name``."""
        def job():
            for dep in after:
                dep.result()
            gpus = self._reserve(nproc)
            start = time.monotonic()
            try:
                return fn(gpus)
            finally:
                self._release(nproc, gpus)
                _report({"job": name or getattr(fn, "__name__", "?"), "gpus": gpus,
                         "seconds": round(time.monotonic() - start, 1)})
        return self.executor.submit(job)

    def run(self, dump: Path, nproc: int, *overrides: str, after: list[Future] = ()) -> Future:
        """A trainer job to its end; the Future's result is ``dump``."""
        def fn(gpus):
            run_trainer(dump, nproc, *overrides, gpus=gpus)
            return dump
        return self.submit(nproc, fn, after, name=dump.name)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)


def _report(record: dict) -> None:
    if path := os.environ.get("MULTIGPU_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def rel_diffs(ref: dict[int, float], got: dict[int, float]) -> dict[int, float]:
    return {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in ref}


# Bounds for float32 jobs, from the first run of the suite on 4 H100s (2026-11-27): over the first 4 steps every
# layout's loss was within 4.9e-5 of one GPU's and its gradient norm within 5.8e-4; later the job's loss spikes
# (lr 3e-3) amplify reduction-order differences, to at most 3.0e-2 at one step and 6e-3 on average over the run.
# A fault in a layout's gradients shows from step 2 on, far above the early bounds.
FLOAT32_TOL = {"early_steps": 4, "early_rtol": 2e-4, "early_grad_norm_rtol": 2e-3, "loss_rtol": 6e-2,
               "mean_rtol": 1.2e-2}


def assert_close_losses(name: str, reference: Path, dump: Path, *, early_steps: int, early_rtol: float,
                        early_grad_norm_rtol: float, loss_rtol: float, mean_rtol: float,
                        steps: list[int] | None = None) -> dict:
    """Over the first ``early_steps`` compared steps, each loss within ``early_rtol`` of the reference's
    (relative) and each gradient norm within ``early_grad_norm_rtol``; over all of them, each loss within
    ``loss_rtol`` and the mean relative difference within ``mean_rtol``. Returns (and reports) the differences."""
    ref, got = read_metrics(reference), read_metrics(dump)
    ref_loss, got_loss = {r["step"]: r["loss"] for r in ref}, {r["step"]: r["loss"] for r in got}
    steps = steps or sorted(ref_loss)
    assert set(steps) <= set(got_loss), f"{name}: steps logged {sorted(got_loss)}, expected {steps}"
    diffs = rel_diffs({s: ref_loss[s] for s in steps}, got_loss)
    ref_gn = {r["step"]: r["grad_norm"] for r in ref}
    got_gn = {r["step"]: r["grad_norm"] for r in got}
    early = steps[:early_steps]
    out = {"test": name, "max_loss_rel": max(diffs.values()), "mean_loss_rel": sum(diffs.values()) / len(diffs),
           "early_loss_rel": max(diffs[s] for s in early),
           "early_grad_norm_rel": max(abs(got_gn[s] - ref_gn[s]) / ref_gn[s] for s in early),
           "last_loss": [ref_loss[steps[-1]], got_loss[steps[-1]]]}
    _report(out)
    table = "\n".join(f"step {s}: {ref_loss[s]:.5f} vs {got_loss[s]:.5f} (rel {diffs[s]:.2e}); grad norm "
                      f"{ref_gn[s]:.4f} vs {got_gn[s]:.4f}" for s in steps)
    assert out["early_loss_rel"] <= early_rtol, f"{name}: early losses\n{table}"
    assert out["early_grad_norm_rel"] <= early_grad_norm_rtol, f"{name}: early gradient norms\n{table}"
    assert out["max_loss_rel"] <= loss_rtol, f"{name}: largest step difference\n{table}"
    assert out["mean_loss_rel"] <= mean_rtol, f"{name}: mean difference\n{table}"
    return out
