"""The trainer's fused linear cross-entropy in its vocabulary-parallel form (TP2) against one unfused process."""

import pytest

from tests.trainer_utils import losses, run_trainer

pytestmark = pytest.mark.slow

TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_hidden", "128", "--training.steps", "3",
        "--training.z_loss", "1e-3"]


def test_trainer_fused_linear_ce_under_tp2_equals_one_process(tmp_path):
    run_trainer(tmp_path / "plain", 0, *TINY)
    run_trainer(tmp_path / "tp", 2, *TINY, "--parallelism.tp", "2", "--training.fused_linear_ce", "true",
                "--training.fused_linear_ce_chunk", "100")
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "tp")
    assert want[3] < want[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=2e-5), step

