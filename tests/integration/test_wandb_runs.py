"""[metrics] wandb in the trainer: an offline W&B run holds every logged step's values as metrics.jsonl has them, a
resumed job continues the same run id, a missing wandb stops the job with one line."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from trainer_utils import read_metrics, run_trainer

from torchtitan_ext.metrics.wandb_sink import RUN_ID_FILE

MISSING = "metrics.wandb = true needs the wandb package: pip install -e '.[tracking]'"


def _records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
    LevelDB-log records (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks, a block's
    tail shorter than a record header left as padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        else:
            pending = chunk if kind == 2 else pending + chunk


def read_offline_run(run_dir: Path) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, {step: merged history values}) of an offline run folder."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    run_id, config, history = None, {}, {}
    for record in _records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run_id, config, history


def offline_runs(dump: Path) -> list[Path]:
    return sorted((dump / "wandb").glob("offline-run-*"))  # named offline-run-<start time>-<run id>


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written under $HOME
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def _assert_same_values(history: dict[int, dict], records: list[dict]) -> None:
    for r in records:
        for key in ("loss", "lr", "grad_norm"):
            assert history[r["step"]][key] == r[key], (r["step"], key)


def test_offline_run_holds_every_logged_step(tmp_path, wandb_offline):
    """Two processes (FSDP): one run, from rank 0."""
    dump = tmp_path / "job"
    proc = run_trainer(dump, 2, "--training.steps", "6", "--training.local_batch_size", "2", "--eval.steps", "2",
                       "--eval.interval", "3", "--metrics.wandb", "true", "--metrics.wandb_project", "tests",
                       "--metrics.wandb_tags", "ci,tiny")
    (run,) = offline_runs(dump)
    run_id, config, history = read_offline_run(run)
    assert run_id == (dump / RUN_ID_FILE).read_text().strip() and run.name.endswith("-" + run_id)
    assert config["training"]["steps"] == 6 and config["metrics"]["wandb_tags"] == ["ci", "tiny"]
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, 7)) and sorted(history) == list(range(1, 7))
    _assert_same_values(history, records)
    for step in (3, 6):  # the evaluation's values too (step 6: logged with the training values)
        val = next(json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()
                   if json.loads(x)["step"] == step and "val_loss" in json.loads(x))
        assert history[step]["val_loss"] == val["val_loss"]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert len(lines) == 6 and all(" elapsed " in x and " eta " in x for x in lines)


def test_resumed_job_continues_the_same_run(tmp_path, wandb_offline):
    dump = tmp_path / "job"
    common = ("--checkpoint.enabled", "true", "--checkpoint.interval", "2", "--metrics.wandb", "true")
    run_trainer(dump, 0, "--training.steps", "4", *common)
    run_id = (dump / RUN_ID_FILE).read_text()
    proc = run_trainer(dump, 0, "--training.steps", "8", *common)
    assert "resumed from" in proc.stdout
    assert (dump / RUN_ID_FILE).read_text() == run_id  # unchanged
    first, second = offline_runs(dump)
    ids_and_steps = [(rid, sorted(h)) for rid, _, h in map(read_offline_run, (first, second))]
    assert ids_and_steps == [(run_id.strip(), [1, 2, 3, 4]), (run_id.strip(), [5, 6, 7, 8])]
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, 9))
    _assert_same_values(read_offline_run(first)[2], records[:4])
    _assert_same_values(read_offline_run(second)[2], records[4:])


def test_missing_wandb_stops_the_job_with_one_line(tmp_path, monkeypatch):
    """The real entry point, with a ``wandb`` that cannot be imported first on the path."""
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])))
    proc = run_trainer(tmp_path / "job", 0, "--metrics.wandb", "true", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: " + MISSING]
