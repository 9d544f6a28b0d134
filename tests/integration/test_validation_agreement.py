"""One validation number: the trainer's evaluation at the end of a 2-process run and ``python -m
torchtitan_ext.eval --config <dump>/config.toml`` on the checkpoint it saved score the same validation tokens
in the same windows (the first eval.steps x local_batch_size x seq_len + 1 of the split, split over the ranks)
and agree. 3 x 3 windows over 2 ranks: the last global batch is padded with windows that score nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from trainer_utils import REPO, run_trainer

JOB = ["--training.steps", "4", "--training.local_batch_size", "3", "--eval.steps", "3",
       "--checkpoint.enabled", "true", "--checkpoint.interval", "100"]


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "torchtitan_ext.eval", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_trainer_validation_equals_eval_tool(tmp_path):
    dump = tmp_path / "run"
    run_trainer(dump, 2, *JOB)
    final = [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r][-1]
    assert final["step"] == 4 and (dump / "checkpoint" / "step-4").is_dir()
    out = _eval("--config", str(dump / "config.toml"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["checkpoint"].endswith("step-4") and res["scored_tokens"] == 3 * 3 * 64
    assert res["val_loss"] == pytest.approx(final["val_loss"], rel=1e-5, abs=1e-4)
    assert res["val_bpb"] == pytest.approx(final["val_bpb"], rel=1e-5, abs=1e-4)
    # masked data: the eval tool says its number is not the trainer's
    masked = _eval("--config", str(dump / "config.toml"), "--data.attention", "document")
    assert masked.returncode == 0, masked.stderr[-3000:]
    note, last = masked.stdout.strip().splitlines()[-2:]  # the package logs to stdout, then the JSON line
    assert "data.attention = 'document'" in note and "the trainer's validation uses the job's masked batches" in note
    assert json.loads(last)["scored_tokens"] == 3 * 3 * 64
