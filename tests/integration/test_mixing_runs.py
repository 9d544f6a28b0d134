"""Domain mixing and best-fit-decreasing packing in the trainer: adaptive mixing logs, resumes exactly and matches
one process; BFD packing trains."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from data_builders import write_domains
from trainer_utils import read_metrics, run_trainer

from torchtitan_ext.data.base import rows_to_batch
from torchtitan_ext.data.packers.bfd import PAD
from torchtitan_ext.data.sources.domains import adaptive_update


def _domains_toml(path: Path, tables: list[dict]) -> Path:
    lines = []
    for t in tables:
        lines.append("[[data.domains]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


MIX = ["--data.dataset", "domains",
       "--data.mixing", "adaptive", "--data.mixing_rate", "0.5", "--eval.interval", "2", "--eval.steps", "2",
       "--training.steps", "6", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4"]


def test_adaptive_mixing_in_training_logs_resumes_exactly_and_matches_one_process(tmp_path):
    cfg = _domains_toml(tmp_path / "domains.toml", write_domains(tmp_path))
    full = tmp_path / "full"
    ckpt = ["--checkpoint.enabled", "true", "--checkpoint.interval", "4"]
    run_trainer(full, 2, "--config", str(cfg), *MIX, *ckpt)
    evals = [r for r in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())
             if "data/weight/d0" in r and "loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    # Every evaluation applies w <- w exp(eta (L_d - mean L) / std L), normalised, from the logged losses.
    w = np.array([1.0, 2.0]) / 3.0
    for r in evals:
        w = adaptive_update(w, np.array([r["val/loss/d0"], r["val/loss/d1"]]), 0.5)
        assert np.allclose([r["data/weight/d0"], r["data/weight/d1"]], w, rtol=1e-9, atol=1e-12)
        assert math.isclose(r["val_bpb"], r["val_loss"] / math.log(2), rel_tol=1e-6)  # bytes, no EOT here
    assert abs(w[0] - 1 / 3) > 0.05  # the weights really moved
    # Resume from step 4 (weights already changed twice, saved in the checkpoint) continues exactly.
    part = tmp_path / "part"
    (part / "checkpoint").mkdir(parents=True)
    shutil.copytree(full / "checkpoint" / "step-4", part / "checkpoint" / "step-4")
    run_trainer(part, 2, "--config", str(cfg), *MIX, *ckpt)
    ref = {r["step"]: r for r in read_metrics(full)}
    resumed = {r["step"]: r for r in read_metrics(part)}
    for step in (5, 6):
        assert resumed[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6)
    assert resumed[6]["data/weight/d0"] == pytest.approx(ref[6]["data/weight/d0"], rel=1e-9)
    # One process with the whole global batch sees the same data: the same losses. Its evaluation scores the
    # same eval.steps x local_batch_size windows as the two ranks split between them: 1 x 8 = 2 x 4.
    one = tmp_path / "one"
    run_trainer(one, 0, "--config", str(cfg), *MIX, "--training.local_batch_size", "8", "--eval.steps", "1")
    for step, r in {r["step"]: r for r in read_metrics(one)}.items():
        assert r["loss"] == pytest.approx(ref[step]["loss"], rel=2e-4)


def test_bfd_packing_in_training(tmp_path):
    proc = run_trainer(tmp_path, 0, "--data.packing", "bfd", "--training.steps", "3", "--model.n_layers", "2",
                       "--model.dim", "64")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("data.packing"))
    padding = float(line.rsplit(" ", 1)[1].rstrip("%"))
    assert 0 < padding < 50
    assert all(math.isfinite(v) for v in read_metrics(tmp_path)[-1:][0].values() if isinstance(v, float))
    # Padding is never a label, and every window starts with a document (its first token follows an EOT).
    from trainer_utils import TEST_CACHE

    from torchtitan_ext.data.packers.bfd import PackedDataLoader

    shard = next(TEST_CACHE.glob("stdlib_*_byte/val.bin"))
    loader = PackedDataLoader([shard], 64, 8, 0, 1, seed=0, shuffle=True, eot_id=256)
    padded = [row for row in loader.windows if (row == PAD).any()]
    assert padded and all((row[np.argmax(row == PAD):] == PAD).all() for row in padded)  # padding only at the tail
    assert all(row[row != PAD][-1] == 256 for row in padded)  # before it, whole documents (ending with EOT)
    batch = rows_to_batch(padded[:4], [0] * 4, 257, str)
    pad = torch.from_numpy(np.stack(padded[:4]) == PAD)
    assert torch.equal(batch.labels == -100, pad[:, 1:]) and (batch.inputs[pad[:, :-1]] == 0).all()
