"""Every scenario of benchmarks/scenarios.toml is a job the trainer accepts: its arguments parse with the
config loader (a renamed or removed key fails here, not on a lent GPU), its torchtitan config exists, and its
reference is a scenario."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from torchtitan_ext.config.loader import parse_args

REPO = Path(__file__).resolve().parents[2]


def _scenarios() -> dict:
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.load_scenarios()


SCENARIOS = _scenarios()


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_is_a_job_the_trainer_accepts(name, monkeypatch):
    scenario = SCENARIOS[name]
    monkeypatch.chdir(REPO)
    cfg = parse_args(scenario.trainer_args(scenario.config))
    assert (cfg.training.local_batch_size, cfg.training.seq_len) == (scenario.batch, scenario.seq)
    assert cfg.training.steps == scenario.steps > scenario.warmup and cfg.metrics.log_freq == scenario.log_freq
    if "torchtitan" in scenario.baselines:
        assert (REPO / "benchmarks" / "torchtitan" / scenario.torchtitan["config"]).is_file()
    assert scenario.reference is None or scenario.reference in SCENARIOS
    assert scenario.gpus in (0, 1, 2, 4, 8) and scenario.timeout_s <= 600
