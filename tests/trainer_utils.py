"""Run the real trainer (its ranks with gloo on CPU) and read back its per-step metrics."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
TEST_CACHE = Path(os.environ.get("TORCHTITAN_EXT_TEST_CACHE", Path.home() / ".cache" / "torchtitan_ext_tests"))

# A tiny, fast job on the built-in corpus with the byte tokenizer; tests add their own overrides.
TINY = [
    "--model.flavor", "debug", "--data.tokenizer", "byte", "--data.cache_dir", str(TEST_CACHE),
    "--training.seq_len", "64", "--training.local_batch_size", "4", "--training.steps", "5",
    "--metrics.log_freq", "1", "--metrics.tensorboard", "false", "--checkpoint.enabled", "false",
    "--eval.steps", "0", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
]

# Checkpoints every 2 steps, all kept: the fault tests' base runs.
CKPT_EVERY_2 = ["--checkpoint.enabled", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def file_checksums(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the append-only logs and the lock: relative path -> sha256 (what a fault
    test checks is unchanged)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock" and p.relative_to(root).parts[0] != "logs"}


def run_trainer(dump: Path, nproc: int, *overrides: str, check: bool = True,
                timeout: float = 1200) -> subprocess.CompletedProcess:
    """The trainer with TINY + overrides, dump folder ``dump``: a plain single process when nproc == 0, else
    ``nproc`` ranks. A run expected to succeed (``check``) starts its ranks itself (``run_ranks``); one that may
    fail (``check=False``) goes through ``python -m torch.distributed.run``, whose report of the failed ranks
    (their exit codes) the bad-input tests read."""
    args = [*TINY, "--job.dump_folder", str(dump), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    train = [sys.executable, "-m", "torchtitan_ext.train", *args]
    if nproc == 0:
        proc = subprocess.run(train, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    elif check:
        proc = run_ranks(train, nproc, env, timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "torchtitan_ext.train", *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_ranks(cmd: list[str], nproc: int, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``nproc`` processes of ``cmd`` as the ranks of one job, the way a cluster launcher without torchrun
    starts them (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT; rank 0 hosts the store): torchrun's agent
    process costs 3 s of CPU per job, which the 2-core CI machine pays in every multi-process test. All ranks
    write to one stdout and one stderr, as under torchrun. The job's exit code is 0 when every rank's is, else
    1; the first failing rank stops the others (SIGTERM, then SIGKILL after 10 s), as torchrun does."""
    port = str(free_port())
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        procs = [subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                       "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port}) for r in range(nproc)]
        deadline, stop_at = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                if stop_at is None and any(p.returncode not in (None, 0) for p in procs):
                    stop_at = now + 10
                    for p in procs:
                        if p.poll() is None:
                            p.terminate()
                elif stop_at is not None and now > stop_at:
                    for p in procs:
                        p.kill()
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out.seek(0)
        err.seek(0)
        code = 0 if all(p.returncode == 0 for p in procs) else 1
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def read_metrics(dump: Path) -> list[dict]:
    """Per-step records from metrics.jsonl (training steps only)."""
    path = dump / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}
