"""Gumbel top-k distillation: sampling and soft targets by hand, unbiasedness by Monte Carlo, the sparse loss
against the dense soft cross-entropy in float64 (one process and TP2), sidecars, teacher pass and student."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import free_port
from trainer_utils import REPO, TINY, losses, read_metrics, run_trainer

from torchtitan_ext.data.shards import read_shard, write_shard
from torchtitan_ext.distill.sidecar import Sidecar, SidecarError, SidecarSet, sidecar_path


def _byte_shards(folder: Path) -> None:
    src = b"".join(p.read_bytes() for p in sorted(Path(np.__file__).parent.glob("*.py"))[:40])
    (folder / "train").mkdir(parents=True)
    (folder / "val").mkdir()
    write_shard(folder / "train" / "train_0.bin", np.frombuffer(src[:24000], np.uint8).astype(np.int64))
    write_shard(folder / "train" / "train_1.bin", np.frombuffer(src[24000:40000], np.uint8).astype(np.int64))
    write_shard(folder / "val" / "val_0.bin", np.frombuffer(src[40000:48000], np.uint8).astype(np.int64))


def _job(root: Path) -> list[str]:
    return ["--data.dataset", "shards", "--data.train_path", str(root / "data" / "train"),
            "--data.tokenizer", "none", "--model.vocab_size", "256", "--training.seq_len", "64"]


def _teacher_pass(root: Path, out: Path, *extra: str, nproc: int = 0) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
              "127.0.0.1", "--master_port", str(free_port())] if nproc else [sys.executable]
    cmd = [*launch, "-m", "torchtitan_ext.distill.teacher", *TINY, *_job(root),
           "--job.dump_folder", str(root / "teacher"), "--output", str(out), "--k", "8", *(extra or ("--batch", "16"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A teacher trained 40 steps and its sidecars (k = 8)."""
    root = tmp_path_factory.mktemp("distill")
    _byte_shards(root / "data")
    run_trainer(root / "teacher", 0, *_job(root), "--training.steps", "40", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "40")
    proc = _teacher_pass(root, root / "side")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, proc


@pytest.fixture(scope="module")
def students(distilled):
    """Students of 30 steps with alpha 0.9 and 0 (hard labels), same seed and data (the slow tier's)."""
    root, _ = distilled
    metrics = {}
    for alpha in ("0.9", "0.0"):
        run_trainer(root / f"student{alpha}", 0, *_job(root), "--training.steps", "30", "--job.seed", "1",
                    "--distill.path", str(root / "side"), "--distill.alpha", alpha)
        metrics[alpha] = read_metrics(root / f"student{alpha}")
    return metrics


def test_student_trains_on_the_sidecars(distilled, tmp_path):
    """CI's distilled students: 3 steps each with alpha 0.9 and 0 from the same start. At step 1 (same weights,
    same batch) both log the same soft cross-entropy to the teacher, and the alpha-0.9 loss is 0.9 x that plus
    0.1 x the hard-label loss the alpha-0 student logs."""
    root, _ = distilled
    rows = {}
    for alpha in ("0.9", "0.0"):
        run_trainer(tmp_path / alpha, 0, *_job(root), "--training.steps", "3", "--job.seed", "1",
                    "--metrics.log_freq", "1", "--distill.path", str(root / "side"), "--distill.alpha", alpha)
        rows[alpha] = read_metrics(tmp_path / alpha)
        assert [r["step"] for r in rows[alpha]] == [1, 2, 3]
        assert all(np.isfinite(r["distill/soft_ce"]) and r["distill/soft_ce"] > 0 for r in rows[alpha])
    soft, hard = rows["0.9"][0]["distill/soft_ce"], rows["0.0"][0]["loss"]
    assert rows["0.0"][0]["distill/soft_ce"] == pytest.approx(soft, rel=1e-6)
    assert abs(soft - hard) > 1e-3  # the two targets differ, so the mix below is not trivially true
    assert rows["0.9"][0]["loss"] == pytest.approx(0.9 * soft + 0.1 * hard, rel=1e-5)


