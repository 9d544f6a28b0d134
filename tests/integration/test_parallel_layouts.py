"""TP, PP and their compositions with FSDP/HSDP on gloo: the same per-step losses and gradient norms as
one process (same seed, data and global batch), and checkpoints that load across layouts."""

from __future__ import annotations

import shutil

import pytest
from trainer_utils import losses, read_metrics, run_trainer

# float32 on CPU: sharded matmuls and collectives sum in another order than one process, so losses agree
# to accumulated float32 rounding (about 1e-6 relative after 5 steps), not bit for bit.
RTOL = 1e-5
GN_RTOL = 1e-4
STEPS = ["--training.steps", "5"]  # trainer_utils.TINY's, spelled out


@pytest.fixture(scope="module")
def reference(tiny_one_process):
    """The one-process run of the same job (shared with the DDP test: integration/conftest.py)."""
    return tiny_one_process


def _compare(reference, dump):
    ref, got = read_metrics(reference), read_metrics(dump)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), r["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GN_RTOL), r["step"]


def _layout(nproc: int, dp_shard: int = 1, tp: int = 1, pp: int = 1, dp_replicate: int = 1,
            schedule: str = "1F1B", virtual: int = 1, microbatches: int = 0):
    """Overrides for a layout with the reference's global batch (4 sequences)."""
    dp = dp_shard * dp_replicate
    return nproc, ["--parallelism.dp_shard", str(dp_shard), "--parallelism.dp_replicate", str(dp_replicate),
                   "--parallelism.tp", str(tp), "--parallelism.pp", str(pp), "--parallelism.pp_schedule", schedule,
                   "--parallelism.pp_virtual_stages", str(virtual), "--parallelism.pp_microbatches",
                   str(microbatches), "--training.local_batch_size", str(4 // dp)]


LAYOUTS = {
    "tp2": _layout(2, tp=2),
    "pp2_gpipe": _layout(2, pp=2, schedule="GPipe"),
    "pp2_1f1b": _layout(2, pp=2, schedule="1F1B"),
    "pp2_interleaved1f1b": _layout(2, pp=2, schedule="Interleaved1F1B", virtual=2),
    "pp2_interleaved_zb": _layout(2, pp=2, schedule="InterleavedZeroBubble", virtual=2),
    "pp2_zbv": _layout(2, pp=2, schedule="ZBVZeroBubble", virtual=2),
    "fsdp2_tp2": _layout(4, dp_shard=2, tp=2),
    "fsdp2_pp2": _layout(4, dp_shard=2, pp=2),
    "tp2_pp2": _layout(4, tp=2, pp=2),
    "hsdp2x1": _layout(2, dp_shard=1, dp_replicate=2),
    "hsdp2x2": _layout(4, dp_shard=2, dp_replicate=2),
    "fsdp2_tp2_pp2": _layout(8, dp_shard=2, tp=2, pp=2, microbatches=2),
}
# 4 and 8 processes on the 2-core CI machine: compositions whose parts are compared on 2 ranks in CI (pp2, tp2,
# hsdp2x1, and fsdp2_tp2 here; FSDP2 in test_train_fsdp_resume.py) run in the slow tier.
SLOW_LAYOUTS = {"fsdp2_pp2", "tp2_pp2", "hsdp2x2", "fsdp2_tp2_pp2"}


# FSDP2 x TP2 runs once, with a checkpoint at step 3: compared with one process here and the source of the
# cross-layout resume below.
CKPT_AT_3 = ["--checkpoint.enabled", "true", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def fsdp2_tp2_run(tmp_path_factory):
    """The fsdp2_tp2 layout, 5 steps, checkpoints at steps 3 and 5."""
    dump = tmp_path_factory.mktemp("fsdp2_tp2") / "run"
    nproc, overrides = LAYOUTS["fsdp2_tp2"]
    run_trainer(dump, nproc, *STEPS, *overrides, *CKPT_AT_3)
    return dump


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n
                                  for n in sorted(LAYOUTS)])
def test_layout_matches_single_process(request, reference, tmp_path, name):
    if name == "fsdp2_tp2":
        dump = request.getfixturevalue("fsdp2_tp2_run")
    else:
        nproc, overrides = LAYOUTS[name]
        run_trainer(tmp_path, nproc, *STEPS, *overrides)
        dump = tmp_path
    _compare(reference, dump)


@pytest.mark.parametrize("overrides, message", [
    (["--parallelism.tp", "3"], "= 3, but the world size is 2"),
    (["--parallelism.tp", "2", "--model.n_kv_heads", "1"], "does not divide model.n_kv_heads = 1"),
    (["--parallelism.pp", "2", "--model.n_layers", "1"], "fewer than the 2 pipeline stages"),
    (["--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"], "needs pp_virtual_stages = 2"),
])
def test_wrong_layout_is_one_clear_line(tmp_path, overrides, message):
    """Every rank stops with exit code 2 after one ``error:`` line (torchrun then reports the failed ranks
    with their exit codes)."""
    proc = run_trainer(tmp_path, 2, "--parallelism.dp_shard", "1", *overrides, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0], proc.stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr


def test_checkpoint_from_fsdp_tp_loads_under_pp_and_one_process(fsdp2_tp2_run, tmp_path):
    """Saved at step 3 under FSDP2 x TP2, resumed to step 5 under PP2 and under 1 process: the FSDP2 x TP2 run's
    losses of steps 4 and 5."""
    ref = losses(fsdp2_tp2_run)
    for name, (n, over) in {"pp2": LAYOUTS["pp2_1f1b"], "one": (0, [])}.items():
        dest = tmp_path / name
        shutil.copytree(fsdp2_tp2_run / "checkpoint" / "step-3", dest / "checkpoint" / "step-3")
        run_trainer(dest, n, *STEPS, *CKPT_AT_3, *over)
        got = losses(dest)
        assert sorted(got) == [4, 5], name
        for step in got:
            assert got[step] == pytest.approx(ref[step], rel=RTOL), (name, step)
