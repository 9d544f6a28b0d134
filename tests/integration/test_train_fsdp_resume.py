"""End-to-end trainer runs on CPU (gloo): learning, FSDP == 1 process, exact resume, resharding,
crash-safe checkpoints, divergence handling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from trainer_utils import REPO, TEST_CACHE, losses, read_metrics, run_trainer

# float32 on CPU: FSDP's reduce-scatter sums gradients in another order than one process, so losses
# agree to float32 rounding accumulated over a few steps, not bit for bit.
FSDP_RTOL = 1e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 1-process reference: 10 steps, checkpoints every 5, all kept."""
    dump = tmp_path_factory.mktemp("single")
    run_trainer(dump, 0, "--training.steps", "10", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0")
    return dump


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """The same job with FSDP over 2 gloo processes (local batch halved: same global batch)."""
    dump = tmp_path_factory.mktemp("fsdp2")
    run_trainer(dump, 2, "--training.steps", "10", "--training.local_batch_size", "2",
                "--checkpoint.enabled", "true", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0")
    return dump


def test_fsdp2_matches_single_process(single, fsdp2):
    ref, got = losses(single), losses(fsdp2)
    assert sorted(ref) == sorted(got) == list(range(1, 11))
    for step in range(1, 6):
        assert got[step] == pytest.approx(ref[step], rel=FSDP_RTOL), step
    ref_gn = {r["step"]: r["grad_norm"] for r in read_metrics(single)}
    got_gn = {r["step"]: r["grad_norm"] for r in read_metrics(fsdp2)}
    for step in range(1, 6):
        assert got_gn[step] == pytest.approx(ref_gn[step], rel=1e-4), step


def test_outputs_written(single):
    records = read_metrics(single)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec"):
        assert key in records[0]
    assert (single / "config.toml").read_text().count("[training]") == 1
    assert sorted(p.name for p in (single / "checkpoint").iterdir()) == ["step-10", "step-5"]


def _resume_from(reference, step: int, dest, nproc: int, *extra: str):
    """Copy ``reference``'s checkpoint at ``step`` into a fresh dump folder and continue to step 10."""
    (dest / "checkpoint").mkdir(parents=True, exist_ok=True)
    shutil.copytree(reference / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")
    run_trainer(dest, nproc, "--training.steps", "10", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "5", *extra)
    return losses(dest)


@pytest.fixture(scope="module")
def resumed_single(single, tmp_path_factory):
    """``single`` resumed from step 5 in a fresh dump folder that also holds a crashed save (step-10.tmp):
    (folder, losses)."""
    dest = tmp_path_factory.mktemp("resumed_single")
    (dest / "checkpoint" / "step-10.tmp").mkdir(parents=True)
    (dest / "checkpoint" / "step-10.tmp" / "__0_0.distcp").write_bytes(b"partial")
    return dest, _resume_from(single, 5, dest, 0)


def test_exact_resume(single, resumed_single):
    _, resumed = resumed_single
    ref = losses(single)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - ref[step]) <= 1e-6, step


@pytest.mark.parametrize("nproc, local_batch", [(1, "4"), pytest.param(4, "1", marks=pytest.mark.slow)])
def test_reshard_2_to_n(fsdp2, tmp_path, nproc, local_batch):
    resumed = _resume_from(fsdp2, 5, tmp_path, nproc, "--training.local_batch_size", local_batch)
    ref = losses(fsdp2)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(ref[step], rel=FSDP_RTOL), step


def test_interrupted_save_is_ignored(resumed_single):
    """A crash mid-save leaves step-N.tmp: the run resumes from the last complete checkpoint (and, above,
    exactly)."""
    dest, resumed = resumed_single
    assert min(resumed) == 6
    assert not (dest / "checkpoint" / "step-10.tmp").exists()
    assert (dest / "checkpoint" / "step-10").is_dir()


def test_divergence_stops_without_saving(tmp_path):
    proc = run_trainer(tmp_path, 0, "--training.steps", "6", "--optimizer.lr", "1e30", "--training.max_norm",
                       "0", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enabled", "true",
                       "--checkpoint.interval", "1", check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "loss is nan" in proc.stderr or "loss is inf" in proc.stderr
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    bad_step = int(proc.stderr.split("step ")[1].split(":")[0])
    assert saved and all(int(s.split("-")[1]) < bad_step for s in saved)
    meta = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step"] < bad_step for r in meta)


DEFAULT_JOB_STEPS = 60


@pytest.mark.slow
def test_default_debug_job_learns(tmp_path):
    """The README's training command (launch/train.sh: debug model, built-in corpus with its SentencePiece
    BPE, 2 gloo processes on a CPU machine) halves its loss. Its 200 default steps take minutes on a 2-core
    CPU, so the job runs with only its step count changed: 60 steps, the cosine schedule fitted to them."""
    proc = subprocess.run(
        ["bash", "launch/train.sh", "--job.dump_folder", str(tmp_path), "--data.cache_dir", str(TEST_CACHE),
         "--checkpoint.enabled", "false", "--metrics.log_freq", "1", "--training.steps", str(DEFAULT_JOB_STEPS)],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = losses(tmp_path)
    assert max(record) == DEFAULT_JOB_STEPS
    first, last = record[1], record[DEFAULT_JOB_STEPS]
    assert last <= 0.5 * first, (first, last)
