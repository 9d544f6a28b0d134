"""Experts placed by load in the trainer (``parallelism.ep_rebalance_steps``, 2 gloo processes, EP 2): the
losses equal the run that never moves an expert, experts do move, a checkpoint saved after moves resumes
with the same losses (checkpoints hold the experts in their own order), and a layout the placement cannot
serve is one line."""

from __future__ import annotations

import shutil

import pytest
from trainer_utils import losses, read_metrics, run_trainer

EP2 = ["--model.flavor", "mode_debug", "--training.local_batch_size", "2", "--parallelism.ep", "2",
       "--metrics.log_freq", "2"]
CKPT = ["--checkpoint.enabled", "true", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def still(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ep2_still")
    run_trainer(dump, 2, *EP2, "--training.steps", "8")
    return dump


def test_placement_moves_experts_and_keeps_the_losses(still, tmp_path):
    whole = tmp_path / "whole"
    run_trainer(whole, 2, *EP2, *CKPT, "--training.steps", "8", "--parallelism.ep_rebalance_steps", "2")
    assert losses(whole) == pytest.approx(losses(still), rel=1e-6)
    placed = read_metrics(whole)
    moved = [m["moe/placement/experts_moved"] for m in placed if "moe/placement/experts_moved" in m]
    assert len(moved) == 4 and sum(moved) > 0
    for m in placed:
        if "moe/placement/experts_moved" in m:
            assert m["moe/placement/top_rank_share_after"] <= m["moe/placement/top_rank_share_before"]

    # the step-4 checkpoint, saved right after a move, continued in a fresh folder to step 8
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(whole / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    run_trainer(resumed, 2, *EP2, *CKPT, "--training.steps", "8", "--parallelism.ep_rebalance_steps", "2")
    assert losses(resumed) == pytest.approx({s: v for s, v in losses(whole).items() if s > 4}, rel=1e-6)


def test_placement_needs_experts_on_one_rank_each(tmp_path):
    proc = run_trainer(tmp_path, 0, "--model.flavor", "mode_debug", "--training.steps", "2",
                       "--parallelism.ep_rebalance_steps", "2", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "parallelism.ep_rebalance_steps = 2 needs expert parallelism over every data-parallel rank" in errors[0]
    assert "Traceback" not in proc.stderr and "step      1" not in proc.stdout
