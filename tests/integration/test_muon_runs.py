"""Muon in the trainer: FSDP2 and TP2 equal one process and resume exactly; on a tiny debug model it reaches AdamW's
300-step loss sooner."""

from __future__ import annotations

import shutil

import pytest
from trainer_utils import losses, run_trainer

MUON = ["--optimizer.name", "muon", "--model.dim", "64", "--model.n_layers", "2", "--model.ffn_hidden", "128",
        "--training.steps", "6"]


def test_muon_fsdp2_tp2_equal_one_process_and_resume(tmp_path):
    run_trainer(tmp_path / "one", 0, *MUON, "--training.local_batch_size", "8")
    run_trainer(tmp_path / "fsdp", 2, *MUON, "--checkpoint.enabled", "true", "--checkpoint.interval", "3",
                "--checkpoint.keep_latest_k", "0")
    run_trainer(tmp_path / "tp", 2, *MUON, "--training.local_batch_size", "8", "--parallelism.tp", "2")
    one, fsdp, tp = losses(tmp_path / "one"), losses(tmp_path / "fsdp"), losses(tmp_path / "tp")
    assert one[6] < one[1]
    for step in range(1, 7):
        assert fsdp[step] == pytest.approx(one[step], abs=2e-5), step
        assert tp[step] == pytest.approx(one[step], abs=2e-5), step
    # Resume FSDP2 from step 3 (Muon momentum and AdamW moments from the checkpoint): steps 4-6 are exact.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "fsdp" / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    run_trainer(resumed, 2, *MUON, "--checkpoint.enabled", "true", "--checkpoint.interval", "3")
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step] == fsdp[step], step


@pytest.mark.slow
def test_muon_reaches_adamw_300_step_loss_sooner(tmp_path):
    """Each optimizer at its better learning rate of {3e-3, 1e-2} (AdamW) / {1e-2, 2e-2} (Muon), measured by
    hand; the 20-step mean training loss is compared (single-batch losses are noisy)."""
    tiny = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_hidden", "128", "--training.steps", "300"]
    run_trainer(tmp_path / "adamw", 0, *tiny, "--optimizer.name", "adamw", "--optimizer.lr", "1e-2")
    run_trainer(tmp_path / "muon", 0, *tiny, "--optimizer.name", "muon", "--optimizer.lr", "2e-2")

    def smoothed(d):
        loss = losses(d)
        return {s: sum(loss[i] for i in range(s - 19, s + 1)) / 20 for s in range(20, 301)}

    adamw, muon = smoothed(tmp_path / "adamw"), smoothed(tmp_path / "muon")
    reached = min(s for s in muon if muon[s] <= adamw[300])
    print(f"Muon reaches AdamW's 300-step loss {adamw[300]:.4f} at step {reached}")
    assert reached <= 200  # measured: step 141
