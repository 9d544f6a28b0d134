"""``data.prepare``'s faults (issue 43): a truncated, foreign or damaged ``.jsonl.zst`` / ``.jsonl.gz`` is one line
naming the file (a cut ``.zst`` used to prepare 0 documents with exit 0); options that leave the training or the
validation split empty are refused with the counts; a real Ctrl-C to a real run with workers stops with one line
and exit 130 (no ``BrokenPipe`` traceback from the workers), leaves no partial shard and a rerun completes it; a
really full filesystem (a 1 MiB tmpfs) names the shard and ENOSPC. A run started with SIGINT ignored
(a background job of a script) still stops on one. Each test asserts the line, the exit code and
that what existed before is unchanged (checksums) with no partial file left."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from trainer_utils import REPO, file_checksums

from torchtitan_ext.data.prepare import STATE
from torchtitan_ext.data.shards import read_shard
from torchtitan_ext.errors import EXIT_INTERRUPTED
from torchtitan_ext.tools.prepare import main

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _jsonl(n: int, words: int = 80) -> bytes:
    """``n`` distinct documents of ``words`` random words (not near duplicates of each other)."""
    r = random.Random(0)
    return "".join(json.dumps({"text": " ".join(r.choice(WORDS) for _ in range(words))}) + "\n"
                   for _ in range(n)).encode()


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def _shards(folder: Path) -> dict[str, np.ndarray]:
    return {f.name: np.array(read_shard(f)) for f in sorted(folder.glob("*.bin"))}


def _existing_output(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An output folder that already holds a file of the user's, and its checksums."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file\n")
    return out, file_checksums(out)


def _compressed(kind: str, raw: bytes) -> tuple[str, bytes]:
    import zstandard

    packed = zstandard.ZstdCompressor().compress(raw) if kind.startswith("zst") else gzip.compress(raw)
    # (damaged deflate data decodes to garbage, caught as a bad JSON line or by the CRC at the end: no gz case)
    damaged = bytearray(packed)
    damaged[len(packed) // 2:len(packed) // 2 + 64] = bytes(64)
    return {"zst-cut": ("x.jsonl.zst", packed[:len(packed) // 2]), "zst-foreign": ("x.jsonl.zst", raw[:2000]),
            "zst-damaged": ("x.jsonl.zst", bytes(damaged)), "gz-cut": ("x.jsonl.gz", packed[:len(packed) // 2]),
            "gz-foreign": ("x.jsonl.gz", raw[:2000])}[kind]


@pytest.mark.parametrize("kind, reason", [
    ("zst-cut", "truncated zstd stream (the file ends inside a frame, after 0 bytes of text)"),
    ("zst-foreign", "not a zstd stream (zstd: zstd decompressor error: Unknown frame descriptor)"),
    ("zst-damaged", "damaged zstd stream after 0 bytes of text (zstd: zstd decompressor error: Data corruption "
                    "detected)"),
    ("gz-cut", "truncated gzip stream (the file ends before its end-of-stream marker)"),
    ("gz-foreign", "not a gzip stream (Not a gzipped file (b'{\"'))"),
])
def test_a_broken_compressed_input_is_one_line(tmp_path, capsys, kind, reason):
    """The stream's fault in one line naming the file, exit 2, no shard and no partial file written; the output
    folder's earlier file is unchanged; a folder the run created is not left behind empty."""
    name, data = _compressed(kind, _jsonl(60))
    src = tmp_path / name
    src.write_bytes(data)
    out, before = _existing_output(tmp_path)
    assert main(["--input", str(src), "--output-dir", str(out), "--shard-tokens", "100000"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"error: {src}: cannot decompress: {reason}"), errors
    assert file_checksums(out) == before
    assert main(["--input", str(src), "--output-dir", str(tmp_path / "new" / "sub"), "--shard-tokens", "100000"]) == 2
    assert _errors(capsys) == errors and not (tmp_path / "new").exists()


def test_a_cut_gzip_keeps_whole_shards_and_resumes_once_the_file_is_whole(tmp_path, capsys):
    """Shards completed before the cut stay (whole, readable, no .tmp); with the complete file the same command
    resumes and ends identical to a preparation of the complete file."""
    raw = _jsonl(200)
    whole, cut = tmp_path / "whole" / "x.jsonl.gz", tmp_path / "x.jsonl.gz"
    whole.parent.mkdir()
    whole.write_bytes(gzip.compress(raw))
    cut.write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    args = ["--shard-tokens", "5000", "--val-shards", "1"]
    out = tmp_path / "out"
    assert main(["--input", str(cut), "--output-dir", str(out), *args]) == 2
    assert _errors(capsys) == [f"error: {cut}: cannot decompress: truncated gzip stream (the file ends before its "
                               "end-of-stream marker)"]
    kept = _shards(out)
    assert len(kept) >= 2 and not list(out.glob("*.tmp"))
    cut.write_bytes(whole.read_bytes())  # the user fetches the file again
    assert main(["--input", str(cut), "--output-dir", str(out), *args]) == 0
    assert "resuming after record" in capsys.readouterr().err
    assert main(["--input", str(whole), "--output-dir", str(tmp_path / "ref"), *args]) == 0
    ref, got = _shards(tmp_path / "ref"), _shards(out)
    assert list(ref) == list(got) and all(np.array_equal(ref[k], got[k]) for k in ref)


def test_options_that_empty_a_split_are_refused(tmp_path, capsys):
    """``--val-shards 5`` (or 3) with three shards' worth of data wrote 0 training shards without a word; input
    that the filters remove entirely wrote nothing with exit 0. Now one line with the counts, exit 2, the val
    shards already written removed, the folder's earlier file unchanged."""
    src = tmp_path / "a.jsonl"
    src.write_bytes(_jsonl(30, words=10))  # 30 documents, 1,800-odd byte tokens: 2 shards of 1,000
    out, before = _existing_output(tmp_path)
    tokens = sum(len(json.loads(line)["text"].encode()) + 1 for line in src.read_text().splitlines())
    for val in (5, 2):
        assert main(["--input", str(src), "--output-dir", str(out), "--shard-tokens", "1000",
                     "--val-shards", str(val)]) == 2
        assert _errors(capsys) == [
            f"error: --val-shards {val}: the input holds {tokens:,} tokens from 30 documents, 2 shard(s) of "
            "--shard-tokens 1,000, so no training shard would be left; expected --val-shards < 2 (or a smaller "
            "--shard-tokens)"]
        assert file_checksums(out) == before
    assert main(["--input", str(src), "--output-dir", str(out), "--shard-tokens", "1000", "--val-shards", "1"]) == 0
    assert sorted(_shards(out)) == ["train_000000.bin", "val_000000.bin"]
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": "x"}) + "\n" for _ in range(3)))
    assert main(["--input", str(tiny), "--output-dir", str(tmp_path / "t"), "--filters", "heuristics"]) == 2
    assert _errors(capsys) == [f"error: --input {tiny}: no tokens to write: 3 documents read, all 3 removed by "
                               "--filters heuristics"]
    assert not (tmp_path / "t").exists()


def test_ctrl_c_with_workers_stops_cleanly_and_a_rerun_completes(tmp_path, capsys):
    """A real SIGINT to the process group of a real ``python -m torchtitan_ext.data.prepare --workers 2`` once
    its first shard is written (a terminal's Ctrl-C reaches the workers too): one line, exit 130, no traceback
    from any process, no partial shard; the same command again resumes and ends identical to an uninterrupted
    preparation."""
    src = tmp_path / "a.jsonl"
    # Long enough (about 130 shards) that the run is still writing when the interrupt, sent once the first
    # shard is written, arrives, on a loaded machine too.
    src.write_bytes(_jsonl(6000))
    out = tmp_path / "out"
    args = ["--input", str(src), "--shard-tokens", "20000", "--chunk-docs", "16", "--filters", "heuristics,minhash"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torchtitan_ext.data.prepare", *args, "--output-dir", str(out),
                             "--workers", "2"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / STATE).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, f"the run ended before the interrupt: {proc.communicate()}"
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    # Nothing but progress lines and the one line: before, the workers printed "Process ForkPoolWorker-1:" and
    # KeyboardInterrupt / BrokenPipe tracebacks, depending on where the signal found them.
    assert [line for line in stderr.splitlines() if not line.startswith("prepare: ")] == [
        f"error: interrupted (SIGINT): stopped; the whole shards written so far are kept in {out}: run the same "
        "command again to resume"]
    assert not list(out.glob("*.tmp"))
    interrupted = _shards(out)  # every shard left is whole (read_shard checks its length)
    assert 1 <= len(interrupted)
    assert main([*args, "--output-dir", str(out)]) == 0
    assert "resuming after record" in capsys.readouterr().err
    assert main([*args, "--output-dir", str(tmp_path / "ref")]) == 0
    ref, got = _shards(tmp_path / "ref"), _shards(out)
    assert len(ref) > len(interrupted) and list(ref) == list(got)
    assert all(np.array_equal(ref[k], got[k]) for k in ref)


def test_ctrl_c_stops_a_run_started_with_sigint_ignored(tmp_path):
    """A parent that ignores SIGINT (a non-interactive shell's background job, ``cmd &``) passes SIG_IGN to its
    child across exec, and Python then installs no ``KeyboardInterrupt`` handler: the run went on through the
    interrupt and exited 0. The input is a FIFO the test keeps open, so the run is waiting for more text when
    the signal comes, however loaded the machine: one line, exit 130, the whole shards kept."""
    fifo = tmp_path / "a.jsonl"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # open both ends: neither this open nor the child's waits for the other
    out = tmp_path / "out"
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "torchtitan_ext.data.prepare", "--input", str(fifo),
                                 "--output-dir", str(out), "--shard-tokens", "1000", "--chunk-docs", "1"], cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        os.write(writer, _jsonl(10))  # 4,174 byte tokens: 4 whole shards, then the run waits for more
        deadline = time.monotonic() + 120
        while not (out / STATE).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, f"the run ended before the interrupt: {proc.communicate()}"
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # the interrupt was ignored: the end of the input lets the run finish
            os.close(writer)
            writer = None
            stdout, stderr = proc.communicate(timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    assert [line for line in stderr.splitlines() if not line.startswith("prepare: ")] == [
        f"error: interrupted (SIGINT): stopped; the whole shards written so far are kept in {out}: run the same "
        "command again to resume"]
    assert not list(out.glob("*.tmp")) and 1 <= len(_shards(out)) <= 4


@pytest.fixture
def small_fs(tmpfs):
    """A real 1 MiB filesystem (integration/conftest.py's tmpfs)."""
    return tmpfs("1m")


def test_a_full_disk_names_the_shard_and_enospc(small_fs, tmp_path, capsys):
    """Shards of 150,000 byte tokens (300 KB each): three fit in 1 MiB, the fourth fills it. One line naming the
    shard and ENOSPC, exit 2, its partial file removed, the three before it whole and equal to a preparation on a
    roomy disk, and the state pointing at the fourth."""
    src = tmp_path / "a.jsonl"
    src.write_bytes(_jsonl(1500))
    args = ["--input", str(src), "--shard-tokens", "150000"]
    out = small_fs / "out"
    assert main([*args, "--output-dir", str(out)]) == 2
    assert _errors(capsys) == [f"error: {out}/train_000003.bin: No space left on device (ENOSPC); the whole shards "
                               f"written so far are kept in {out}: run the same command again to resume"]
    assert sorted(p.name for p in out.iterdir()) == [STATE, *(f"train_00000{i}.bin" for i in range(3))]
    assert main([*args, "--output-dir", str(tmp_path / "ref")]) == 0
    ref, got = _shards(tmp_path / "ref"), _shards(out)
    assert len(ref) > 3 and all(np.array_equal(ref[k], got[k]) for k in got)


def test_a_full_disk_while_caching_the_ppl_scores_leaves_no_partial_file(small_fs, tmp_path):
    """The ``ppl`` filter's score cache (2.4 MB here) does not fit: OSError naming the cache and ENOSPC (what the
    tool prints as one line), no ``ppl_scores.tmp.npy`` left."""
    import errno

    from torchtitan_ext.data.prepare import Hooks, prepare
    from torchtitan_ext.tools.prepare import _parser

    src = tmp_path / "a.jsonl"
    src.write_bytes(_jsonl(20, words=10))
    out = small_fs / "out"
    opts = _parser().parse_args(["--input", str(src), "--output-dir", str(out), "--filters", "ppl",
                                 "--ppl-checkpoint", "unused", "--shard-tokens", "1000"])
    with pytest.raises(OSError) as e:
        prepare(opts, Hooks(ppl_scorer=lambda texts: np.zeros(300_000), show=None))
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(out / "ppl_scores.npy"))
    assert sorted(p.name for p in small_fs.rglob("*")) == []
