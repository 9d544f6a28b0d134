"""The trainer compiled under tensor parallelism (a dense model) against eager one process, and the float8 output
head's refusal of the fused linear cross-entropy."""

from __future__ import annotations

import pytest
import torch
from trainer_utils import read_metrics, run_trainer

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.quant import float8 as f8

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--training.steps", "4"]


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_compiled_tp2_matches_eager_one_process(tmp_path, ac):
    """Also under op-level selective AC, whose policy keeps TP's reduce-scatter outputs."""
    run_trainer(tmp_path / "one", 0, *SMALL)
    proc = run_trainer(tmp_path / "tp2", 2, *SMALL, "--parallelism.tp", "2", "--parallelism.dp_shard", "1",
                       "--training.compile", "true", "--activation_checkpoint.mode", ac)
    assert "compile: under TP the embedding's reduce-scatter completes before the first compiled block" \
        in proc.stdout
    ref, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), r["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), r["step"]
    assert got[-1]["loss"] < got[0]["loss"]


def test_include_output_refuses_fused_linear_ce(tmp_path):
    cfg = Float8Section(enabled=True, include_output=True)
    with pytest.raises(ConfigError, match="include_output = true and training.fused_linear_ce = true are "
                                          "exclusive"):
        f8.check_float8_supported(cfg, torch.device("cpu"), fused_linear_ce=True)
    proc = run_trainer(tmp_path, 0, "--float8.enabled", "true", "--float8.include_output", "true",
                       "--training.fused_linear_ce", "true", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "exclusive" in errors[0] and "Traceback" not in proc.stderr
