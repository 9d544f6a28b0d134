"""Batch-size warmup in the trainer: it follows its schedule and resumes exactly mid-ramp with the EMA in the
checkpoint."""

from __future__ import annotations

import shutil

import pytest
from trainer_utils import read_metrics, run_trainer

from torchtitan_ext.train.batch_warmup import BatchWarmup

WARMUP = ["--training.global_batch_size", "16", "--training.batch_warmup_tokens", "2048",
          "--training.batch_warmup_start", "1", "--ema.decay", "0.8", "--eval.use_ema", "true",
          "--eval.steps", "2", "--eval.interval", "4", "--training.steps", "8", "--checkpoint.enabled", "true",
          "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


def test_warmup_follows_schedule_and_resumes_exactly_with_ema(tmp_path):
    run_trainer(tmp_path / "ref", 0, *WARMUP)
    ref = {r["step"]: r for r in read_metrics(tmp_path / "ref")}
    sched = BatchWarmup(4, 1, 4 * 64, 2048, 8)
    assert [ref[s]["micro_batches"] for s in range(1, 9)] == [sched.micro_batches(s) for s in range(1, 9)] \
        == [1, 1, 1, 2, 2, 3, 4, 4]  # consumed before: 0, 256, 512, 768, 1280, 1792, 2560 tokens
    assert [ref[s]["tokens"] for s in range(1, 9)] == [sched.tokens_through(s) for s in range(1, 9)]
    (tmp_path / "res" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "ref" / "checkpoint" / "step-4", tmp_path / "res" / "checkpoint" / "step-4")
    run_trainer(tmp_path / "res", 0, *WARMUP)
    res = {r["step"]: r for r in read_metrics(tmp_path / "res")}
    assert sorted(res) == [5, 6, 7, 8]
    for s in range(5, 9):
        for key in ("loss", "lr", "micro_batches", "tokens"):
            assert res[s][key] == pytest.approx(ref[s][key], abs=1e-6), (s, key)
    assert res[8]["val_loss"] == pytest.approx(ref[8]["val_loss"], abs=1e-6)  # the EMA was restored exactly
