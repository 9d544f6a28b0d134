"""A dump folder belongs to one run, a resume checks what it resumes, resuming an older step is a branch,
nothing a run wrote is destroyed by a later run, filesystem faults are one line: each fault below asserts
the one line, the exit code, and that every file that existed before is still there or moved aside
(compared by checksum). Jobs run in-process through the entry point (``main``) to stay fast."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_utils import TINY, read_metrics, run_trainer

from torchtitan_ext.train.__main__ import main

CKPT = ["--checkpoint.enabled", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


pytestmark = pytest.mark.usefixtures("restore_signal_handlers")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """4 steps, checkpoints at 2 and 4, metrics.jsonl, config.toml, run.json."""
    dump = tmp_path_factory.mktemp("base") / "run"
    run_trainer(dump, 0, *CKPT, "--training.steps", "4")
    return dump


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def _checksums(root: Path) -> dict[str, str]:
    """Every file under ``root`` but the append-only logs and the lock: relative path -> sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock" and p.relative_to(root).parts[0] != "logs"}


def _assert_kept(before: dict[str, str], root: Path, except_: tuple[str, ...] = ()) -> dict[str, str]:
    """Each file of ``before`` is at its place or moved aside (previous-*/, checkpoint/abandoned-*/), unchanged;
    returns where each one is now."""
    after = _checksums(root)
    where = {}
    for rel, digest in before.items():
        if rel.startswith(except_):
            continue
        homes = [k for k, d in after.items() if d == digest and (
            k == rel or (k.startswith("previous-") and k.split("/", 1)[1] == rel)
            or (rel.startswith("checkpoint/step-") and k.startswith("checkpoint/abandoned-")
                and k.split("/", 2)[2] == rel.split("/", 1)[1]))]
        assert homes, f"{rel} lost or changed"
        where[rel] = homes[0]
    return where


def _run(capsys, dump: Path, *overrides: str) -> tuple[int, str, list[str]]:
    """The entry point in this process: (exit code, stdout, error lines)."""
    os.environ.pop("RANK", None)
    code = main([*TINY, "--job.dump_folder", str(dump), *overrides])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.startswith("error:")]


def test_second_job_stops_naming_the_holder(base, tmp_path, capsys):
    dump = _copy(base, tmp_path / "run")
    before = _checksums(dump)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, json, os, socket, sys, time\n"
         f"fd = os.open({str(dump / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, json.dumps({'host': socket.gethostname(), 'pid': os.getpid(), 'started': 1.7e9}).encode())\n"
         "print('locked', flush=True)\ntime.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "6")
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and len(errors) == 1, errors
    assert f"job.dump_folder {dump.resolve()} is in use by another run (host {socket.gethostname()}, " \
           f"pid {holder.pid}, started 2023-11-14 22:13:20 UTC" in errors[0]
    assert "step      5" not in out
    _assert_kept(before, dump)
    assert _checksums(dump) == before


def test_stale_lock_taken_over_and_nothing_to_train(base, tmp_path, capsys):
    """A lock file naming a dead process of this host is taken over with one line; training.steps not beyond
    the resumed step: exit 0, "nothing to train", nothing written."""
    dump = _copy(base, tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (dump / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.7e9}))
    before = _checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "4")
    assert code == 0 and not errors
    assert f"took over the stale lock {dump.resolve()}/.lock: its holder (host {socket.gethostname()}, " \
           f"pid {dead.pid}, started 2023-11-14 22:13:20 UTC) is no longer running" in out
    assert "nothing to train: resumed at step 4 and training.steps = 4" in out
    assert _checksums(dump) == before  # metrics, config.toml, run.json, checkpoints untouched
    assert (dump / ".lock").read_text() == ""  # released at the end


