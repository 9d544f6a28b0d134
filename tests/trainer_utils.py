"""Run the real trainer (torchrun with gloo on CPU) and read back its per-step metrics."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
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
    """``python -m torch.distributed.run --nproc_per_node nproc -m torchtitan_ext.train`` (or a plain
    single process when nproc == 0) with TINY + overrides; dump folder ``dump``."""
    args = [*TINY, "--job.dump_folder", str(dump), *overrides]
    if nproc == 0:
        cmd = [sys.executable, "-m", "torchtitan_ext.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "torchtitan_ext.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(dump: Path) -> list[dict]:
    """Per-step records from metrics.jsonl (training steps only)."""
    path = dump / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}
