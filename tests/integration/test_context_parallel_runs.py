"""Context parallelism through the real trainer on gloo: the same per-step losses and gradient norms as one
process (same seed, data and global batch), alone and under FSDP, HSDP, TP, PP and expert parallelism, a
checkpoint saved at cp 2 that resumes in one process, and one-line refusals of the layouts it does not take;
KV sharing under CP, and Squinch gradient compression over the CP ranks."""

from __future__ import annotations

import re
import shutil

import pytest
from trainer_utils import losses, read_metrics, run_trainer

from torchtitan_ext.comm.squinch import BLOCK, BLOCK_BYTES

RTOL, GN_RTOL = 1e-5, 1e-4  # float32 on CPU: the sequence's parts sum in another order than one process
CKPT_AT_3 = ["--checkpoint.enabled", "true", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]


def _cp(cp: int, scheme: str, dp_shard: int = 1) -> list[str]:
    """Overrides for cp x dp_shard ranks with the reference's global batch (4 sequences)."""
    return ["--parallelism.cp", str(cp), "--parallelism.cp_scheme", scheme, "--parallelism.dp_shard", str(dp_shard),
            "--training.local_batch_size", str(4 // dp_shard)]


def _compare(reference, dump) -> None:
    ref, got = read_metrics(reference), read_metrics(dump)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), r["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GN_RTOL), r["step"]


@pytest.fixture(scope="module")
def fsdp2_cp2_run(tmp_path_factory):
    """FSDP 2 x CP 2 (all-to-all), 5 steps, checkpoints at steps 3 and 5."""
    dump = tmp_path_factory.mktemp("fsdp2_cp2") / "run"
    run_trainer(dump, 4, *_cp(2, "alltoall", dp_shard=2), *CKPT_AT_3)
    return dump


def test_cp2_ring_matches_single_process(tiny_one_process, tmp_path):
    run_trainer(tmp_path, 2, *_cp(2, "ring"))
    _compare(tiny_one_process, tmp_path)


def test_fsdp2_cp2_matches_single_process(tiny_one_process, fsdp2_cp2_run):
    _compare(tiny_one_process, fsdp2_cp2_run)


def test_checkpoint_saved_at_cp2_resumes_in_one_process(fsdp2_cp2_run, tmp_path):
    """Saved at step 3 under FSDP 2 x CP 2, resumed to step 5 in one process: the CP run's steps 4 and 5."""
    shutil.copytree(fsdp2_cp2_run / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    run_trainer(tmp_path, 0, *CKPT_AT_3)
    ref, got = losses(fsdp2_cp2_run), losses(tmp_path)
    assert sorted(got) == [4, 5]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=RTOL), step


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_cp2_document_masking_matches_single_process(tmp_path, scheme):
    document = ["--data.attention", "document", "--data.position_reset", "true"]
    run_trainer(tmp_path / "one", 0, *document)
    run_trainer(tmp_path / "cp", 2, *_cp(2, scheme), *document)
    _compare(tmp_path / "one", tmp_path / "cp")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_cp4_matches_single_process(tiny_one_process, tmp_path, scheme):
    run_trainer(tmp_path, 4, *_cp(4, scheme))
    _compare(tiny_one_process, tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["--parallelism.cp", "3"], "error: parallelism: dp_replicate(1) x cp(3) x tp(1) x pp(1) = 3, but the world "
                                "size is 2, not a multiple of it (dp_shard = -1 takes the ranks left)"),
    (["--parallelism.cp", "2", "--training.seq_len", "62"],
     "error: training.seq_len = 62 must be divisible by 2 x parallelism.cp = 4 (context parallelism cuts each "
     "sequence into 2 x cp equal chunks)"),
    (["--parallelism.cp", "2", "--parallelism.cp_scheme", "alltoall", "--model.n_heads", "1",
      "--model.n_kv_heads", "1"],
     "error: parallelism.cp_scheme = 'alltoall' needs the attention heads per rank (model n_heads 1 / tp 1) "
     "divisible by parallelism.cp = 2; use cp_scheme = 'ring' or another cp"),
    (["--parallelism.cp", "2", "--parallelism.dp_mode", "ddp"],
     "error: parallelism.cp = 2 needs dp_mode = 'fsdp' (FSDP shards over dp_shard x cp); dp_mode = 'ddp' does "
     "not combine with cp"),
])
def test_bad_cp_layout_is_one_clear_line(tmp_path, overrides, message):
    """Every rank stops with exit code 2 after one ``error:`` line."""
    proc = run_trainer(tmp_path, 2, "--parallelism.dp_shard", "-1", *overrides, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith(message), proc.stderr[-2000:]  # two ranks may share a line
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr
    ranks_said = proc.stderr.split("torch/distributed/elastic")[0]  # before torchrun's own report and traceback
    assert "Traceback" not in ranks_said, ranks_said


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_cp2_compiled_matches_single_process(tiny_one_process, tmp_path, scheme):
    """Compiled blocks: all-to-all inside each block's graph, the ring eager between the graphs."""
    run_trainer(tmp_path, 2, *_cp(2, scheme), "--training.compile", "true")
    _compare(tiny_one_process, tmp_path)


@pytest.mark.slow
def test_hsdp2_cp2_matches_single_process(tiny_one_process, tmp_path):
    """HSDP: FSDP shards over dp_shard x cp inside each of 2 replicas."""
    run_trainer(tmp_path, 4, *_cp(2, "ring"), "--parallelism.dp_replicate", "2", "--training.local_batch_size", "2")
    _compare(tiny_one_process, tmp_path)


def _cp_with(scheme: str, *layout: str) -> list[str]:
    """CP 2 beside another parallelism on 4 ranks, no FSDP shard ranks beyond the CP pair's."""
    return ["--parallelism.cp", "2", "--parallelism.cp_scheme", scheme, "--parallelism.dp_shard", "1", *layout]


@pytest.mark.parametrize("scheme", ["ring", pytest.param("alltoall", marks=pytest.mark.slow)])
def test_tp2_cp2_matches_single_process(tiny_one_process, tmp_path, scheme):
    """TP 2 x CP 2: each CP rank's chunk pair split again over TP's sequence-parallel ranks, attention on
    each TP rank's heads (all-to-all: 2 heads per TP rank traded over the 2 CP ranks)."""
    run_trainer(tmp_path, 4, *_cp_with(scheme, "--parallelism.tp", "2"))
    _compare(tiny_one_process, tmp_path)


@pytest.mark.slow
def test_tp2_cp2_ring_compiled_matches_single_process(tiny_one_process, tmp_path):
    """Compiled TP 2 x CP 2 with the ring: the block's norms, QK-norm + RoPE and feed-forward compiled one by
    one around the eager ring attention."""
    run_trainer(tmp_path, 4, *_cp_with("ring", "--parallelism.tp", "2"), "--training.compile", "true")
    _compare(tiny_one_process, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_pp2_cp2_matches_single_process(tiny_one_process, tmp_path, scheme):
    """PP 2 x CP 2: the stages pass the CP chunk's global positions on with the hidden states."""
    run_trainer(tmp_path, 4, *_cp_with(scheme, "--parallelism.pp", "2"))
    _compare(tiny_one_process, tmp_path)


# A Switch loss coefficient large enough that a loss over each CP rank's own tokens moves the losses past RTOL.
MODE = ["--model.flavor", "mode_debug", "--model.aux_loss_coef", "0.1"]
# Two micro-batches of 2 sequences each: the balancing loss covers one micro-batch in one process, and one
# data-parallel rank's part of the batch (the same 2 sequences) in a run with dp 2.
TWO_MICRO_BATCHES = ["--training.local_batch_size", "2", "--training.global_batch_size", "4"]


@pytest.fixture(scope="module")
def mode_one_process(tmp_path_factory):
    dump = tmp_path_factory.mktemp("mode_one_process")
    run_trainer(dump, 0, *MODE, *TWO_MICRO_BATCHES)
    return dump


def _compare_routing(reference, dump) -> None:
    """The same losses, gradient norms and expert loads (the routing of the whole sequence, summed over the
    CP ranks) as one process."""
    _compare(reference, dump)
    for r, g in zip(read_metrics(reference), read_metrics(dump), strict=True):
        assert g["moe/layers.0/imbalance"] == r["moe/layers.0/imbalance"], r["step"]


def test_mode_ep2_cp2_matches_single_process(mode_one_process, tmp_path):
    """MoDE, EP 2 x CP 2 (the experts' gradients averaged over their CP peers, the loads over every rank, the
    Switch loss over each data-parallel rank's whole sequences, as over each micro-batch in one process)."""
    run_trainer(tmp_path, 4, *MODE, *_cp(2, "ring", dp_shard=2), "--parallelism.ep", "2")
    _compare_routing(mode_one_process, tmp_path)


@pytest.mark.slow
def test_mode_cp2_compiled_matches_single_process(mode_one_process, tmp_path):
    """MoDE, CP 2 (all-to-all), compiled, over the same two micro-batches as one process: the balancing loss
    (its load fractions summed over the CP ranks inside the routing graph) and its metrics are the whole
    sequences'."""
    run_trainer(tmp_path, 2, *MODE, *_cp(2, "alltoall"), *TWO_MICRO_BATCHES, "--training.compile", "true")
    _compare_routing(mode_one_process, tmp_path)
    for r, g in zip(read_metrics(mode_one_process), read_metrics(tmp_path), strict=True):
        for key in ("moe/aux_loss", "moe/router_z_loss"):
            assert g[key] == pytest.approx(r[key], rel=RTOL), (key, r["step"])


KV_SHARE = ["--model.kv_share", "interleaved"]  # layers 1 and 3 attend over the K/V of layers 0 and 2


@pytest.fixture(scope="module")
def kv_share_one_process(tmp_path_factory):
    dump = tmp_path_factory.mktemp("kv_share_one_process")
    run_trainer(dump, 0, *KV_SHARE)
    return dump


@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_cp2_kv_share_matches_single_process(kv_share_one_process, tmp_path, scheme):
    """Interleaved KV sharing: a consumer layer's core takes its producer's local K/V (the ring passes them
    around and hands their gradient back; the all-to-all trades their heads), so the producer's wk / wv get
    the consumer's share of the gradient as in one process."""
    run_trainer(tmp_path, 2, *_cp(2, scheme), *KV_SHARE)
    _compare(kv_share_one_process, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_cp2_kv_share_compiled_selective_ac_matches_single_process(kv_share_one_process, tmp_path, scheme):
    """KV sharing under CP with compiled blocks and op-level selective AC: the shared K/V leave one block's
    graph and enter the next one's, and the recomputed forward hands the consumer the same K/V."""
    run_trainer(tmp_path, 2, *_cp(2, scheme), *KV_SHARE, "--training.compile", "true",
                "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_every", "0")
    _compare(kv_share_one_process, tmp_path)


SQUINCH_RTOL = 0.02  # a Squinch run's loss against the uncompressed one's (test_squinch_train.py)
FP32_RATIO = BLOCK_BYTES / (BLOCK * 4)  # 6 bytes per 8 float32 values


def test_cp2_squinch_tracks_the_uncompressed_run(tiny_one_process, tmp_path):
    """Squinch on FSDP's reduce-scatter over dp_shard x cp (here the CP pair): every rank hands its whole
    unsharded gradient in 6/32 of its float32 bytes; the first loss is the uncompressed run's (same weights and
    data), the later ones differ (the compressed gradients reached the weights) but stay within 2% of it, and
    the loss falls. The uncompressed reference is one process, equal to the uncompressed CP run
    (test_cp2_ring_matches_single_process)."""
    proc = run_trainer(tmp_path, 2, *_cp(2, "ring"), "--comm.gradient_compression", "squinch")
    assert proc.stdout.count("gradient compression: Squinch on the FSDP2 reduce-scatter over dp_shard x cp = 2 "
                             "ranks") == 1
    n_params = int(re.search(r"model debug: ([\d,]+) parameters", proc.stdout)[1].replace(",", ""))
    plain, squinch = read_metrics(tiny_one_process), read_metrics(tmp_path)
    assert [r["step"] for r in squinch] == [1, 2, 3, 4, 5]
    assert squinch[0]["loss"] == pytest.approx(plain[0]["loss"], rel=RTOL)
    assert any(s["loss"] != pytest.approx(p["loss"], rel=RTOL) for p, s in zip(plain[1:], squinch[1:], strict=True))
    for p, s in zip(plain, squinch, strict=True):
        assert s["loss"] == pytest.approx(p["loss"], rel=SQUINCH_RTOL), s["step"]
        assert s["comm/bytes_uncompressed"] == 4 * n_params
        assert s["comm/bytes_sent"] == pytest.approx(FP32_RATIO * s["comm/bytes_uncompressed"], rel=1e-3)
    assert squinch[-1]["loss"] < 0.7 * squinch[0]["loss"]


@pytest.mark.slow
def test_hsdp2_cp2_squinch_compresses_the_replicate_all_reduce(tiny_one_process, tmp_path):
    """HSDP 2 x CP 2 with Squinch: FSDP shards over the CP pair, natively reduce-scattered, and the replicas'
    all-reduce of each rank's shard (half the parameters) goes in Squinch bytes; the losses track the
    uncompressed run as above."""
    proc = run_trainer(tmp_path, 4, *_cp(2, "ring"), "--parallelism.dp_replicate", "2",
                       "--training.local_batch_size", "2", "--comm.gradient_compression", "squinch")
    assert proc.stdout.count("gradient compression: Squinch on the all-reduce over dp_replicate = 2 (per module, "
                             "overlapped with the backward); the reduce-scatter over dp_shard x cp = 2 stays "
                             "uncompressed") == 1
    n_params = int(re.search(r"model debug: ([\d,]+) parameters", proc.stdout)[1].replace(",", ""))
    plain, squinch = read_metrics(tiny_one_process), read_metrics(tmp_path)
    assert squinch[0]["loss"] == pytest.approx(plain[0]["loss"], rel=RTOL)
    for p, s in zip(plain, squinch, strict=True):
        assert s["loss"] == pytest.approx(p["loss"], rel=SQUINCH_RTOL), s["step"]
        assert s["comm/bytes_uncompressed"] == pytest.approx(4 * n_params / 2, rel=1e-3)
        assert s["comm/bytes_sent"] == pytest.approx(FP32_RATIO * s["comm/bytes_uncompressed"], rel=1e-3)