def test_fresh_start_over_another_run_stops_unless_overwrite(base, tmp_path, capsys):
    """checkpoint.enabled = false on a used folder would truncate metrics.jsonl: one line, exit 2; with
    job.overwrite the old files move to previous-<time>/ and the new run starts clean."""
    dump = _copy(base, tmp_path / "run")
    before = _checksums(dump)
    code, out, errors = _run(capsys, dump, "--checkpoint.enabled", "false", "--training.steps", "2")
    assert code == 2 and len(errors) == 1, errors
    assert f"job.dump_folder {dump} holds another run's files (checkpoint/step-4 and 1 more, metrics.jsonl " \
           f"(4 records)) and this job would start from step 0 (checkpoint.enabled = false); set " \
           f"job.overwrite = true" in errors[0]
    assert "step      1" not in out and _checksums(dump) == before
    code, out, errors = _run(capsys, dump, "--checkpoint.enabled", "false", "--training.steps", "2",
                             "--job.overwrite", "true", "--lr_scheduler.warmup_steps", "5")
    assert code == 0 and not errors
    previous = [p for p in dump.iterdir() if p.name.startswith("previous-")]
    assert len(previous) == 1
    assert f"job.overwrite = true: moved the previous run's files (checkpoint, config.toml, metrics.jsonl, " \
           f"run.json, tokenizer) aside to {previous[0]}" in out
    assert "warning: lr_scheduler.warmup_steps = 5 is longer than the run (training.steps = 2)" in out
    where = _assert_kept(before, dump)
    assert all(w.startswith(previous[0].name + "/") for w in where.values())
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]
    assert json.loads((dump / "run.json").read_text())["starts"][0]["step"] == 0


def test_stray_step_names_are_not_checkpoints(base, tmp_path, capsys):
    """A ``step-foo/`` folder or a file named ``step-3`` is no checkpoint for the resume decision nor for the
    load (one reading of the folder): the job is a fresh start over another run's metrics, so it stops."""
    dump = _copy(base, tmp_path / "run")
    for step in (2, 4):
        shutil.rmtree(dump / "checkpoint" / f"step-{step}")
    (dump / "checkpoint" / "step-foo").mkdir()
    (dump / "checkpoint" / "step-3").write_text("not a checkpoint")
    before = _checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "2")
    assert code == 2 and len(errors) == 1, errors
    assert f"job.dump_folder {dump} holds another run's files (metrics.jsonl (4 records)) and this job would " \
           "start from step 0" in errors[0]
    assert _checksums(dump) == before


def test_resuming_an_older_step_is_a_branch(base, tmp_path, capsys):
    """load_step 2 of (2, 4): step-4 moves to checkpoint/abandoned-<time>/, intact; the new saves are the
    latest, and keep_latest_k = 2 keeps this run's two saves (4, 6) rather than counting the old step-4."""
    dump = _copy(base, tmp_path / "run")
    before = _checksums(dump)
    code, out, errors = _run(capsys, dump, "--checkpoint.enabled", "true", "--checkpoint.interval", "2",
                             "--checkpoint.keep_latest_k", "2", "--checkpoint.load_step", "2",
                             "--training.steps", "6")
    assert code == 0 and not errors
    abandoned = [p for p in (dump / "checkpoint").iterdir() if p.name.startswith("abandoned-")]
    assert len(abandoned) == 1
    assert f"resumed from step-2, older than the newest checkpoint: moved step-4 aside to {abandoned[0]} " \
           f"(not deleted)" in out
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [abandoned[0].name, "step-4", "step-6"]
    where = _assert_kept(before, dump, except_=("checkpoint/step-2/", "metrics.jsonl", "config.toml",
                                                "run.json"))
    assert all(w.startswith(f"checkpoint/{abandoned[0].name}/step-4/") for k, w in where.items()
               if k.startswith("checkpoint/"))
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5, 6]


def test_resume_with_fewer_layers_names_the_parameter(base, tmp_path, capsys):
    dump = _copy(base, tmp_path / "run")
    before = _checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "6", "--model.n_layers", "2")
    assert code == 2 and len(errors) == 1, errors
    assert f"error: {dump}/checkpoint/step-4: parameter layers.2.attention.k_norm.weight: checkpoint shape " \
           f"[64], model absent (" in errors[0]
    assert "model.n_layers changed since the run began: 4 -> 2" in out
    assert "step      5" not in out and _checksums(dump) == before


def test_changed_seq_len_is_one_line_and_configs_kept(base, tmp_path, capsys):
    dump = _copy(base, tmp_path / "run")
    before = _checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "5", "--training.seq_len", "32")
    assert code == 0 and not errors
    # 4 steps x 4 sequences of 64 tokens = 32 sequences of 32 tokens
    assert "training.seq_len changed since the last start: 64 -> 32 (the data continues from the same " \
           "position in tokens: sequence 16 -> 32)" in out
    record = json.loads((dump / "run.json").read_text())
    assert record["first_identity"]["training.seq_len"] == 64 and record["identity"]["training.seq_len"] == 32
    assert [s["step"] for s in record["starts"]] == [0, 4]
    dated = list(dump.glob("config-*.toml"))
    assert len(dated) == 1 and hashlib.sha256(dated[0].read_bytes()).hexdigest() == before["config.toml"]
    assert "seq_len = 32" in (dump / "config.toml").read_text()
    _assert_kept(before, dump, except_=("metrics.jsonl", "config.toml", "run.json"))


