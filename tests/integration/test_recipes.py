"""The time-to-loss configs (issue 28): train_configs/base_200m.toml and fast_200m.toml run on CPU at the debug
size with their recipes in effect (float8 off: it needs a GPU), and benchmarks/time_to_loss.py's clock and
target crossing against hand-computed values."""

from __future__ import annotations

import importlib.util

import pytest
import tomllib
from trainer_utils import REPO, losses, run_trainer

SMALL = ["--training.steps", "12", "--training.compile", "false", "--float8.enabled", "false",
         "--lr_scheduler.warmup_steps", "2", "--eval.interval", "0", "--optimizer.lr", "2e-3"]


@pytest.mark.parametrize("name, optimizer, schedule", [("base_200m", "adamw", "cosine"),
                                                       ("fast_200m", "muon", "cosine")])
def test_recipe_config_trains_at_debug_size(tmp_path, name, optimizer, schedule):
    run_trainer(tmp_path, 0, "--config", str(REPO / "train_configs" / f"{name}.toml"), *SMALL,
                "--model.flavor", "debug")
    loss = losses(tmp_path)
    assert loss[12] < loss[1] - 0.5, loss
    resolved = tomllib.loads((tmp_path / "config.toml").read_text())
    assert resolved["optimizer"]["name"] == optimizer and resolved["lr_scheduler"]["name"] == schedule
    if name == "fast_200m":  # the recipe's parts besides float8 reach the run
        assert resolved["model"]["qk_norm"] is True and resolved["model"]["logit_softcap"] == 30.0
        assert resolved["training"]["z_loss"] == 1e-4 and resolved["lr_scheduler"]["min_lr_ratio"] == 0.1
        assert resolved["float8"]["include_output"] is True


def _time_to_loss():
    spec = importlib.util.spec_from_file_location("time_to_loss", REPO / "benchmarks" / "time_to_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_to_loss_clock_and_crossing():
    """Windows of 100 tokens at 10, 50 and 25 tokens/s: 10 + 2 + 4 s with compile; without it the first
    window runs at the median of the others (37.5 tokens/s). val_bpb 2.0 at 200 tokens, 1.0 at 300: the
    target 1.5 is crossed half-way through the third window."""
    ttl = _time_to_loss()
    rows = [{"step": 1, "tokens": 100, "tokens_per_sec": 10.0},
            {"step": 2, "tokens": 200, "tokens_per_sec": 50.0, "val_bpb": 2.0},
            {"step": 3, "tokens": 300, "tokens_per_sec": 25.0, "val_bpb": 1.0}]
    clock = ttl.training_clock(rows)
    assert [c[0] for c in clock] == [100, 200, 300]
    assert clock[-1][1] == pytest.approx(16.0) and clock[-1][2] == pytest.approx(100 / 37.5 + 6.0)
    hit = ttl.crossing(clock, 1.5)
    assert hit["tokens"] == pytest.approx(250) and hit["seconds"] == pytest.approx(14.0)
    assert ttl.crossing(clock, 0.5) is None and ttl.crossing(clock, 2.5)["tokens"] == 200