def test_sidecars_line_up_with_shards(distilled):
    root, proc = distilled
    assert "96 bytes/token at k = 8 vs dense bf16 512" in proc.stdout
    shard = root / "data" / "train" / "train_0.bin"
    tokens = read_shard(shard)
    side = Sidecar(sidecar_path(root / "side", shard))
    assert (side.k, side.vocab, side.n_tokens, side.window) == (8, 256, len(tokens), 64)
    assert side.windows_done == side.n_windows() == (len(tokens) - 1) // 64
    assert (side.tokens[0] == -1).all() and (side.tokens[1:side.n_windows() * 64 + 1] >= 0).all()
    # the teacher, rerun on one window, predicts row w*64 + 1 + i from tokens w*64 .. w*64 + i
    rows = slice(3 * 64 + 1, 4 * 64 + 1)
    assert (side.log_probs[rows] <= 0).all()
    lp = torch.from_numpy(np.array(side.log_probs[rows]))
    assert (lp[:, :-1] >= lp[:, 1:] - 10).all()  # sane: kept tokens are likely ones
    seen = np.array(side.tokens[rows])
    hits = (seen == tokens[rows][:, None]).any(1).mean()
    assert hits > 0.5, hits  # the true next byte is among the 8 kept tokens at most positions


@pytest.mark.slow
def test_student_soft_ce_falls_faster_than_hard_labels(students):
    late = {a: np.mean([r["distill/soft_ce"] for r in m[-10:]]) for a, m in students.items()}
    assert students["0.9"][0]["distill/soft_ce"] == pytest.approx(students["0.0"][0]["distill/soft_ce"])
    print(f"soft CE to the teacher, mean of steps 21-30: distilled {late['0.9']:.3f}, hard labels {late['0.0']:.3f}")
    assert late["0.9"] < late["0.0"] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--training.local_batch_size", "2"], ["--parallelism.tp", "2"],
                                    ["--parallelism.pp", "2"]], ids=["fsdp2", "tp2", "pp2"])
def test_two_process_student_equals_one_process(distilled, students, tmp_path, layout):
    """FSDP2 (each rank half the batch), TP2 (the soft loss on vocabulary-sharded logits) and PP2 (the soft
    targets packed with the labels, split into 2 micro-batches and carried to the last stage) students."""
    root, _ = distilled
    run_trainer(tmp_path / "two", 2, *_job(root), "--training.steps", "30", "--job.seed", "1", *layout,
                "--distill.path", str(root / "side"), "--distill.alpha", "0.9")
    two = losses(tmp_path / "two")
    one = {r["step"]: r["loss"] for r in students["0.9"]}
    for step in (1, 2, 10, 30):
        assert two[step] == pytest.approx(one[step], rel=2e-4, abs=2e-4), step
    if "--training.local_batch_size" not in layout:  # rank 0 logs the soft loss of the whole batch
        soft_two = {r["step"]: r["distill/soft_ce"] for r in read_metrics(tmp_path / "two")}
        for r in students["0.9"]:
            assert soft_two[r["step"]] == pytest.approx(r["distill/soft_ce"], rel=2e-4, abs=2e-4), r["step"]


@pytest.mark.slow
def test_mode_student_under_expert_parallelism_equals_ep1(distilled, tmp_path):
    """A MoDE student distilled from the dense teacher's sidecars: experts sharded over 2 ranks (all-to-all
    dispatch) gives the losses of the same 2 data-parallel ranks with every expert local. (The Switch
    balancing loss is per rank, so EP is compared at the same data-parallel degree.)"""
    root, _ = distilled
    mode = ["--model.n_experts", "4", "--model.top_k", "2", "--model.moe_hidden", "32", "--training.steps", "8",
            "--training.local_batch_size", "2", "--job.seed", "1", "--distill.path", str(root / "side"),
            "--distill.alpha", "0.9"]
    for ep in ("1", "2"):
        run_trainer(tmp_path / f"ep{ep}", 2, *_job(root), *mode, "--parallelism.ep", ep)
    ep1, ep2 = read_metrics(tmp_path / "ep1"), read_metrics(tmp_path / "ep2")
    assert [r["step"] for r in ep2] == list(range(1, 9))
    for r1, r2 in zip(ep1, ep2, strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5), r1["step"]
        assert r2["distill/soft_ce"] == pytest.approx(r1["distill/soft_ce"], rel=1e-5), r1["step"]
    assert ep2[-1]["distill/soft_ce"] < ep2[0]["distill/soft_ce"]


