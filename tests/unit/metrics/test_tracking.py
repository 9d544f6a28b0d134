"""[metrics] wandb: an offline W&B run holds every logged step's values as metrics.jsonl has them, a resumed job
continues the same run id, and a missing wandb package is one line naming the extra; the console step line
shows elapsed time and ETA."""

from __future__ import annotations

import sys

import pytest

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.metrics import logger as logger_mod
from torchtitan_ext.metrics.logger import MetricsLogger, hms
from torchtitan_ext.metrics.wandb_sink import RUN_ID_FILE, WandbSink, tracking_sinks

MISSING = "metrics.wandb = true needs the wandb package: pip install -e '.[tracking]'"


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as e:
        WandbSink(str(tmp_path), "p", "", [], {})
    assert str(e.value) == MISSING
    cfg = JobConfig()
    cfg.metrics.wandb = True
    for rank in (0, 1):  # every rank stops, not only the one that would log
        with pytest.raises(ConfigError, match=r"\.\[tracking\]"):
            tracking_sinks(cfg, rank)
    cfg.metrics.wandb = False
    assert tracking_sinks(cfg, 0) == []
    assert not (tmp_path / RUN_ID_FILE).exists()


def test_eta_from_the_recent_steps(tmp_path, monkeypatch):
    clock, lines = [100.0], []
    monkeypatch.setattr(logger_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(logger_mod, "log", type("L", (), {"info": staticmethod(lines.append)}))
    m = MetricsLogger(str(tmp_path), 0, False, False, resume_step=10, total_steps=100)
    clock[0] += 30.0  # 3 s per step over steps 11..20
    m.log(20, {"loss": 1.0})
    assert lines[-1] == "step     20  loss 1.0000  elapsed 0:00:30  eta 0:04:00"
    for step in range(21, 41):  # 1 s per step: the window of the last 10 logged steps forgets the 3 s steps
        clock[0] += 1.0
        m.log(step, {"loss": 1.0})
    assert lines[-1].endswith("elapsed 0:00:50  eta 0:01:00")
    m.log(40, {"val_loss": 2.0})  # a second line for the same step: the rate is unchanged
    assert lines[-1] == "step     40  val 2.0000  elapsed 0:00:50  eta 0:01:00"
    m.close()
    assert hms(3 * 3600 + 61.9) == "3:01:01" and hms(-1) == "0:00:00"


def test_wandb_init_failure_is_one_line(tmp_path, monkeypatch):
    """Online without an API key: one ConfigError line, not wandb's traceback."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    with pytest.raises(ConfigError, match="^metrics.wandb: wandb.init failed: .*WANDB_MODE=offline") as e:
        WandbSink(str(tmp_path / "job"), "p", "", [], {})
    assert "\n" not in str(e.value)
