"""benchmarks/loss_gap.py: two runs' training losses compared window by window, against hand-worked figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "loss_gap.py"


def _loss_gap():
    spec = importlib.util.spec_from_file_location("loss_gap", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


loss_gap = _loss_gap()


def test_console_log_and_metrics_jsonl_read_alike(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("training 3 steps\nstep      1  loss 4.0000  gnorm 1.0  lr 3e-4  tok/s 10\n"
                   "step      2  val 3.9  (24 windows)\nstep      2  loss 3.5000  gnorm 1.0\ndone\n")
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 4.0, "tokens": 10, "tokens_per_sec": 5.0},
        {"step": 2, "val_loss": 3.9}, {"step": 2, "loss": 3.5, "tokens": 20, "tokens_per_sec": 5.0}]))
    assert loss_gap.step_losses(log) == loss_gap.step_losses(jsonl) == {1: 4.0, 2: 3.5}


def test_windows_end_at_the_last_common_step_and_give_the_relative_difference():
    reference = {s: 2.0 for s in range(1, 8)}
    run = {s: 2.0 + (0.5 if s >= 5 else 0.0) for s in range(1, 9)}  # step 8: the reference did not log it
    gaps = loss_gap.windowed_gaps(reference, run, window=3)
    assert [(a, b) for a, b, *_ in gaps] == [(1, 1), (2, 4), (5, 7)]
    assert gaps[-1][2:] == (2.0, 2.5, pytest.approx(0.25)) and gaps[1][4] == 0.0


def test_a_file_without_losses_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(empty), str(tmp_path / "missing.log")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {empty}: no training step's loss in it (expected metrics.jsonl rows or 'step N  loss X' console "
        f"lines)"]


@pytest.mark.parametrize("text, expected", [
    ('{"step": 1, "loss": 2\n', "line 1 is not JSON (Expecting ',' delimiter)"),
    ('{"step": 1, "loss": 2.0, "tokens_per_sec": 1}\n[1, 2]\n', "line 2 is not a JSON object"),
    ('{"step": 1, "loss": "x", "tokens_per_sec": 1}\n', "step 1 logs loss 'x'; expected a whole step and a number")])
def test_a_corrupted_metrics_jsonl_is_one_line_naming_what_is_wrong(tmp_path, text, expected):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text(text)
    done = subprocess.run([sys.executable, str(SCRIPT), str(bad), str(bad)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"error: {bad}: {expected}"]
