"""Checkpoint integrity (issue 43): every saved file has a checksum in ``step-N/checksums.json``, checked before
a resume reads anything. Damage (16 KB of zeros inside a ``.distcp``, random bytes, an emptied ``.metadata``)
is one line naming the file and the step falls back like a missing one; with every step damaged the job stops
with one line (exit 2); a checkpoint without checksums (saved before they existed) loads, said in one line.
Each fault asserts the line, the exit code and that every earlier file is still there (checksums). Jobs run
in-process through the entry point to stay fast."""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path

import pytest
from trainer_utils import CKPT_EVERY_2, TINY, file_checksums, read_metrics, run_trainer

from torchtitan_ext.train.__main__ import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")









def _assert_kept(before: dict[str, str], root: Path) -> None:
    """Each file of ``before`` is at its place, or (a checkpoint newer than the one resumed) moved to
    ``checkpoint/abandoned-*/``, unchanged; metrics.jsonl, run.json and config.toml are rewritten by a resume."""
    after = file_checksums(root)
    for rel, digest in before.items():
        if rel in ("metrics.jsonl", "run.json", "config.toml"):
            continue
        homes = [k for k, d in after.items() if d == digest and (
            k == rel or (rel.startswith("checkpoint/step-") and k.startswith("checkpoint/abandoned-")
                         and k.split("/", 2)[2] == rel.split("/", 1)[1]))]
        assert homes, f"{rel} lost or changed"


def _run(capsys, dump: Path, *overrides: str) -> tuple[int, str, list[str]]:
    """The entry point in this process: (exit code, stdout, error lines)."""
    os.environ.pop("RANK", None)
    code = main([*TINY, "--job.dump_folder", str(dump), *overrides])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, [line for line in err.splitlines() if line.startswith("error:")]


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "zeros":  # 16 KB of zeros in the middle of the file, its size unchanged
        mid = len(data) // 2
        data[mid:mid + 16384] = bytes(16384)
    elif how == "random":
        mid = len(data) // 3
        data[mid:mid + 4096] = os.urandom(4096)
    else:
        data = bytearray()
    path.write_bytes(bytes(data))


def test_every_saved_file_has_its_checksum(checkpointed_run):
    for step in (2, 4):
        folder = checkpointed_run / "checkpoint" / f"step-{step}"
        record = json.loads((folder / "checksums.json").read_text())
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != "checksums.json")
        assert sorted(record["files"]) == files and ".metadata" in files and "__0_0.distcp" in files
        for name, entry in record["files"].items():
            data = (folder / name).read_bytes()
            assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


@pytest.mark.parametrize("how, file", [("zeros", "__0_0.distcp"), ("random", "__0_0.distcp"),
                                       ("empty", ".metadata")])
def test_damaged_file_is_named_and_the_step_falls_back(checkpointed_run, tmp_path, capsys, how, file):
    dump = shutil.copytree(checkpointed_run, tmp_path / "run")
    damaged = dump / "checkpoint" / "step-4" / file
    saved_size = damaged.stat().st_size
    _damage(damaged, how)
    before = file_checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "6")
    assert code == 0 and not errors
    why = f"{damaged} has 0 bytes, {saved_size} when saved" if how == "empty" else \
        f"{damaged} fails its checksum (crc32 "
    line = next(x for x in out.splitlines() if x.startswith(f"checkpoint {dump}/checkpoint/step-4 is unreadable"))
    assert why in line and line.endswith("damaged after it was written); skipping it"), line
    assert f"resuming from {dump}/checkpoint/step-2 instead (skipped unreadable: step-4)" in out
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5, 6]
    _assert_kept(before, dump)  # the damaged step-4 moved aside to abandoned-*/, byte for byte


def test_every_step_damaged_stops_with_one_line(checkpointed_run, tmp_path, capsys):
    dump = shutil.copytree(checkpointed_run, tmp_path / "run")
    for step in (2, 4):
        _damage(dump / "checkpoint" / f"step-{step}" / "__0_0.distcp", "zeros")
    before = file_checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "6")
    assert code == 2 and errors == [
        f"error: {dump}/checkpoint: every checkpoint is unreadable (step-4, step-2); not starting over from step 0 "
        f"(set checkpoint.allow_fresh_start = true to do so, or checkpoint.folder)"], errors
    assert f"{dump}/checkpoint/step-2/__0_0.distcp fails its checksum" in out
    assert "step      1 " not in out
    assert file_checksums(dump) == before


def test_checkpoint_without_checksums_loads_and_says_so(checkpointed_run, tmp_path, capsys):
    dump = shutil.copytree(checkpointed_run, tmp_path / "run")
    (dump / "checkpoint" / "step-4" / "checksums.json").unlink()
    before = file_checksums(dump)
    code, out, errors = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "5")
    assert code == 0 and not errors
    assert (f"checkpoint {dump}/checkpoint/step-4 has no checksums (saved before they were written): loading it "
            f"unverified") in out
    assert f"resumed from {dump}/checkpoint/step-4" in out
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5]
    assert (dump / "checkpoint" / "step-5" / "checksums.json").is_file()  # the new save has them
    _assert_kept(before, dump)


def test_one_process_reader_names_the_damaged_file(checkpointed_run, tmp_path):
    """eval / export / quant.export read through load_on_one_process: damage is one line naming the file."""
    import torch

    from torchtitan_ext.checkpoint.manager import load_on_one_process
    from torchtitan_ext.errors import ConfigError

    folder = shutil.copytree(checkpointed_run / "checkpoint" / "step-4", tmp_path / "step-4")
    _damage(folder / "__0_0.distcp", "zeros")
    with pytest.raises(ConfigError) as e:
        load_on_one_process({"model": {"tok_embeddings.weight": torch.empty(0)}}, folder)
    assert str(e.value).startswith(f"{folder}: damaged checkpoint ({folder}/__0_0.distcp fails its checksum")
    assert "\n" not in str(e.value)


