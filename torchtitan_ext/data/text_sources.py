"""The documents ``data.prepare`` reads, by format (``--format``, else from the file name): plain text (one
file, one document), JSONL (one line, one document: its ``text_key`` string; also ``.jsonl.gz`` and
``.jsonl.zst``, where a truncated, foreign or damaged stream is an InputError naming the file), parquet
(streamed one record batch at a time, so memory stays constant whatever the file's size: the format FineWeb,
DCLM and most Hub corpora ship in), and a Hugging Face ``datasets`` folder (saved with ``save_to_disk``, or
data files ``load_dataset`` can read locally). A new format is a reader here and a line in ``READERS``."""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from torchtitan_ext.errors import UserError

PARQUET_BATCH_ROWS = 1024


class InputError(UserError):
    """An input file or record that cannot be read as documents; one line naming it."""


def _needs(package: str, fmt: str):
    try:
        return __import__(package)
    except ImportError:
        raise InputError(f"--format {fmt} needs the {package} package: pip install -e '.[data]'") from None


def _text_of(record, text_key: str, where: str) -> str:
    if not isinstance(record, dict) or text_key not in record:
        raise InputError(f"{where}: expected a JSON object with a {text_key!r} string")
    text = record[text_key]
    if not isinstance(text, str):
        raise InputError(f"{where}: {text_key!r} is {type(text).__name__} {json.dumps(text)[:40]}, expected a string")
    return text


def read_text(path: Path, text_key: str) -> Iterator[str]:
    try:
        yield path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: undecodable UTF-8 at byte {e.start}") from None


class _Zstd(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file (one frame or several), raising InputError where the stream
    is not zstd, is damaged, or ends inside a frame: zstandard's own ``stream_reader`` ends a truncated stream
    as if it were complete, so a cut file read as fewer documents (or none) without a word."""

    CHUNK = 1 << 17

    def __init__(self, path: Path, zstandard) -> None:
        super().__init__()
        self.path, self.zstd_error = path, zstandard.ZstdError
        self.decompressor = zstandard.ZstdDecompressor()
        self.frame = self.decompressor.decompressobj()
        self.file = open(path, "rb")
        self.in_frame = False  # input fed to the current frame that has not yet ended it
        self.out = self.pos = 0  # decompressed bytes so far; the read position in ``buf``
        self.buf = b""

    def readable(self) -> bool:
        return True

    def _feed(self, data: bytes) -> None:
        parts = []
        while data:
            if self.frame.eof:  # the previous frame ended: the next begins in what it left
                self.frame = self.decompressor.decompressobj()
            try:
                parts.append(self.frame.decompress(data))
            except self.zstd_error as e:
                what = "not a zstd stream" if "Unknown frame descriptor" in str(e) else \
                    f"damaged zstd stream after {self.out + sum(map(len, parts)):,} bytes of text"
                raise InputError(f"{self.path}: cannot decompress: {what} (zstd: {e})") from None
            self.in_frame = not self.frame.eof
            data = self.frame.unused_data if self.frame.eof else b""
        self.buf, self.pos = self.buf[self.pos:] + b"".join(parts), 0
        self.out += sum(len(p) for p in parts)

    def readinto(self, b) -> int:
        while self.pos >= len(self.buf):
            data = self.file.read(self.CHUNK)
            if not data:
                if self.in_frame:
                    raise InputError(f"{self.path}: cannot decompress: truncated zstd stream (the file ends inside "
                                     f"a frame, after {self.out:,} bytes of text)")
                return 0
            self._feed(data)
        n = min(len(b), len(self.buf) - self.pos)
        b[:n] = self.buf[self.pos:self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


def _open_lines(path: Path) -> io.BufferedIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        return io.BufferedReader(_Zstd(path, _needs("zstandard", "jsonl")))
    return open(path, "rb")


def _gzip_error(path: Path, e: Exception) -> InputError:
    """A .gz stream that cannot be read, said as what it is (gzip raises EOFError for a cut file, BadGzipFile
    for a foreign or damaged one, zlib.error for damaged deflate data)."""
    if isinstance(e, EOFError):
        what = "truncated gzip stream (the file ends before its end-of-stream marker)"
    elif str(e).startswith("Not a gzipped file"):
        what = f"not a gzip stream ({e})"
    else:
        what = f"damaged gzip stream ({e})"
    return InputError(f"{path}: cannot decompress: {what}")


def read_jsonl(path: Path, text_key: str) -> Iterator[str]:
    with _open_lines(path) as f:
        lines = iter(f)
        n = 0
        while True:
            try:
                line = next(lines, None)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise _gzip_error(path, e) from None
            if line is None:
                return
            n += 1
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{n}: undecodable UTF-8 at byte {e.start} of the line") from None
            except json.JSONDecodeError:
                raise InputError(f"{path}:{n}: not a JSON object") from None
            yield _text_of(record, text_key, f"{path}:{n}")


def read_parquet(path: Path, text_key: str) -> Iterator[str]:
    _needs("pyarrow", "parquet")
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family for damaged files
        raise InputError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    names = file.schema_arrow.names
    if text_key not in names:
        raise InputError(f"{path}: no column {text_key!r} (columns: {', '.join(names)}); set --text-key")
    batches = file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key])
    for row, text in enumerate((t for batch in batches for t in batch.column(0).to_pylist()), 1):
        if not isinstance(text, str):
            raise InputError(f"{path}: row {row}: {text_key!r} is {type(text).__name__}, expected a string")
        yield text


def read_datasets(path: Path, text_key: str) -> Iterator[str]:
    datasets = _needs("datasets", "datasets")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local folder: never the network
    try:
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            data = datasets.load_from_disk(str(path))
        else:
            data = datasets.load_dataset(str(path), split="train")
    except Exception as e:  # datasets raises many families (FileNotFoundError, DatasetNotFoundError, ...)
        raise InputError(f"{path}: not a datasets folder ({type(e).__name__}: {str(e)[:200]})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise InputError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(data)})")
        data = data["train"]
    if text_key not in data.column_names:
        raise InputError(f"{path}: no column {text_key!r} (columns: {', '.join(data.column_names)}); set --text-key")
    for row, record in enumerate(data.select_columns([text_key]), 1):
        yield _text_of(record, text_key, f"{path}: row {row}")


READERS: dict[str, Callable[[Path, str], Iterator[str]]] = {
    "text": read_text,
    "jsonl": read_jsonl,
    "parquet": read_parquet,
    "datasets": read_datasets,
}


def detect_format(path: Path) -> str:
    """The reader for ``path`` by its name: a folder is a datasets folder."""
    name = path.name.lower()
    if path.is_dir():
        return "datasets"
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def read_documents(path: Path, text_key: str, fmt: str = "auto") -> Iterator[str]:
    """Every document of one input, in order."""
    if fmt != "auto" and fmt not in READERS:
        raise InputError(f"--format {fmt}: expected auto or one of {', '.join(READERS)}")
    yield from READERS[detect_format(path) if fmt == "auto" else fmt](path, text_key)
