"""MoDE under tensor parallelism (TP for attention): each TP rank routes its own slice of the sequence, the
MoDE parameters are sharded over data-parallel x TP ranks (replicated over dp_replicate under HSDP), and with
EP the experts over ep x tp ranks. The per-step losses and gradient norms equal one process's (same seed, data
and global batch).

The Switch balancing loss is a product of per-group statistics: over TP's sequence slices its load
fractions are summed (parallel/sequence_balance.py), but data-parallel ranks each take their own batch's, so
it is off here, where the layouts split the batch differently (the router z-loss, a mean over tokens, stays
on), but for TP 2 alone, which takes one process's batch. EP at the same data-parallel degree with the
Switch loss on is covered in test_expert_parallel.py.
"""

from __future__ import annotations

import re

import pytest
from trainer_utils import read_metrics, run_trainer

RTOL = 1e-5  # float32 sums in another order than one process (see test_parallel_layouts.py)
GN_RTOL = 1e-4
MODE = ["--model.flavor", "mode_debug", "--model.aux_loss_coef", "0", "--training.steps", "4"]
LAYOUTS = {  # name: (processes, overrides); 4 sequences per step in each
    "tp2": (2, ["--parallelism.tp", "2", "--parallelism.dp_shard", "1", "--training.local_batch_size", "4"]),
    "fsdp2_tp2": (4, ["--parallelism.tp", "2", "--parallelism.dp_shard", "2", "--training.local_batch_size", "2"]),
    "fsdp2_ep2_tp2": (4, ["--parallelism.tp", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                          "--training.local_batch_size", "2"]),
    # HSDP: the MoDE parameters are replicated over dp_replicate and sharded over dp_shard x tp.
    "hsdp2_tp2": (4, ["--parallelism.tp", "2", "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                      "--training.local_batch_size", "2"]),
    "hsdp2_fsdp2_ep2_tp2": (8, ["--parallelism.tp", "2", "--parallelism.dp_replicate", "2",
                                "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
                                "--training.local_batch_size", "1"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("mode_one")
    run_trainer(dump, 0, *MODE, "--training.local_batch_size", "4")
    return read_metrics(dump)


def _assert_matches_reference(reference: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for r, g in zip(reference, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), r["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GN_RTOL), r["step"]
        assert g["moe/layers.0/imbalance"] == r["moe/layers.0/imbalance"]  # loads summed over every slice


# 8 processes, and FSDP2 x TP2 whose parts run in CI (tp2 here, fsdp2_ep2_tp2 shards the same MoDE parameters
# over dp x tp): the slow tier.
SLOW_LAYOUTS = {"fsdp2_tp2", "hsdp2_fsdp2_ep2_tp2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n
                                  for n in sorted(LAYOUTS)])
def test_mode_under_tp_matches_one_process(reference, tmp_path, name):
    nproc, overrides = LAYOUTS[name]
    run_trainer(tmp_path, nproc, *MODE, *overrides)
    _assert_matches_reference(reference, read_metrics(tmp_path))


# CI runs TP 2 on a cold cache; the warm-cache rerun (another minute of compiling) and EP under TP: the slow tier.
@pytest.mark.parametrize("name,runs", [pytest.param("tp2", ("cold_cache",), id="tp2-cold_cache"),
                                       pytest.param("tp2", ("cold_cache", "warm_cache"), marks=pytest.mark.slow,
                                                    id="tp2-warm_cache"),
                                       pytest.param("fsdp2_ep2_tp2", ("cold_cache", "warm_cache"),
                                                    marks=pytest.mark.slow, id="fsdp2_ep2_tp2-warm_cache")])
def test_compiled_mode_under_tp_matches_one_process(reference, tmp_path, monkeypatch, name, runs):
    """Compiled, a MoDE block under TP or EP runs its experts eagerly between graphs (parallel/compile.py).
    The slow tier runs the job twice on one inductor cache: a warm cache once gave TP ranks wrong gradients."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    nproc, overrides = LAYOUTS[name]
    for run in runs:
        run_trainer(tmp_path / run, nproc, *MODE, *overrides, "--training.compile", "true")
        _assert_matches_reference(reference, read_metrics(tmp_path / run))


@pytest.mark.slow
def test_tp2_with_the_switch_loss_matches_one_process(tmp_path):
    """TP 2 on one data-parallel rank takes the whole batch, as one process does: with the Switch balancing loss
    on (its load fractions summed over the two sequence slices) the losses and gradient norms equal one
    process's."""
    switch = ["--model.aux_loss_coef", "0.1"]
    run_trainer(tmp_path / "one", 0, *MODE, *switch, "--training.local_batch_size", "4")
    run_trainer(tmp_path / "tp2", LAYOUTS["tp2"][0], *MODE, *switch, *LAYOUTS["tp2"][1])
    reference, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp2")
    _assert_matches_reference(reference, got)
    assert all(r["moe/aux_loss"] > 0 for r in reference)
    for r, g in zip(reference, got, strict=True):
        assert g["moe/aux_loss"] == pytest.approx(r["moe/aux_loss"], rel=RTOL)


def test_experts_must_divide_over_ep_and_tp(tmp_path):
    proc = run_trainer(tmp_path, 4, *MODE, "--parallelism.tp", "2", "--parallelism.dp_shard", "2",
                       "--parallelism.ep", "2", "--model.n_experts", "6", "--training.local_batch_size", "2",
                       check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and "parallelism.ep x tp = 2 x 2 does not divide model.n_experts = 6" in errors[0], \
        proc.stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr  # one clean line, no trace


def test_pipeline_stages_report_every_layer_and_all_gradient_bytes(tmp_path):
    """Under PP each stage measures its own MoDE layers and gradient bytes; rank 0's log merges them."""
    proc = run_trainer(tmp_path, 4, *MODE, "--training.steps", "2", "--parallelism.pp", "2",
                       "--parallelism.dp_shard", "2", "--training.local_batch_size", "2",
                       "--comm.gradient_compression", "squinch")
    n_params = int(re.search(r"model mode_debug: ([\d,]+) parameters", proc.stdout)[1].replace(",", ""))
    for record in read_metrics(tmp_path):
        assert all(f"moe/layers.{i}/imbalance" in record for i in range(4))  # layers 0-1 and 2-3
        # every rank hands its whole unsharded float32 gradient to the reduce-scatter: both stages together
        # hold every parameter once
        assert record["comm/bytes_uncompressed"] == 4 * n_params