def test_teacher_pass_resumes_to_the_same_bytes(distilled, tmp_path):
    root, _ = distilled
    shard = root / "data" / "train" / "train_1.bin"
    full = sidecar_path(root / "side", shard).read_bytes()
    out = tmp_path / "side"
    out.mkdir()
    partial = sidecar_path(out, shard)
    partial.write_bytes(full)
    side = Sidecar(partial, "r+")
    side.tokens[100 * 64:] = -1  # a crash after 96 windows: later rows never written
    side.set_windows_done(96)
    shutil.copy(sidecar_path(root / "side", root / "data" / "train" / "train_0.bin"), out)
    proc = _teacher_pass(root, out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # resumed at window 96 of train_1 (train_0 complete): only the 153 windows left were scored
    assert f"teacher pass: {(249 - 96) * 64:,} tokens" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert partial.read_bytes() == full


@pytest.mark.slow
def test_teacher_pass_under_fsdp2_writes_the_same_sidecars(distilled, tmp_path):
    """The teacher checkpoint loads sharded over 2 processes (another batch too): the same bytes."""
    root, _ = distilled
    proc = _teacher_pass(root, tmp_path / "side", "--batch", "8", nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("train_0.bin.topk", "train_1.bin.topk"):
        assert (tmp_path / "side" / name).read_bytes() == (root / "side" / name).read_bytes(), name


def test_corrupted_or_misaligned_sidecars_give_one_line(distilled, tmp_path):
    root, _ = distilled
    for case in ("corrupt", "truncate", "swap"):
        side_dir = tmp_path / case
        shutil.copytree(root / "side", side_dir)
        a, b = side_dir / "train_0.bin.topk", side_dir / "train_1.bin.topk"
        if case == "corrupt":
            Sidecar(a, "r+").tokens[1:] = 999  # outside the vocabulary of 256
        elif case == "truncate":
            a.write_bytes(a.read_bytes()[:-100])
        else:
            a_bytes = a.read_bytes()
            a.write_bytes(b.read_bytes())
            b.write_bytes(a_bytes)
        proc = run_trainer(tmp_path / f"run-{case}", 0, *_job(root), "--distill.path", str(side_dir), check=False)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), proc.stderr[-2000:]
        assert "train_0.bin.topk" in err[0], err[0]
        expect = {"corrupt": "corrupted rows", "truncate": "truncated", "swap": "line up"}[case]
        assert expect in err[0], err[0]


def test_sidecars_of_different_k_are_refused(distilled, tmp_path):
    """A teacher pass rerun with another --k over part of the shards: refused when the set opens, naming both."""
    root, _ = distilled
    side_dir = tmp_path / "side"
    shutil.copytree(root / "side", side_dir)
    shards = sorted((root / "data" / "train").glob("train_*.bin"))
    tokens = [read_shard(s) for s in shards]
    other = Sidecar.create(sidecar_path(side_dir, shards[1]), 4, 256, tokens[1], 64)
    other.tokens[:], other.log_probs[:], other.thresholds[:] = 0, -1.0, -2.0
    other.set_windows_done(other.n_windows())
    with pytest.raises(SidecarError, match=r"train_1\.bin\.topk: k = 4 over a vocabulary of 256, but .*train_0"):
        SidecarSet(side_dir, shards, tokens, 64)
