"""Token shards, the distributed loader, and the prepare command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from torchtitan_ext.data.packers.concat import TokenDataLoader
from torchtitan_ext.data.prepare.__main__ import main as prepare
from torchtitan_ext.data.shards import MAGIC, ShardError, read_shard, write_shard
from torchtitan_ext.data.tokenizers import ByteTokenizer


def test_shard_header_and_roundtrip(tmp_path):
    tokens = np.arange(1000, dtype=np.int64) % 50257
    write_shard(tmp_path / "a.bin", tokens)
    raw = (tmp_path / "a.bin").read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert list(header[:3]) == [MAGIC, 1, 1000] and not header[3:].any()
    assert len(raw) == 1024 + 2 * 1000  # uint16 body, as modded-nanogpt writes it
    assert np.array_equal(read_shard(tmp_path / "a.bin"), tokens)
    big = np.array([0, 70000, 151935])
    write_shard(tmp_path / "b.bin", big)
    assert np.frombuffer((tmp_path / "b.bin").read_bytes()[:12], dtype="<i4")[1] == 2
    assert np.array_equal(read_shard(tmp_path / "b.bin"), big)


def test_bad_shards_are_refused_naming_the_file(tmp_path):
    write_shard(tmp_path / "ok.bin", np.arange(100))
    raw = bytearray((tmp_path / "ok.bin").read_bytes())
    (tmp_path / "trunc.bin").write_bytes(raw[:-10])
    with pytest.raises(ShardError, match=r"trunc\.bin: truncated"):
        read_shard(tmp_path / "trunc.bin")
    raw[0] ^= 1
    (tmp_path / "magic.bin").write_bytes(raw)
    with pytest.raises(ShardError, match=r"magic\.bin: bad magic"):
        read_shard(tmp_path / "magic.bin")


def _loader(shards, rank, world, batch, seed=0, shuffle=True):
    return TokenDataLoader(shards, seq_len=8, local_batch_size=batch, dp_rank=rank, dp_world_size=world,
                           seed=seed, shuffle=shuffle)


@pytest.fixture
def shards(tmp_path):
    paths = []
    for i, n in enumerate([400, 257, 90]):
        write_shard(tmp_path / f"s{i}.bin", np.arange(n) + 1000 * i)
        paths.append(tmp_path / f"s{i}.bin")
    return paths


def test_ranks_read_disjoint_parts_of_the_same_global_batch(shards):
    one = _loader(shards, 0, 1, 8)
    parts = [_loader(shards, r, 4, 2) for r in range(4)]
    for _ in range(20):  # several epochs (91 windows)
        ref = one.next_batch()
        got = [p.next_batch() for p in parts]
        assert np.array_equal(np.concatenate([g.inputs for g in got]), ref.inputs)
        assert np.array_equal(np.concatenate([g.domains for g in got]), ref.domains)
        rows = {tuple(r) for g in got for r in g.inputs.tolist()}
        assert len(rows) == 8  # disjoint
    b = one.next_batch()
    assert np.array_equal(b.labels[:, :-1], b.inputs[:, 1:])
    assert ((b.inputs // 1000) == b.domains[:, None]).all()  # every window lies inside one shard


def test_state_resumes_under_another_world_size(shards):
    a = _loader(shards, 0, 2, 3)
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    b = _loader(shards, 1, 3, 2)  # same global batch of 6, other layout
    b.load_state_dict(state)
    a.next_batch()
    ref = _loader(shards, 0, 1, 6)
    ref.load_state_dict(state)
    assert np.array_equal(b.next_batch().inputs, ref.next_batch().inputs[2:4])


def test_shuffle_is_seeded_and_changes_per_epoch(shards):
    def epoch_order(seed):
        ld = _loader(shards, 0, 1, 1, seed=seed)
        return [tuple(ld.next_batch().inputs[0].tolist()) for _ in range(2 * ld.n_windows)]
    a = epoch_order(0)
    assert a == epoch_order(0) and a != epoch_order(1)
    n = len(a) // 2
    assert sorted(a[:n]) == sorted(a[n:]) and a[:n] != a[n:]


def test_prepare_writes_documents_separated_by_eot(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "wörld"}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    out = tmp_path / "shards"
    assert prepare(["--input", str(tmp_path / "*.txt"), str(tmp_path / "*.jsonl"), "--output", str(out),
                    "--shard-tokens", "6", "--val-shards", "1"]) == 0
    files = sorted(out.glob("*.bin"))
    assert [f.name for f in files] == ["train_000000.bin", "train_000001.bin", "val_000000.bin"]
    stream = np.concatenate([read_shard(out / n) for n in ("val_000000.bin", "train_000000.bin",
                                                           "train_000001.bin")])
    tok = ByteTokenizer()
    docs = [tok.decode(d) for d in np.split(stream, np.flatnonzero(stream == tok.eot_id) + 1)[:-1]]
    assert docs == ["hello", "wörld", "x"]
    assert prepare(["--input", str(tmp_path / "missing*.txt"), "--output", str(out)]) == 2


def test_bad_jsonl_line_names_file_and_line(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    assert prepare(["--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "c.jsonl:2: expected a JSON object with a 'text' string" in capsys.readouterr().err
