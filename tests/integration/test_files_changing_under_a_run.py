"""Issue 64, item 4: files that change under a run. A token shard truncated while a run read it through a memory
map killed the process with SIGBUS (exit 135, no line); shards are now read with ``os.pread`` and each read
checks the file against what was opened, so a shard shortened or rewritten in place is one line naming it,
exit 2, and the run resumes once the file is restored. A damaged ``run.json`` is reported and kept aside,
never silently replaced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from trainer_utils import CKPT_EVERY_2, REPO, TINY, read_metrics, run_trainer

from torchtitan_ext.data.shards import HEADER_BYTES, read_shard, write_shard

PROBE = """
import os, sys
import numpy as np
from torchtitan_ext.cli import run_tool
from torchtitan_ext.data.shards import HEADER_BYTES, read_shard

path, how, change = sys.argv[1], sys.argv[2], sys.argv[3]

def main(argv):
    if how == "memmap":  # what the loader used to hold
        count = (os.path.getsize(path) - HEADER_BYTES) // 2
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    else:
        tokens = read_shard(path)
    first = int(np.asarray(tokens[10:20]).sum())
    if change == "truncate":
        os.truncate(path, HEADER_BYTES + 100)
    else:  # the same length, other bytes, into the same file
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES)
            f.write(bytes(4096))
        os.utime(path, ns=(time_ns := os.stat(path).st_mtime_ns + 10**9, time_ns))
    print(first, int(np.asarray(tokens[1_000_000:1_000_010]).sum()), flush=True)

