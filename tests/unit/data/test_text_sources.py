"""data.prepare's readers: parquet (by record batch), JSONL plain / gz / zst, datasets folders; one-line
errors naming the file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from torchtitan_ext.data.text_sources import InputError, detect_format, read_documents

DOCS = [f"document {i}: " + "word " * (i % 7) + "\N{SNOWMAN}" * (i % 3) for i in range(2500)]


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def test_parquet_streams_every_row_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), path, row_group_size=700)
    assert detect_format(path) == "parquet"
    assert list(read_documents(path, "text")) == DOCS
    with pytest.raises(InputError, match=r"part.parquet: no column 'content' \(columns: id, text\)"):
        list(read_documents(path, "content"))
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", None]}), nulls)
    with pytest.raises(InputError, match=r"nulls.parquet: row 2: 'text' is NoneType"):
        list(read_documents(nulls, "text"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(InputError, match="broken.parquet: not a readable parquet file"):
        list(read_documents(broken, "text"))


def test_jsonl_plain_gzip_and_zstd(tmp_path):
    import zstandard

    raw = _jsonl(DOCS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        assert detect_format(tmp_path / name) == "jsonl"
        assert list(read_documents(tmp_path / name, "text")) == DOCS
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(raw)[:-40])
    with pytest.raises(InputError, match="cut.jsonl.gz: cannot decompress"):
        list(read_documents(tmp_path / "cut.jsonl.gz", "text"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: 'text' is int 3, expected a string"):
        list(read_documents(tmp_path / "bad.jsonl", "text"))


def test_datasets_saved_and_data_file_folders(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS[:300], "n": list(range(300))}).save_to_disk(str(saved))
    assert detect_format(saved) == "datasets"
    assert list(read_documents(saved, "text")) == DOCS[:300]
    folder = tmp_path / "files" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:200]}), folder / "train-00000.parquet")
    assert list(read_documents(tmp_path / "files", "text", "datasets")) == DOCS[:200]
    with pytest.raises(InputError, match="no column 'body'"):
        list(read_documents(saved, "body"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="empty: not a datasets folder"):
        list(read_documents(empty, "text"))


def test_unknown_format_is_one_line(tmp_path: Path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(InputError, match="--format csv: expected auto or one of text, jsonl, parquet, datasets"):
        list(read_documents(tmp_path / "x.txt", "text", "csv"))
