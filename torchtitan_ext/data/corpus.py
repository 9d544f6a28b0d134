"""The built-in corpus: the Python standard library's own source files, present on every machine.

Tokenized once into shards under the cache folder (one process builds, the others wait on a file lock);
about 2% of the files, chosen by a hash of their path, form the validation split.
"""

from __future__ import annotations

import fcntl
import sys
import sysconfig
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from torchtitan_ext.data.shards import write_shard

_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path`` so that one process builds a cached file while the others wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_validation(path: Path) -> bool:
    return zlib.crc32(path.name.encode()) % 50 == 0


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def training_chunks(texts: list[str], lines: int = 24) -> list[str]:
    """Multi-line pieces of source (keeping newlines) as SentencePiece's training 'sentences'."""
    rows = [text.splitlines(keepends=True) for text in texts]
    chunks = ("".join(r[i:i + lines]) for r in rows for i in range(0, len(r), lines))
    return [c for c in chunks if c.strip()]


def _encode_all(tokenizer, texts: list[str]) -> np.ndarray:
    eot = np.array([tokenizer.eot_id], dtype=np.int32)
    return np.concatenate([part for doc in tokenizer.encode_batch(texts) for part in (doc, eot)])


def builtin_shards(tokenizer, cache_dir: Path) -> tuple[Path, Path]:
    """(train, validation) shard paths of the corpus under ``tokenizer``, built on first use."""
    folder = cache_dir / f"stdlib_py{sys.version_info[0]}{sys.version_info[1]}_{tokenizer.name}"
    train, val = folder / "train.bin", folder / "val.bin"
    with file_lock(cache_dir / "corpus.lock"):
        if not (train.is_file() and val.is_file()):
            folder.mkdir(parents=True, exist_ok=True)
            files = stdlib_files()
            for path, part in ((val, [f for f in files if is_validation(f)]),
                               (train, [f for f in files if not is_validation(f)])):
                write_shard(path, _encode_all(tokenizer, read_texts(part)))
    return train, val