sys.exit(run_tool(main, []))
"""


def _probe(path: Path, how: str, change: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", PROBE, str(path), how, change], env=env, capture_output=True,
                          text=True, timeout=120)


def _shard(path: Path, n: int = 2_000_000) -> np.ndarray:
    tokens = (np.arange(n) % 251).astype(np.uint16)
    write_shard(path, tokens)
    return tokens


def test_a_shard_truncated_under_a_reader_is_one_line_not_sigbus(tmp_path):
    """The same truncation kills a process reading the shard through a real memory map (SIGBUS); through
    ``read_shard`` it is one line naming the file, exit 2."""
    path = tmp_path / "train_000.bin"
    _shard(path)
    mapped = _probe(path, "memmap", "truncate")
    assert mapped.returncode == -signal.SIGBUS, (mapped.returncode, mapped.stderr[-2000:])
    _shard(path)
    proc = _probe(path, "read_shard", "truncate")
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: the shard changed while this run read it ({HEADER_BYTES + 4_000_000} bytes when the run "
        f"opened it, {HEADER_BYTES + 100} now); restore the file and start the job again: it resumes from its last "
        f"checkpoint"]


def test_a_shard_rewritten_in_place_is_one_line_and_one_replaced_by_a_new_file_reads_as_opened(tmp_path):
    path = tmp_path / "train_000.bin"
    _shard(path)
    proc = _probe(path, "read_shard", "rewrite")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {path}: the shard changed while this run read it (rewritten in place); restore the file and start "
        f"the job again: it resumes from its last checkpoint"], proc.stderr[-2000:]
    tokens = _shard(path)
    opened = read_shard(path)
    write_shard(path, np.zeros(10, np.uint16))  # a new file renamed over it: the open one is still read
    assert np.array_equal(opened[1_000_000:1_000_010], tokens[1_000_000:1_000_010])
    assert np.array_equal(np.asarray(opened), tokens) and len(opened) == len(tokens)


SHARDS = ["--data.dataset", "shards", "--data.tokenizer", "none", "--model.vocab_size", "256"]


def test_a_shard_truncated_while_training_stops_in_one_line_and_the_run_resumes_once_restored(tmp_path):
    """A real run (checkpoints every 2 steps): its shard truncated after a few steps; the trainer stops with the
    line, exit 2 (not SIGBUS); with the file restored the same job resumes from its last checkpoint."""
    data = tmp_path / "data"
    data.mkdir()
    shard = data / "train_000.bin"
    _shard(shard, 400_000)
    original = shard.read_bytes()
    dump = tmp_path / "run"
    args = [*SHARDS, "--data.train_path", str(data), *CKPT_EVERY_2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torchtitan_ext.train", *TINY, "--job.dump_folder", str(dump), *args,
           "--training.steps", "100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if (dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 3:
                break
            time.sleep(0.2)
        os.truncate(shard, HEADER_BYTES + 1000)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == [f"error: {shard}: the shard changed while this run read it ({len(original)} bytes when the "
                      f"run opened it, {HEADER_BYTES + 1000} now); restore the file and start the job again: it "
                      f"resumes from its last checkpoint"], err[-3000:]
    saved = max(int(p.name.removeprefix("step-")) for p in (dump / "checkpoint").glob("step-*"))
    shard.write_bytes(original)  # restored in place
    resumed = run_trainer(dump, 0, *args, "--training.steps", str(saved + 2))
    assert f"step-{saved}" in resumed.stdout + resumed.stderr
    steps = [r["step"] for r in read_metrics(dump)]
    assert steps[-2:] == [saved + 1, saved + 2]
    assert json.loads((dump / "run.json").read_text())["starts"][-1]["step"] == saved


def test_a_truncated_run_json_is_said_and_kept_aside_on_resume(checkpointed_run, tmp_path):
    """The resume used to rewrite a truncated run.json silently (the first start's record, and with it the
    changed-settings check, lost); now it is renamed aside unchanged, one line says so, and the new record
    starts with this start."""
    import shutil

    dump = tmp_path / "run"
    shutil.copytree(checkpointed_run, dump, ignore=shutil.ignore_patterns(".lock"))
    whole = (dump / "run.json").read_bytes()
    (dump / "run.json").write_bytes(whole[:len(whole) // 2])
    proc = run_trainer(dump, 0, *CKPT_EVERY_2, "--training.steps", "6")
    aside = list(dump.glob("run-damaged-*.json"))
    assert len(aside) == 1 and aside[0].read_bytes() == whole[:len(whole) // 2]
    lines = [line for line in proc.stdout.splitlines() if "run.json" in line]
    assert len(lines) == 1 and lines[0].startswith(f"warning: {dump / 'run.json'} is damaged (JSONDecodeError: "), \
        proc.stdout[-3000:]
    assert lines[0].endswith(f"); kept aside as {aside[0]}; this start begins a new record, so the settings of the "
                             f"starts before it are not compared with this one's")
    record = json.loads((dump / "run.json").read_text())
    assert [s["step"] for s in record["starts"]] == [4] and record["first_identity"] == record["identity"]
    assert [r["step"] for r in read_metrics(dump)][-2:] == [5, 6]


def test_a_sidecar_shortened_under_a_student_run_is_one_line(tmp_path):
    """A teacher sidecar is read by the student's run the same way: its rows by pread, a shortened file one
    line naming it (the ShardError the trainer ends on, exit 2) rather than SIGBUS."""
    import pytest

    from torchtitan_ext.data.shards import ShardError
    from torchtitan_ext.distill.sidecar import Sidecar

    tokens = (np.arange(4097) % 200).astype(np.int64)
    path = tmp_path / "train_000.bin.topk"
    side = Sidecar.create(path, 4, 256, tokens, 64)
    side.tokens[:] = 7
    side.set_windows_done(side.n_windows())
    del side
    side = Sidecar(path)
    assert side.tokens[1].tolist() == [7] * 4 and side.tokens[1:65].shape == (64, 4)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(ShardError) as changed:
        side.tokens[4000:4064]
    assert str(changed.value) == (f"{path}: the sidecar changed while this run read it ({size} bytes when the run "
                                  f"opened it, {size // 2} now); restore the file and start the job again: it "
                                  f"resumes from its last checkpoint")
