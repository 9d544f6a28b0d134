"""Reading each step's loss one step late (metrics.log_freq) changes nothing a run computes."""

from __future__ import annotations

import pytest
from trainer_utils import read_metrics, run_trainer


def test_losses_read_late_change_no_step(tmp_path):
    """A hair-trigger spike guard (factor 1, window 2) cuts the LR often; logging every step (each loss read
    at once) and every 4th (read one step late) give the same LR and loss at every logged step."""
    spiky = ["--training.steps", "12", "--training.spike_factor", "1.0", "--training.spike_window", "2"]
    every = run_trainer(tmp_path / "every", 0, *spiky, "--metrics.log_freq", "1")
    late = run_trainer(tmp_path / "late", 0, *spiky, "--metrics.log_freq", "4")
    assert every.stdout.count("loss spike") >= 2 and every.stdout.count("loss spike") == late.stdout.count("loss spike")
    ref = {r["step"]: r for r in read_metrics(tmp_path / "every")}
    got = read_metrics(tmp_path / "late")
    assert [r["step"] for r in got] == [4, 8, 12]
    assert any(ref[s]["lr_spike_factor"] < 1 for s in ref)
    for r in got:
        assert r["lr"] == ref[r["step"]]["lr"] and r["lr_spike_factor"] == ref[r["step"]]["lr_spike_factor"]
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-6)
