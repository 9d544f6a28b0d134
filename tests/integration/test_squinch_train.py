"""Squinch gradient compression in the real trainer: 150 steps of the debug model, 2 gloo processes.

For FSDP (``dp_mode = "fsdp"``, the FSDP2 reduce-scatter) and DDP (``dp_mode = "ddp"``, the comm hook), one
uncompressed and one Squinch run with the same seed and data: the final loss agrees within 2%, and
``metrics.jsonl`` reports per step the Squinch bytes sent next to the uncompressed float32 bytes they replace.
Those four 150-step runs take minutes on a 2-core CPU, hence ``slow``; a few-step run per mode
checks the wiring in the fast suite. With error feedback, a run resumed from a checkpoint continues exactly
as the uninterrupted one (each rank's residuals are saved beside the checkpoint), and one resumed under
another layout restarts its residuals from zero and says so.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from trainer_utils import losses, read_metrics, run_trainer

from torchtitan_ext.comm.squinch import BLOCK, BLOCK_BYTES
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.data.tokenizers import ByteTokenizer
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import resolve_model_args

STEPS = 150
WORLD = 2
MIN_NUMEL = 1024  # comm.min_numel's default, passed explicitly since the byte counts depend on it
COMMON = ["--training.steps", str(STEPS), "--metrics.log_freq", "1", "--job.seed", "0",
          "--comm.min_numel", str(MIN_NUMEL)]
MODES = {"fsdp": [], "ddp": ["--parallelism.dp_mode", "ddp"]}
# The final loss: mean of the losses of the last 30 steps (121..150). Step to step, two runs' losses differ by
# up to ~3% (their weights drift apart and one batch's loss is noisy); over the last 30 steps Squinch and
# uncompressed runs differed by 0.42% (FSDP) and 0.67% (DDP) on the CPU machine.
LAST_STEPS = 30
FP32_RATIO = BLOCK_BYTES / (BLOCK * 4)  # 6 bytes per 8 float32 values = 6/32


@pytest.fixture(scope="module", params=list(MODES))
def runs(request, tmp_path_factory) -> dict:
    mode = request.param
    root = tmp_path_factory.mktemp(f"squinch_{mode}")
    out = {"mode": mode}
    for name, extra in (("plain", []), ("squinch", ["--comm.gradient_compression", "squinch"])):
        proc = run_trainer(root / name, WORLD, *COMMON, *MODES[mode], *extra)
        out[name] = {"dump": root / name, "stdout": proc.stdout, "metrics": read_metrics(root / name)}
    return out


def _final_loss(records: list[dict]) -> float:
    assert [r["step"] for r in records[-LAST_STEPS:]] == list(range(STEPS - LAST_STEPS + 1, STEPS + 1))
    return sum(r["loss"] for r in records[-LAST_STEPS:]) / LAST_STEPS


def _model(dump: Path) -> Decoder:
    """The model this run trained (from its config.toml), on the meta device."""
    cfg = parse_args(["--config", str(dump / "config.toml")])
    with torch.device("meta"):
        return Decoder(resolve_model_args(cfg, ByteTokenizer.vocab_size))


@pytest.mark.slow
def test_final_loss_within_two_percent(runs: dict) -> None:
    plain, squinch = _final_loss(runs["plain"]["metrics"]), _final_loss(runs["squinch"]["metrics"])
    print(f"{runs['mode']}: final loss plain {plain:.4f}, squinch {squinch:.4f} ({100 * (squinch / plain - 1):+.2f}%)")
    assert abs(squinch - plain) <= 0.02 * plain, f"{runs['mode']}: squinch {squinch:.4f} vs plain {plain:.4f}"
    assert plain < 0.5 * math.log(ByteTokenizer.vocab_size)  # both learned: a uniform guess scores ln(257)


@pytest.mark.slow
def test_bytes_per_step(runs: dict) -> None:
    """bytes_sent is 6/32 of bytes_uncompressed for the compressed gradients; the rest is counted 1:1.

    DDP: a bucket's gradients below ``min_numel`` (the norm weights) are all-reduced as they are, so
    ``sent = small + 6/32 (uncompressed - small)`` exactly, ``small`` being their float32 bytes; the
    compressed chunks are whole blocks of 8, and the uncompressed count covers the same padded chunks
    (between two ranks one all-gather of the whole bucket; more: all-to-all of ``world`` chunks plus
    all-gather of one).
    FSDP: each module's flat gradient (one reduce-scatter per block and one for the root, all above
    ``min_numel``) is compressed; every rank's row of it is encoded on its own and rounded up to a whole
    block, at most 6 bytes over 6/32 per row: ``0 <= sent - 6/32 uncompressed <= modules x world x 6``.
    """
    assert all("comm/bytes_sent" not in r for r in runs["plain"]["metrics"])
    records = runs["squinch"]["metrics"]
    assert len(records) == STEPS and all("comm/bytes_sent" in r for r in records)
    model = _model(runs["squinch"]["dump"])
    numels = [p.numel() for p in model.parameters()]
    n_params = int(re.search(r"model debug: ([\d,]+) parameters", runs["squinch"]["stdout"])[1].replace(",", ""))
    assert sum(numels) == n_params
    for r in records:
        sent, uncompressed = r["comm/bytes_sent"], r["comm/bytes_uncompressed"]
        if runs["mode"] == "ddp":
            small = 4 * sum(n for n in numels if n < MIN_NUMEL)
            assert small > 0
            assert sent - small == pytest.approx(FP32_RATIO * (uncompressed - small), rel=1e-12)
            # two ranks: one all-gather of each bucket's large gradients, padded to whole blocks (more ranks:
            # all-to-all of world chunks + all-gather of one, (world + 1) / world of those bytes)
            large = 4 * sum(n for n in numels if n >= MIN_NUMEL)
            share = 1 if WORLD == 2 else (WORLD + 1) / WORLD
            assert share * large <= uncompressed - small <= share * large * 1.001
        else:
            n_modules = len(model.layers) + 1  # fully_shard on every block and on the root
            # Every rank hands over its whole unsharded gradient (all dim-0 sizes are even: no FSDP padding).
            assert uncompressed == 4 * n_params
            assert 0 <= sent - FP32_RATIO * uncompressed <= n_modules * WORLD * BLOCK_BYTES
    last = records[-1]
    print(f"{runs['mode']}: {last['comm/bytes_sent']:,.0f} bytes sent / {last['comm/bytes_uncompressed']:,.0f} "
          f"uncompressed per step")



@pytest.mark.parametrize("mode", list(MODES))
def test_wiring_reports_bytes(request, mode: str) -> None:
    """The trainer installs Squinch (with error feedback) and logs the bytes of every step: the uninterrupted
    8-step runs of the error-feedback tests below."""
    straight = request.getfixturevalue(f"ef_{mode}")
    assert straight.with_suffix(".stdout").read_text().count("gradient compression: Squinch on the") == 1
    records = read_metrics(straight)
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        ratio = r["comm/bytes_sent"] / r["comm/bytes_uncompressed"]
        assert FP32_RATIO <= ratio < FP32_RATIO * 1.01  # the small norm weights (DDP) go uncompressed


def test_nothing_to_compress_on_one_rank(tmp_path: Path) -> None:
    proc = run_trainer(tmp_path, 0, "--training.steps", "2", "--comm.gradient_compression", "squinch")
    assert proc.stdout.count("has nothing to compress") == 1
    assert all("comm/bytes_sent" not in r for r in read_metrics(tmp_path))


def test_hsdp_compresses_the_replicate_all_reduce_only(tiny_one_process: Path, tmp_path: Path) -> None:
    """HSDP 2 x 2: only the all-reduce over dp_replicate goes through Squinch (per module, overlapped with the
    backward), the reduce-scatter over dp_shard stays native; the run starts from the same loss as the
    uncompressed job (one process, the same global batch: equal to HSDP within float32 summation order,
    test_parallel_layouts.py) and stays within 2% of it. The bytes counted are the replicate all-reduce's: 6/32
    of float32 for every module (each block's and the root's shard are above min_numel)."""
    hsdp = ["--training.steps", "5", "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
            "--training.local_batch_size", "1"]
    proc = run_trainer(tmp_path / "squinch", 4, *hsdp, "--comm.gradient_compression", "squinch")
    assert proc.stdout.count("Squinch on the all-reduce over dp_replicate = 2 (per module, overlapped with the "
                             "backward); the reduce-scatter over dp_shard = 2 stays uncompressed") == 1
    plain, squinch = read_metrics(tiny_one_process), read_metrics(tmp_path / "squinch")
    assert squinch[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5)  # same weights, same data
    model = _model(tmp_path / "squinch")
    n_params = sum(p.numel() for p in model.parameters())
    for p, s in zip(plain, squinch, strict=True):
        assert s["loss"] == pytest.approx(p["loss"], rel=0.02), s["step"]
        # each rank's shard (half the parameters) in one all-gather between the two replicas
        assert s["comm/bytes_uncompressed"] == pytest.approx(4 * n_params / 2, rel=1e-3)
        assert s["comm/bytes_sent"] == pytest.approx(FP32_RATIO * s["comm/bytes_uncompressed"], rel=1e-3)


# Error feedback across a resume: 8 steps straight with checkpoints at 4 and 8, then resumed from step 4.
EF = ["--comm.gradient_compression", "squinch", "--comm.error_feedback", "true"]
EF_CKPT = ["--training.steps", "8", "--checkpoint.enabled", "true", "--checkpoint.interval", "4"]
RESIDUALS = "squinch_residuals"
# HSDP on 2 processes (dp_replicate 2 x dp_shard 1): the overlapped replicate hooks, residuals per module.
RESUME_MODES = {**MODES, "hsdp": ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"]}
RESIDUAL_PREFIX = {"fsdp": "fsdp/", "ddp": "ddp/", "hsdp": "replicate/"}


def _straight_ef_run(dump: Path, mode: str) -> Path:
    """The uninterrupted run, its stdout beside it (``dump.with_suffix(".stdout")``)."""
    # FSDP saves asynchronously (step 4's residuals are snapshotted at save time, published at step 8).
    extra = ["--checkpoint.async_mode", "async"] if mode == "fsdp" else []
    proc = run_trainer(dump, WORLD, *EF_CKPT, "--checkpoint.keep_latest_k", "0", *RESUME_MODES[mode], *EF, *extra)
    dump.with_suffix(".stdout").write_text(proc.stdout)
    return dump


@pytest.fixture(scope="module")
def ef_fsdp(tmp_path_factory) -> Path:
    return _straight_ef_run(tmp_path_factory.mktemp("ef_fsdp"), "fsdp")


@pytest.fixture(scope="module")
def ef_ddp(tmp_path_factory) -> Path:
    return _straight_ef_run(tmp_path_factory.mktemp("ef_ddp"), "ddp")


@pytest.fixture(scope="module")
def ef_hsdp(tmp_path_factory) -> Path:
    return _straight_ef_run(tmp_path_factory.mktemp("ef_hsdp"), "hsdp")


def _resume_ef(straight: Path, dest: Path, nproc: int, *overrides: str, drop_residuals: bool = False):
    """Copy ``straight``'s step-4 checkpoint into ``dest`` and run on to step 8 there."""
    shutil.copytree(straight / "checkpoint" / "step-4", dest / "checkpoint" / "step-4")
    if drop_residuals:  # as a checkpoint saved without error feedback: no residual files, none in its checksums
        step = dest / "checkpoint" / "step-4"
        shutil.rmtree(step / RESIDUALS)
        manifest = json.loads((step / "checksums.json").read_text())
        manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith(RESIDUALS)}
        (step / "checksums.json").write_text(json.dumps(manifest))
    return run_trainer(dest, nproc, *EF_CKPT, *overrides)