@pytest.mark.parametrize("key", ["job.dump_folder", "data.cache_dir"])
def test_path_that_is_a_file_is_one_line(tmp_path, capsys, key):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder\n")
    dump = blocker / "run" if key == "job.dump_folder" else tmp_path / "run"
    extra = ["--data.cache_dir", str(blocker / "cache")] if key == "data.cache_dir" else []
    code, out, errors = _run(capsys, dump, *extra)
    path = blocker / ("run" if key == "job.dump_folder" else "cache")
    assert code == 2 and errors == [f"error: {key} {path}: Not a directory (ENOTDIR)"], errors
    assert blocker.read_text() == "not a folder\n"
    assert not dump.exists() or not any(dump.iterdir())  # nothing written (the dump folder probed first)


def test_save_out_of_space_keeps_previous_checkpoint(tmp_path, capsys, monkeypatch):
    """The step-4 save fails with ENOSPC inside DCP's writer: its partial folder is removed, step-2 is as it
    was, the job ends with one line naming the path and the error, exit 2."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    dump = tmp_path / "run"
    write, calls, snapshot = FileSystemWriter.write_data, [], {}

    def full_disk(self, plan, planner):
        calls.append(self.path)
        if len(calls) == 2:
            snapshot.update(_checksums(dump / "checkpoint"))
            partial = Path(self.path) / "__0_0.distcp"
            partial.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial))
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "4")
    assert code == 2 and len(errors) == 1, errors
    assert errors[0] == (f"error: saving checkpoint {dump}/checkpoint/step-4 failed: No space left on device "
                         f"(ENOSPC) at {dump}/checkpoint/step-4.tmp/__0_0.distcp; removed the partial step-4.tmp; "
                         f"the previous checkpoint {dump}/checkpoint/step-2 is intact")
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert _checksums(dump / "checkpoint") == snapshot
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]  # what could be finished was


@pytest.mark.parametrize("when", ["start-up", "resume"])
def test_sigterm_during_startup_or_resume_exits_0_writing_nothing(base, tmp_path, capsys, monkeypatch, when):
    import torchtitan_ext.train.trainer as trainer_module
    from torchtitan_ext.checkpoint.manager import CheckpointManager

    dump = _copy(base, tmp_path / "run")
    before = _checksums(dump)
    if when == "start-up":
        build = trainer_module.build_run

        def build_then_signal(cfg):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            return build(cfg)

        monkeypatch.setattr(trainer_module, "build_run", build_then_signal)
    else:
        load = CheckpointManager.load

        def signal_then_load(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return load(self)

        monkeypatch.setattr(CheckpointManager, "load", signal_then_load)
    code, out, errors = _run(capsys, dump, *CKPT, "--training.steps", "6")
    assert code == 0 and not errors
    assert "preempted (SIGTERM) during start-up" in out and "step      5" not in out
    assert _checksums(dump) == before


@pytest.mark.parametrize("case", ["vocab 480", "damaged model"])
def test_sentencepiece_failure_is_one_line_naming_the_file(tmp_path, capsys, case):
    if case == "vocab 480":  # fewer pieces than the corpus's characters: SentencePiece refuses to train
        model = tmp_path / "cache" / "stdlib_bpe480_py311.model"
        extra = ["--data.tokenizer", "builtin", "--data.tokenizer_vocab_size", "480"]
        needle = "SentencePiece training failed with data.tokenizer_vocab_size = 480 ("
    else:
        model = tmp_path / "bad.model"
        model.write_bytes(b"not a protobuf")
        extra = ["--data.tokenizer", str(model)]
        needle = "not a SentencePiece model ("
    code, out, errors = _run(capsys, tmp_path / "run", *extra, "--data.cache_dir", str(tmp_path / "cache"))
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {model}: {needle}"), errors
    assert "step      1" not in out
