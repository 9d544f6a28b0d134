"""muP in the trainer: FSDP2, TP2 and the fused head + loss equal one process; resume is exact."""

from __future__ import annotations

import shutil

import pytest
from trainer_utils import losses, read_metrics, run_trainer

# The trainer: the debug model (dim 256) at 4x its base width 64; warmup-stable-decay, so the lr decays over
# the last steps of the 10-step runs (the resumed run's too) while steps 1..4 of a 5-step run match the
# 10-step run's (each step's loss comes before its update).
MUP = ["--model.parametrization", "mup", "--model.mup_base_dim", "64", "--lr_scheduler.name", "wsd"]
RTOL, GN_RTOL = 1e-5, 1e-4  # float32 sums in another order across ranks (integration/test_parallel_layouts.py)


@pytest.fixture(scope="module")
def mup_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("mup_one")
    run_trainer(dump, 0, *MUP, "--training.steps", "10", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0")
    return dump


@pytest.mark.parametrize("nproc, layout", [
    (2, ["--training.local_batch_size", "2"]), (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]),
    (0, ["--training.fused_linear_ce", "true"])], ids=["fsdp2", "tp2", "fused_linear_ce"])
def test_mup_layouts_match_one_process(mup_run, tmp_path, nproc, layout):
    """FSDP2 and TP2 (loss parallel), and the fused head + loss, which takes the head's input already
    multiplied (``Decoder.head_input``), all equal the one-process run."""
    run_trainer(tmp_path, nproc, *MUP, "--training.steps", "5", *layout)
    ref, got = read_metrics(mup_run)[:5], read_metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), r["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GN_RTOL), r["step"]


def test_mup_resume_is_exact(mup_run, tmp_path):
    shutil.copytree(mup_run / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    run_trainer(tmp_path, 0, *MUP, "--training.steps", "10", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "5")
    ref, resumed = losses(mup_run), losses(tmp_path)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for step in resumed:
        assert abs(resumed[step] - ref[step]) <= 1e-6, step
    assert losses(mup_run)[10] < losses(mup_run)[1] - 1.0  # it learns