@pytest.mark.parametrize("mode", list(RESUME_MODES))
def test_error_feedback_resume_is_exact(request, tmp_path: Path, mode: str) -> None:
    """Every rank's residuals are in the checkpoint; resumed under the same layout, the run's losses are
    bit for bit the uninterrupted run's (without the residuals they differ from step 6 on, see below). HSDP:
    the overlapped replicate hooks' residuals, one per FSDP module."""
    straight = request.getfixturevalue(f"ef_{mode}")
    for step in (4, 8):
        for rank in range(WORLD):
            saved = torch.load(straight / "checkpoint" / f"step-{step}" / RESIDUALS / f"rank-{rank}.pt",
                               weights_only=True)
            assert saved["fingerprint"]["rank"] == rank and saved["fingerprint"]["world_size"] == WORLD
            assert f"({'fsdp' if mode == 'hsdp' else mode})" in saved["fingerprint"]["layout"]
            names = list(saved["residuals"])
            assert names and all(n.startswith(RESIDUAL_PREFIX[mode]) for n in names), names[:3]
            assert all(r.isfinite().all() for r in saved["residuals"].values())
            assert any(r.abs().max() > 0 for r in saved["residuals"].values())
    proc = _resume_ef(straight, tmp_path, WORLD, *RESUME_MODES[mode], *EF)
    assert proc.stdout.count("error-feedback residuals restored from") == 1
    assert "restart from zero" not in proc.stdout
    ref, resumed = losses(straight), losses(tmp_path)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == ref[step], step


