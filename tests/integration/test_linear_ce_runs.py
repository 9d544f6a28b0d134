"""The trainer with the fused linear cross-entropy (and z-loss): FSDP2 on 2 ranks, and its vocabulary-parallel
form under TP2, each against one process with the unfused loss."""

import pytest
from trainer_utils import losses, run_trainer

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_hidden", "128", "--training.steps", "3",
         "--training.z_loss", "1e-3"]


def test_trainer_fused_linear_ce_same_losses(tmp_path):
    """FSDP2 on 2 ranks with the fused loss (and z-loss) equals one process with the unfused loss."""
    run_trainer(tmp_path / "plain", 0, *SMALL, "--training.local_batch_size", "8")
    run_trainer(tmp_path / "fused", 2, *SMALL, "--training.fused_linear_ce", "true",
                "--training.fused_linear_ce_chunk", "100")
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "fused")
    assert want[3] < want[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=2e-5), step


@pytest.mark.slow
def test_trainer_fused_linear_ce_under_tp2_equals_one_process(tmp_path):
    run_trainer(tmp_path / "plain", 0, *SMALL)
    run_trainer(tmp_path / "tp", 2, *SMALL, "--parallelism.tp", "2", "--training.fused_linear_ce", "true",
                "--training.fused_linear_ce_chunk", "100")
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "tp")
    assert want[3] < want[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=2e-5), step
