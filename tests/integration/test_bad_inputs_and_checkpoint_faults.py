"""Bad inputs and faults: one ``error:`` line and exit 2 before any work, damaged checkpoints skipped with a
line naming them, metrics that a resume redoes replaced, non-finite gradients skipped, preemption saved."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port
from trainer_utils import REPO, TINY, losses, read_metrics, run_trainer

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.data.shards import HEADER_BYTES, SCAN_CACHE, write_shard
from torchtitan_ext.train.__main__ import main

CKPT = ["--checkpoint.enabled", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, exactly one ``error:`` line containing every needle, no traceback, no training step."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = _error_lines(proc)
    assert len(errors) == 1 and all(n in errors[0] for n in needles), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "step      1" not in proc.stdout
    return errors[0]


@pytest.mark.parametrize("flag, value", [("optimizer.lr", "nan"), ("training.max_norm", "nan"),
                                         ("training.max_norm", "inf"), ("optimizer.lr", "-inf")])
def test_nonfinite_float_is_one_line(capsys, flag, value):
    assert main(["--" + flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: argument --{flag}: {flag}: expected a finite float, got {float(value)!r}"]


def test_nonfinite_float_in_toml_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[optimizer]\nlr = nan\n")
    assert main(["--config", str(cfg)]) == 2
    assert "optimizer.lr: expected a finite float, got nan" in capsys.readouterr().err


def _shards(folder: Path, tokens: np.ndarray) -> Path:
    folder.mkdir(parents=True)
    write_shard(folder / "train_000.bin", tokens)
    return folder


SHARDS = ["--data.dataset", "shards", "--data.tokenizer", "none", "--model.vocab_size", "256"]


def test_negative_token_count_in_header(tmp_path):
    data = _shards(tmp_path / "data", np.arange(5000) % 256)
    with open(data / "train_000.bin", "r+b") as f:
        f.seek(8)
        f.write(np.array([-5], dtype="<i4").tobytes())
    proc = run_trainer(tmp_path / "run", 0, *SHARDS, "--data.train_path", str(data), check=False)
    _one_error(proc, "train_000.bin", "-5 tokens", "expected a count >= 0")


def test_token_beyond_vocab_found_at_start_and_scan_cached(tmp_path):
    tokens = np.arange(100_000) % 200
    tokens[-7] = 300  # in the last windows: training would reach it only after many steps
    data = _shards(tmp_path / "data", tokens)
    cache = tmp_path / "cache"
    proc = run_trainer(tmp_path / "run", 0, *SHARDS, "--data.train_path", str(data), "--data.cache_dir",
                       str(cache), "--training.steps", "100", check=False)
    _one_error(proc, "train_000.bin", "token id 300 >= model vocabulary 256")
    scan = json.loads((cache / SCAN_CACHE).read_text())
    entry = scan[str((data / "train_000.bin").resolve())]
    assert entry["max"] == 300 and entry["size"] == HEADER_BYTES + 2 * tokens.size
    # The cached maximum is trusted while size and mtime match (the body is not re-read) ...
    entry["max"] = 100
    (cache / SCAN_CACHE).write_text(json.dumps(scan))
    run_trainer(tmp_path / "run2", 0, *SHARDS, "--data.train_path", str(data), "--data.cache_dir", str(cache),
                "--training.steps", "1")
    # ... and a rewritten shard is scanned again.
    write_shard(data / "train_000.bin", np.arange(100_001) % 200)
    run_trainer(tmp_path / "run3", 0, *SHARDS, "--data.train_path", str(data), "--data.cache_dir", str(cache),
                "--training.steps", "1")
    assert json.loads((cache / SCAN_CACHE).read_text())[str((data / "train_000.bin").resolve())]["max"] == 199


def test_tp_needs_seq_len_divisible(tmp_path):
    proc = run_trainer(tmp_path, 2, "--parallelism.dp_shard", "1", "--parallelism.tp", "2",
                       "--training.seq_len", "63", check=False)
    errors = _error_lines(proc)
    assert errors and "training.seq_len = 63 must be divisible by parallelism.tp = 2" in errors[0], proc.stderr
    assert "exitcode  : 2" in proc.stderr and "SIGABRT" not in proc.stderr
    for rank in (0, 1):  # per-rank log files hold each rank's own output
        assert "training.seq_len = 63 must be divisible" in (tmp_path / "logs" / f"rank-{rank}.log").read_text()
    assert "parallelism: world 2" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_rejected_config_keeps_previous_config_toml(tmp_path):
    (tmp_path / "config.toml").write_text("# the last good run's config\n")
    proc = run_trainer(tmp_path, 0, "--eval.use_ema", "true", check=False)
    _one_error(proc, "eval.use_ema = true needs an EMA")
    assert (tmp_path / "config.toml").read_text() == "# the last good run's config\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """6 steps, checkpoints at 2, 4, 6; losses of the uninterrupted run in metrics.jsonl."""
    dump = tmp_path_factory.mktemp("base")
    run_trainer(dump, 0, *CKPT, "--training.steps", "6")
    return dump


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def test_newest_metadata_deleted_falls_back_and_metrics_replaced(base, tmp_path):
    dump = _copy(base, tmp_path / "run")
    (dump / "checkpoint" / "step-6" / ".metadata").unlink()
    proc = run_trainer(dump, 0, *CKPT, "--training.steps", "6")
    assert f"checkpoint {dump}/checkpoint/step-6 is unreadable (its .metadata file is missing); skipping it" \
        in proc.stdout
    assert f"resuming from {dump}/checkpoint/step-4 instead (skipped unreadable: step-6)" in proc.stdout
    records = read_metrics(dump)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # 5 and 6 replaced, not appended again
    ref = losses(base)
    for r in records:  # the redone steps continue exactly
        assert r["loss"] == pytest.approx(ref[r["step"]], rel=1e-5)


def test_truncated_shard_of_newest_checkpoint_falls_back(base, tmp_path):
    dump = _copy(base, tmp_path / "run")
    shard = next((dump / "checkpoint" / "step-6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = run_trainer(dump, 0, *CKPT, "--training.steps", "6")
    assert f"checkpoint {dump}/checkpoint/step-6 is unreadable (" in proc.stdout
    assert f"resuming from {dump}/checkpoint/step-4 instead" in proc.stdout
    assert sorted(losses(dump)) == [1, 2, 3, 4, 5, 6]


def test_every_checkpoint_unreadable_stops_unless_fresh_start_allowed(base, tmp_path):
    dump = _copy(base, tmp_path / "run")
    for meta in (dump / "checkpoint").glob("step-*/.metadata"):
        meta.unlink()
    proc = run_trainer(dump, 0, *CKPT, "--training.steps", "6", check=False)
    _one_error(proc, "every checkpoint is unreadable (step-6, step-4, step-2)", "checkpoint.allow_fresh_start")
    proc = run_trainer(dump, 0, *CKPT, "--training.steps", "2", "--checkpoint.allow_fresh_start", "true")
    assert "starting from step 0 (checkpoint.allow_fresh_start = true)" in proc.stdout
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]


def test_load_step_resumes_from_that_step(base, tmp_path):
    dump = _copy(base, tmp_path / "run")
    proc = run_trainer(dump, 0, *CKPT, "--training.steps", "6", "--checkpoint.load_step", "2")
    assert f"resumed from {dump}/checkpoint/step-2" in proc.stdout
    ref, got = losses(base), losses(dump)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert got[step] == pytest.approx(ref[step], rel=1e-5)
    proc = run_trainer(dump, 0, *CKPT, "--checkpoint.load_step", "3", check=False)
    _one_error(proc, "checkpoint.load_step = 3: no complete checkpoint")


def test_keep_latest_k_retention(tmp_path):
    run_trainer(tmp_path, 0, "--checkpoint.enabled", "true", "--checkpoint.interval", "2",
                "--checkpoint.keep_latest_k", "2", "--training.steps", "6")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-4", "step-6"]


def test_gradient_accumulation_equals_one_large_batch(tiny_one_process, tmp_path):
    """2 micro-batches of 2 sequences give the losses of one batch of 4 (the same sequences: the plain tiny job,
    integration/conftest.py)."""
    run_trainer(tmp_path / "accum", 0, "--training.local_batch_size", "2", "--training.global_batch_size", "4")
    big, accum = read_metrics(tiny_one_process), read_metrics(tmp_path / "accum")
    assert [r["micro_batches"] for r in accum] == [2] * 5
    for b, a in zip(big, accum, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


def test_eval_interval_independent_of_log_freq(tmp_path):
    run_trainer(tmp_path, 0, "--training.steps", "6", "--metrics.log_freq", "4", "--eval.interval", "3",
                "--eval.steps", "1")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]  # 3 is not a log step; 6 only once
    assert [r["step"] for r in records if "loss" in r] == [3, 4, 6]


def test_shard_val_path_is_evaluated(tmp_path):
    rng = np.random.default_rng(0)
    train = _shards(tmp_path / "train", rng.integers(0, 64, 20_000))
    val = _shards(tmp_path / "val", rng.integers(0, 256, 4_000))  # a different distribution: a higher loss
    run_trainer(tmp_path / "run", 0, *SHARDS, "--data.train_path", str(train), "--data.val_path", str(val),
                "--training.steps", "6", "--eval.interval", "3", "--eval.steps", "2")
    records = read_metrics(tmp_path / "run")
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(vals) == [3, 6]
    assert vals[6] > records[-1]["loss"]  # measured on the val shard, not the training data


def test_plain_ddp_matches_one_process(tiny_one_process, tmp_path):
    """The trainer's only DDP (``parallelism.dp_mode = "ddp"``) check against one process (the plain tiny job,
    shared with the layout tests: integration/conftest.py): kept in CI."""
    run_trainer(tmp_path / "ddp", 2, "--parallelism.dp_mode", "ddp", "--training.local_batch_size", "2")
    ref, got = read_metrics(tiny_one_process), read_metrics(tmp_path / "ddp")
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-4)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-3)


def test_nonfinite_gradients_skip_the_step_then_stop(tmp_path):
    """A finite loss whose backward yields Inf: the update is skipped (weights unchanged), counted, and
    ``training.max_skipped_steps`` in a row stop the run."""
    from torchtitan_ext.train.nonfinite import NonFiniteGradients
    from torchtitan_ext.train.trainer import Trainer

    cfg = parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--training.max_skipped_steps", "2"])
    os.environ.pop("RANK", None)
    trainer = Trainer(cfg)
    try:
        weight = trainer.model_parts[0].output.weight
        poison = {"on": False}
        weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
        trainer.step = 1
        loss, _, _ = trainer.train_step()
        before = weight.detach().clone()
        poison["on"] = True
        trainer.step = 2
        loss, grad_norm, _ = trainer.train_step()
        assert np.isfinite(loss) and not np.isfinite(grad_norm)
        assert torch.equal(weight.detach(), before) and trainer.nonfinite.total == 1
        assert all(torch.isfinite(p).all() for p in trainer.model_parts[0].parameters())
        poison["on"] = False
        trainer.step = 3
        trainer.train_step()
        assert not torch.equal(weight.detach(), before) and trainer.nonfinite.in_row == 0
        poison["on"] = True
        trainer.step = 4
        trainer.train_step()
        trainer.step = 5
        with pytest.raises(NonFiniteGradients, match="step 5: gradient norm is .* 2th step in a row"):
            trainer.train_step()
    finally:
        trainer.metrics.close()
        dist.destroy_process_group()


def _spawn_workers(dump: Path, world: int, steps: int, *extra: str) -> list[subprocess.Popen]:
    """The trainer's ranks as plain processes (what torchrun starts), so a test can signal one of them."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torchtitan_ext.train", *TINY, "--job.dump_folder", str(dump),
             "--training.steps", str(steps), *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_and_resumes_exactly(tmp_path):
    """SIGTERM reaches rank 1 only; both ranks finish the step in flight, save, exit 0; the requeued job
    resumes from that checkpoint and ends with the losses of an uninterrupted run."""
    ckpt = ["--checkpoint.enabled", "true", "--checkpoint.interval", "1000", "--checkpoint.keep_latest_k", "0",
            "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "2"]
    dump = tmp_path / "preempted"
    procs = _spawn_workers(dump, 2, 12, *ckpt)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 2):
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    saved = [int(d.name.split("-")[1]) for d in (dump / "checkpoint").iterdir()]
    assert len(saved) == 1 and 2 <= saved[0] < 12
    assert f"preempted (signal) after step {saved[0]}: saved" in outs[0][0]
    procs = _spawn_workers(dump, 2, 12, *ckpt)  # the requeued job
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ref = tmp_path / "uninterrupted"
    procs = _spawn_workers(ref, 2, 12, *ckpt)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got, want = losses(dump), losses(ref)
    assert sorted(got) == list(range(1, 13))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_exception_while_async_save_pending_finishes_the_save(tmp_path):
    """The step-2 async save is still pending when step 3 raises: it is completed and published on the way
    out, not left as ``step-2.tmp`` (which the next start would delete)."""
    from torchtitan_ext.train.trainer import Trainer

    cfg = parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.enabled", "true",
                      "--checkpoint.async_mode", "async", "--checkpoint.interval", "2", "--training.steps", "4"])
    os.environ.pop("RANK", None)
    trainer = Trainer(cfg)
    step = trainer.queue_step

    def fail_at_3():
        if trainer.step == 3:
            assert trainer.checkpointer.pending is not None
            raise RuntimeError("injected fault")
        return step()

    trainer.queue_step = fail_at_3
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            trainer.train()
    finally:
        dist.destroy_process_group()
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert (folder / "step-2" / ".metadata").is_file()
