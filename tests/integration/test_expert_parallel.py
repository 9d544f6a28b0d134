"""MoDE in the trainer: expert parallelism equals EP1 at the same data-parallel degree (eager, compiled, under
HSDP), checkpoints load across EP degrees. (Balancing and the MoDE layer in one process: unit/models/test_mode.py;
dropless routing against a per-token reference: unit/models/test_decoder.py.)

The Switch balancing loss is computed from each rank's own tokens, so runs are compared at the same
data-parallel degree: EP only moves the expert computation, never the losses.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from trainer_utils import losses, read_metrics, run_trainer

from torchtitan_ext.models.flavors import FLAVORS
from torchtitan_ext.models.param_count import count_params

RTOL = 1e-5
MODE = ["--model.flavor", "mode_debug", "--training.steps", "5"]


@pytest.fixture(scope="module")
def ep1_runs(tmp_path_factory):
    """The EP1 run at a data-parallel degree (2 or 4 processes, 4 sequences a step), trained on first use: the
    4-process one only for the slow tier."""
    runs = {}

    def run(nproc: int):
        if nproc not in runs:
            dump = tmp_path_factory.mktemp(f"ep1_dp{nproc}")
            run_trainer(dump, nproc, *MODE, "--training.local_batch_size", str(4 // nproc))
            runs[nproc] = dump
        return runs[nproc]

    return run


# The EP2 run on 2 ranks with checkpoints at steps 3 and 5: compared with EP1, and its step-3 checkpoint resumed
# at EP1.
CKPT_AT_3 = ["--checkpoint.enabled", "true", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ep2") / "run"
    proc = run_trainer(dump, 2, *MODE, "--training.local_batch_size", "2", "--parallelism.ep", "2", *CKPT_AT_3)
    return dump, proc.stdout


def _assert_matches_ep1(ref: list[dict], got: list[dict]) -> None:
    assert len(got) == 5
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert g["moe/layers.0/imbalance"] == r["moe/layers.0/imbalance"]  # the same routing


@pytest.mark.parametrize("nproc, ep", [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow),
                                       pytest.param(4, 2, marks=pytest.mark.slow)])
def test_expert_parallel_matches_ep1(request, ep1_runs, tmp_path, nproc, ep):
    if (nproc, ep) == (2, 2):
        dump = request.getfixturevalue("ep2_run")[0]
    else:
        run_trainer(tmp_path, nproc, *MODE, "--training.local_batch_size", str(4 // nproc),
                    "--parallelism.ep", str(ep))
        dump = tmp_path
    _assert_matches_ep1(read_metrics(ep1_runs(nproc)), read_metrics(dump))


# Under EP every MoDE block is recomputed in full whichever AC mode is set (op-level selective checkpointing
# cannot wrap its FSDP units: parallel/activation_checkpoint.py), and every mode_debug block is a MoDE block:
# the full-AC run wraps the blocks exactly as the selective one does (which also takes the fallback). Both are
# in the slow tier: compiling on 2 CPU cores costs over a minute, and compiled EP 2 / EP 4 (with and without
# activation checkpointing) = EP 1 runs on NCCL in the multigpu tier (tests/multigpu/test_ep_nccl.py).
@pytest.mark.slow
@pytest.mark.parametrize("ac", ["selective", "full"])
def test_compiled_expert_parallel_matches_ep1(ep1_runs, tmp_path, ac):
    """Compiled under EP, a MoDE block's attention, routing and combine are graphs and the experts (all-to-all,
    their own FSDP unit) run eagerly between them; with activation checkpointing the block, all-to-alls
    included, is recomputed. The final evaluation compiles the eval-mode graphs."""
    proc = run_trainer(tmp_path, 2, *MODE, "--training.local_batch_size", "2", "--parallelism.ep", "2",
                       "--training.compile", "true", "--activation_checkpoint.mode", ac, "--eval.steps", "2")
    fallback = "activation_checkpoint: MoDE blocks under EP/TP are recomputed in full"
    assert (fallback in proc.stdout + proc.stderr) == (ac == "selective")
    ref, got = read_metrics(ep1_runs(2)), read_metrics(tmp_path)
    assert len(got) == 5
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL)
        assert g["moe/layers.0/imbalance"] == r["moe/layers.0/imbalance"]


def test_checkpoint_saved_at_ep2_loads_at_ep1(ep2_run, tmp_path):
    src, stdout = ep2_run
    # The start-up line gives total and active parameters (byte tokenizer: 257 ids, padded to 320).
    counts = count_params(dataclasses.replace(FLAVORS["mode_debug"], vocab_size=320))
    assert (f"model mode_debug: {counts['total']:,} parameters ({counts['active']:,} active per token"
            in stdout), stdout[:2000]
    dest = tmp_path / "ep1"
    shutil.copytree(src / "checkpoint" / "step-3", dest / "checkpoint" / "step-3")
    run_trainer(dest, 2, *MODE, "--training.local_batch_size", "2", *CKPT_AT_3)
    ref, got = losses(src), losses(dest)
    assert sorted(got) == [4, 5]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=RTOL)


def test_expert_parallel_under_hsdp_matches_ep1(tmp_path):
    """HSDP 2 x 2 (4 processes): 3 steps, so two updates through the EP gradients are compared."""
    hsdp = [*MODE, "--training.steps", "3", "--training.local_batch_size", "1", "--parallelism.dp_replicate", "2"]
    run_trainer(tmp_path / "ep1", 4, *hsdp)
    run_trainer(tmp_path / "ep2", 4, *hsdp, "--parallelism.ep", "2")
    ref, got = losses(tmp_path / "ep1"), losses(tmp_path / "ep2")
    assert sorted(ref) == [1, 2, 3]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=RTOL), step