def test_checkpoint_without_residuals(ef_ddp: Path, tmp_path: Path) -> None:
    """A checkpoint without residuals (saved with error feedback off): they restart from zero, which is
    logged, and the losses then differ from the uninterrupted run's (the exact test above is not vacuous)."""
    proc = _resume_ef(ef_ddp, tmp_path, WORLD, *MODES["ddp"], *EF, drop_residuals=True)
    assert proc.stdout.count("error-feedback residuals restart from zero: the checkpoint has none") == 1
    ref, resumed = losses(ef_ddp), losses(tmp_path)
    assert resumed[5] == ref[5]  # the residuals first act on step 5's gradients, seen in step 6's loss
    assert any(resumed[step] != ref[step] for step in (6, 7, 8))


def test_other_layout_restarts_residuals(ef_fsdp: Path, tmp_path: Path) -> None:
    """FSDP (dp_shard 2) checkpoint resumed as HSDP with Squinch on the replicate all-reduce (dp_replicate 2):
    the layout fingerprint differs, so the residuals restart from zero (logged once); the new layout then
    saves its own (per FSDP module, of the replicate all-reduce hooks)."""
    proc = _resume_ef(ef_fsdp, tmp_path, WORLD, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1",
                      *EF)
    assert proc.stdout.count("error-feedback residuals restart from zero: layout changed") == 1
    assert sorted(losses(tmp_path)) == [5, 6, 7, 8]
    saved = torch.load(tmp_path / "checkpoint" / "step-8" / RESIDUALS / "rank-1.pt", weights_only=True)
    assert "dp_replicate 2 x dp_shard 1" in saved["fingerprint"]["layout"]
    assert saved["residuals"] and all(n.startswith("replicate/") for n in saved["residuals"])


def test_one_process_resume(ef_fsdp: Path, tmp_path: Path) -> None:
    """One process has no gradient reduction to compress, hence no residuals: the 2-process checkpoint
    (residual files included) still resumes, and no residuals are saved."""
    proc = _resume_ef(ef_fsdp, tmp_path, 0, "--training.local_batch_size", "8", *EF)
    assert proc.stdout.count("has nothing to compress") == 1
    assert sorted(losses(tmp_path)) == [5, 6, 7, 8]
    assert not (tmp_path / "checkpoint" / "step-8" / RESIDUALS).exists()
