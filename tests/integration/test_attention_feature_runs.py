"""Document masking, attention / output Z-regularisation and interleaved KV sharing in the trainer: every layout
against one process (gloo), the logged loss, tree data that resumes exactly, one-line refusals."""

from __future__ import annotations

import math
import shutil

import pytest
from data_builders import write_trees
from trainer_utils import losses, read_metrics, run_trainer

ALL = ["--data.attention", "document", "--data.position_reset", "true", "--training.attention_z_reg", "0.05",
       "--training.output_z_reg", "0.01", "--model.kv_share", "interleaved"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    dump = tmp_path_factory.mktemp("attn") / "one"
    run_trainer(dump, 0, *ALL, "--training.steps", "6")
    return dump


def _close(a: dict, b: dict, tol: float = 2e-4):
    assert a.keys() == b.keys() and len(a) >= 5
    for step in a:
        assert abs(a[step] - b[step]) < tol, (step, a, b)


def test_all_options_train_and_log_lse(one_process):
    steps = losses(one_process)
    assert steps[6] < steps[1] - 1.0  # a KV-shared, document-masked, Z-regularised model learns
    rec = read_metrics(one_process)[-1]
    assert {f"attn/lse/{i}" for i in range(4)} <= rec.keys() and all(math.isfinite(rec[f"attn/lse/{i}"])
                                                                       for i in range(4))


def test_zreg_leaves_logged_loss(one_process, tmp_path):
    """Same model and data without the gradient-only regularisers: the first step's loss (same weights) is
    identical, and later ones differ (the regularisers did change the gradients)."""
    run_trainer(tmp_path, 0, *ALL[:4], *ALL[-2:], "--training.steps", "3")
    plain, reg = losses(tmp_path), losses(one_process)
    assert plain[1] == reg[1]
    assert plain[3] != reg[3]


@pytest.mark.parametrize("nproc, layout", [
    (2, ["--training.local_batch_size", "2"]), (2, ["--parallelism.tp", "2"]),
    (0, ["--activation_checkpoint.mode", "full"]),
    pytest.param(0, ["--training.compile", "true", "--activation_checkpoint.mode", "selective"],
                 marks=pytest.mark.slow)], ids=["fsdp2", "tp2", "ac_full", "compile_sac"])
def test_all_options_layouts_equal_one_process(one_process, tmp_path, nproc, layout):
    run_trainer(tmp_path, nproc, *ALL, "--training.steps", "6", *layout)
    _close(losses(tmp_path), losses(one_process))


@pytest.mark.slow
def test_all_options_fsdp2_tp2_and_pp2_equal_one_process(one_process, tmp_path):
    """KV sharing with masks and Z-reg under FSDP2 x TP2 (4 processes), and PP2, whose stages pass the
    micro-batch's mask and positions on."""
    run_trainer(tmp_path / "fsdp_tp", 4, *ALL, "--training.steps", "6", "--training.local_batch_size", "2",
                "--parallelism.tp", "2")
    _close(losses(tmp_path / "fsdp_tp"), losses(one_process))
    run_trainer(tmp_path / "pp", 2, *ALL, "--training.steps", "6", "--parallelism.pp", "2")
    _close(losses(tmp_path / "pp"), losses(one_process))
    bad = run_trainer(tmp_path / "bad", 2, *ALL, "--parallelism.pp", "2", "--parallelism.pp_split_points",
                      "layers.1", check=False)
    assert bad.returncode != 0 and "error: model.kv_share = 'interleaved' (groups of 2): a pipeline stage starts " \
        "at layer 1" in bad.stdout + bad.stderr


def test_bad_options_one_line(tmp_path):
    for extra, words in ((["--data.attention", "trees"], "data.attention"),
                         (["--data.position_reset", "true"], "position_reset"),
                         (["--training.attention_z_reg", "-1"], "attention_z_reg"),
                         (["--model.kv_share_group", "0"], "kv_share_group")):
        proc = run_trainer(tmp_path, 0, *extra, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().count("\n") == 0 and words in proc.stderr, proc.stderr


def test_tree_data_trains_and_resumes_exactly(tmp_path):
    from torchtitan_ext.data.prepare.__main__ import trees_main as prepare_main

    write_trees(tmp_path / "t.jsonl", 60, 1)
    from torchtitan_ext.data.prepare.__main__ import main as data_prepare

    assert data_prepare(["--trees", "--input", str(tmp_path / "t.jsonl"), "--output-dir", str(tmp_path / "data"),
                         "--tokenizer", "byte"]) == 0
    data = ["--data.dataset", "trees", "--data.train_path", str(tmp_path / "data"), "--data.attention", "tree",
            "--data.position_reset", "true", "--checkpoint.enabled", "true", "--checkpoint.interval", "3",
            "--training.attention_z_reg", "0.01"]
    run_trainer(tmp_path / "full", 0, *data, "--training.steps", "6")
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    run_trainer(tmp_path / "resumed", 0, *data, "--training.steps", "6")
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6] and all(full[s] == resumed[s] for s in (4, 5, 6)), (full, resumed)
    assert full[6] < full[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nodes": [{"id": 1, "parent": 2, "text": "x"}, {"id": 2, "parent": 1, "text": "y"}]}\n')
    assert prepare_main(["--input", str(bad), "--output-dir", str(tmp_path / "bad")]) == 2


def test_zreg_weighted_like_the_loss_under_batch_warmup(tmp_path):
    """Batch warmup holding every step at one of two micro-batches trains exactly like a run whose global
    batch is that one micro-batch, with attention Z-reg on: the Z-reg gradient is weighted by the step's own
    micro-batch count (it once kept the full batch's 1/2). A run without Z-reg shows the term matters."""
    common = ["--training.steps", "3", "--lr_scheduler.name", "constant", "--lr_scheduler.warmup_steps", "0",
              "--optimizer.lr", "1e-2"]
    zreg = ["--training.attention_z_reg", "0.05"]
    run_trainer(tmp_path / "warm", 0, *common, *zreg, "--training.global_batch_size", "8",
                       "--training.batch_warmup_tokens", "1000000000", "--training.batch_warmup_start", "1")
    assert all(r["micro_batches"] == 1 for r in read_metrics(tmp_path / "warm"))
    run_trainer(tmp_path / "one", 0, *common, *zreg)
    run_trainer(tmp_path / "plain", 0, *common)
    with_warmup, one, plain = losses(tmp_path / "warm"), losses(tmp_path / "one"), losses(tmp_path / "plain")
    assert abs(plain[3] - one[3]) > 1e-4, (plain, one)
    for step in (1, 2, 3):
        assert with_warmup[step] == pytest.approx(one[step], rel=1e-6, abs=1e-6), (with_warmup, one)