def test_integrity_note_claims_only_what_was_checked(checkpointed_run, tmp_path):
    """The clause a NaN/Inf stop gives about the latest checkpoint: 'matched its checksums' only for one
    this job verified, never 'intact' for one it did not check."""
    from types import SimpleNamespace

    from torchtitan_ext.checkpoint.manager import CheckpointManager

    folder = checkpointed_run / "checkpoint"
    m = CheckpointManager.__new__(CheckpointManager)
    m.cfg, m.folder, m.checked = SimpleNamespace(enabled=True), folder, {}
    assert m.integrity_note() == (f"the latest checkpoint {folder}/step-4 was not checked by this job; a resume "
                                  f"verifies its checksums")
    m.checked[4] = "verified"
    assert m.integrity_note() == f"the latest checkpoint {folder}/step-4 matched its checksums when this job loaded it"
    m.checked[4] = "unverified"
    assert "has no checksums and was loaded unverified" in m.integrity_note()
    m.folder = tmp_path
    assert m.integrity_note() == "no checkpoint has been saved"


@pytest.fixture
def small_fs(tmpfs):
    """A real 6 MiB filesystem (integration/conftest.py's tmpfs)."""
    return tmpfs("6m")


def test_full_disk_during_a_save_is_one_line(small_fs):
    """A 200k-parameter model saves 2.7 MB a step: step-2 and step-4 fit, step-6 fills the filesystem. torch's
    zip writer reports that as 'RuntimeError: unexpected pos'; the job still ends with the ENOSPC line, exit 2,
    step-6.tmp removed, the earlier checkpoints matching their checksums."""
    from torchtitan_ext.checkpoint.integrity import first_damage, read_manifest

    dump = small_fs / "run"
    proc = run_trainer(dump, 0, *CKPT_EVERY_2, "--training.steps", "10", "--model.n_layers", "1", "--model.dim", "64",
                       check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    folder = dump / "checkpoint"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == [f"error: saving checkpoint {folder}/step-6 failed: No space left on device (ENOSPC) at "
                      f"{folder}/step-6.tmp; removed the partial step-6.tmp; the previous checkpoint "
                      f"{folder}/step-4 is intact"], errors
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]
    for step in (2, 4):
        assert first_damage(folder / f"step-{step}", read_manifest(folder / f"step-{step}")) is None


def test_rank_log_on_a_full_disk_never_raises(small_fs, capsys):
    """Logging is not what crashes: the rank log's file failing with ENOSPC is said once on the console and
    the console goes on."""
    from torchtitan_ext.metrics.logger import rank_log

    filler = small_fs / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError):
        while True:
            f.write(bytes(1 << 20))
            f.flush()
    with rank_log(str(small_fs / "run"), 0) as path:
        print("x" * 8192)
        print("the console goes on")
    out = capsys.readouterr().out.splitlines()
    assert out.count(f"warning: cannot write the rank log {path}: No space left on device (ENOSPC); logging to "
                     f"the console only") == 1
    assert out[-1] == "the console goes on"


def _fill(fs: Path, leave_kib: int = 0) -> None:
    """Fill the filesystem ``fs`` but ``leave_kib`` KiB (enough for the dump folder's write probe)."""
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize - leave_kib * 1024
    with open(fs / "filler", "wb") as f:
        f.write(bytes(max(free, 0)))


def test_tensorboard_on_a_full_disk_at_resume_is_one_line(small_fs, capsys):
    """A resume whose TensorBoard writer cannot write its first events: the writer thread printed a traceback
    and the job ended with 'error: No space left on device'; now one line naming the folder and ENOSPC, exit 2,
    the checkpoint intact and no empty event file left."""
    from torchtitan_ext.checkpoint.integrity import first_damage, read_manifest

    dump = small_fs / "run"
    small = ["--model.n_layers", "1", "--model.dim", "64", "--metrics.tensorboard", "true", *CKPT_EVERY_2]
    assert _run(capsys, dump, *small, "--training.steps", "2")[0] == 0
    before = file_checksums(dump)
    _fill(small_fs, leave_kib=4)
    code, _, errors = _run(capsys, dump, *small, "--training.steps", "4")
    assert code == 2 and errors == [f"error: writing TensorBoard events to {dump / 'tb'} failed: No space left on "
                                    "device (ENOSPC)"], errors
    _assert_kept(before, dump)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert first_damage(dump / "checkpoint" / "step-2", read_manifest(dump / "checkpoint" / "step-2")) is None
    assert len(list((dump / "tb").iterdir())) == 1


def test_tensorboard_filling_the_disk_mid_run_is_one_line(small_fs, capsys):
    """The disk fills while TensorBoard's writer thread writes: the thread prints nothing, the next logged step
    raises MetricsWriteFailed naming the folder, the step and ENOSPC."""
    from torchtitan_ext.metrics.logger import MetricsLogger, MetricsWriteFailed

    metrics = MetricsLogger(str(small_fs / "run"), 0, tensorboard=True, jsonl=False)
    metrics.log(1, {"loss": 1.0})
    _fill(small_fs)
    with pytest.raises(MetricsWriteFailed) as e:
        for step in range(2, 500):  # each record is written by the thread as it comes
            metrics.log(step, {"loss": 1.0})
            time.sleep(0.002)
    metrics.close()
    assert str(e.value).startswith(f"writing TensorBoard events to {small_fs / 'run' / 'tb'} failed at step ")
    assert str(e.value).endswith(": No space left on device (ENOSPC)")
    assert capsys.readouterr().err == ""
