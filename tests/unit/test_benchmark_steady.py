"""benchmarks/steady.py, the one steady-state rule of the benchmarks, against figures worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _steady():
    spec = importlib.util.spec_from_file_location("steady", REPO / "benchmarks" / "steady.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["steady"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


steady = _steady()


def _metrics(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [  # log_freq 2: windows of 4, 2, 1 and 2 seconds
    {"step": 2, "loss": 9.0, "tokens": 200, "tokens_per_sec": 50.0, "mfu": 0.1, "memory_gib": 3.0},
    {"step": 4, "loss": 8.0, "tokens": 400, "tokens_per_sec": 100.0, "mfu": 0.3, "memory_gib": 5.0},
    {"step": 5, "val_loss": 7.9},  # an evaluation row: no window
    {"step": 6, "loss": 7.0, "tokens": 600, "tokens_per_sec": 200.0, "mfu": 0.5, "memory_gib": 4.0},
    {"step": 8, "loss": 6.5, "tokens": 800, "tokens_per_sec": 100.0, "mfu": 0.2, "memory_gib": 4.5},
]


def test_ours_windows_and_the_figures_after_the_warm_up(tmp_path):
    windows = steady.ours(_metrics(tmp_path, ROWS))
    assert [(w.first_step, w.end_step, w.seconds, w.tokens) for w in windows] == [
        (1, 2, 4.0, 200), (3, 4, 2.0, 200), (5, 6, 1.0, 200), (7, 8, 2.0, 200)]
    fig = steady.figures(windows, warmup=2)
    # steady: the windows from step 3 on, at 100, 200 and 100 tokens/s and 1, 0.5 and 1 s a step
    assert fig["tokens_per_sec_per_device"] == 100.0 and fig["step_s"] == 1.0 and fig["steady_windows"] == 3
    assert fig["first_step_s"] == 3.0  # the first window's 4 s less its second step at the steady 1 s
    assert fig["mfu"] == 0.3 and fig["peak_memory_gib"] == 5.0 and fig["final_loss"] == 6.5 and fig["steps"] == 8
    assert fig["tail_loss"] == (9.0 + 8.0 + 7.0 + 6.5) / 4  # every logged step is within the last 50


def test_the_tail_loss_is_the_mean_of_the_losses_logged_in_the_last_50_steps(tmp_path):
    rows = [{"step": s, "loss": float(s), "tokens": 10 * s, "tokens_per_sec": 10.0} for s in range(10, 301, 10)]
    fig = steady.figures(steady.ours(_metrics(tmp_path, rows)), warmup=10)
    assert fig["tail_loss"] == (250 + 260 + 270 + 280 + 290 + 300) / 6 and fig["final_loss"] == 300.0


def test_the_validation_loss_is_the_last_evaluation_and_absent_without_one(tmp_path):
    assert steady.validation(steady.metrics_rows(_metrics(tmp_path, ROWS))) == {"val_loss": 7.9}
    rows = [*ROWS, {"step": 8, "val_loss": 6.4, "val_bpb": 1.0}]
    assert steady.validation(steady.metrics_rows(_metrics(tmp_path, rows))) == {"val_loss": 6.4}
    assert steady.validation(steady.metrics_rows(_metrics(tmp_path, ROWS[:2]))) == {}


def test_ours_per_device_and_a_longer_warm_up(tmp_path):
    windows = steady.ours(_metrics(tmp_path, ROWS), world_size=2)
    fig = steady.figures(windows, warmup=4)  # windows 5-6 and 7-8: 100 and 50 tokens/s per device
    assert fig["tokens_per_sec_per_device"] == 75.0 and fig["step_s"] == 0.75 and fig["steady_windows"] == 2


def test_a_run_without_a_window_after_its_warm_up_says_so(tmp_path):
    windows = steady.ours(_metrics(tmp_path, ROWS))
    with pytest.raises(steady.NoSteadyWindows, match="no logged window starts after the 8 warm-up steps "
                                                     r"\(the last ends at step 8\)"):
        steady.figures(windows, warmup=8)
    with pytest.raises(steady.NoSteadyWindows, match="no training step"):
        steady.figures([], warmup=0)


def test_no_first_step_time_when_the_log_starts_later():
    windows = [steady.Window(10, 5, 5.0, 500.0), steady.Window(15, 5, 2.5, 500.0)]
    assert "first_step_s" not in steady.figures(windows, warmup=5)


PREFIX = "[titan] 2026-12-02 18:00:00,000 - root - INFO - "
TORCHTITAN_LOG = "".join(f"[rank{rank}]:{PREFIX}step: {step}  loss: {loss}  grad_norm: 2.0000  memory: {gib}GiB(14.00%)"
                         f"  tps: {tps}  tflops: 50.00  mfu: {mfu}%\n" for rank, step, loss, gib, tps, mfu in (
                             (0, " 1", "10.5000", "20.00", "1,000", "5.00"),
                             (1, " 1", "10.5000", "99.00", "9,000", "5.00"),
                             (0, " 5", " 9.0000", "30.00", "2,000", "10.00"),
                             (0, "10", " 8.2500", "25.00", "4,000", "20.00")))


def test_torchtitan_log_windows_and_figures():
    windows = steady.torchtitan(TORCHTITAN_LOG, tokens_per_step=1000)  # rank 1's line is left out
    assert [(w.first_step, w.end_step, w.seconds) for w in windows] == [(1, 1, 1.0), (2, 5, 2.0), (6, 10, 1.25)]
    fig = steady.figures(windows, warmup=1)
    assert fig["tokens_per_sec_per_device"] == 3000.0 and fig["step_s"] == 0.375
    assert fig["first_step_s"] == 1.0 and fig["mfu"] == pytest.approx(0.15)
    assert fig["peak_reserved_gib"] == 30.0 and fig["final_loss"] == 8.25 and "peak_memory_gib" not in fig
