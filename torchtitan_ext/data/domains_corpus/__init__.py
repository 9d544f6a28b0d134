"""A small multi-domain corpus from text that Debian and Python install on every machine (no internet):

    python -m torchtitan_ext.data.domains_corpus --output ~/.cache/torchtitan_ext/domains --tokenizer byte

- ``code``: the Python standard library's ``.py`` sources;
- ``prose``: packaged documentation under /usr/share/doc (``.md``, ``.rst``, ``.txt``, README and copyright
  files: English prose, licences);
- ``man``: manual pages under /usr/share/man (roff with the formatting requests stripped: technical text).

Each domain gets ``<output>/<tokenizer>/<domain>/train.bin`` and ``val.bin`` (about 2% of the documents,
chosen by a hash of their path), at most ``--max-mb`` of text per domain. A missing source is skipped with
one line; fewer than two domains is an error.
"""

from __future__ import annotations

import gzip
import logging
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from torchtitan_ext.data.corpus import stdlib_files
from torchtitan_ext.data.shards import write_shard
from torchtitan_ext.data.tokenizers import open_tokenizer

logger = logging.getLogger(__name__)
_ROFF_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_ROFF_REQ = re.compile(r"^\.(?:[A-Za-z]{1,3})\s?")


def _prose_files() -> list[Path]:
    root = Path("/usr/share/doc")
    keep = re.compile(r"(\.(md|rst|txt)$)|(^(README|copyright)$)", re.IGNORECASE)
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and keep.search(p.name))


def _man_files() -> list[Path]:
    root = Path("/usr/share/man")
    return sorted(p for p in root.glob("man[1-8]/*.gz") if p.is_file() and not p.is_symlink())


def man_text(roff: str) -> str:
    """Readable text of a manual page: comments dropped, requests (``.SH``, ``.B`` ...) and font escapes
    removed, ``\\-`` as ``-``."""
    out = []
    for line in roff.splitlines():
        if line.startswith(('.\\"', "'\\\"")) or line.strip() in (".", ".PP", ".LP", ".P", ".br", ".sp"):
            continue
        line = _ROFF_REQ.sub("", line)
        line = _ROFF_FONT.sub("", line)
        for escape, plain in (("\\,", ""), ("\\/", ""), ("\\-", "-"), ("\\(em", "-"), ("\\e", "\\")):
            line = line.replace(escape, plain)
        out.append(line.strip('"'))
    return "\n".join(out).strip()


def _read(path: Path) -> str:
    if path.suffix == ".gz":
        return man_text(gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace"))
    return path.read_text(encoding="utf-8", errors="replace")


SOURCES = {"code": stdlib_files, "prose": _prose_files, "man": _man_files}


def build(output: Path, tokenizer: str, vocab_size: int, cache_dir: Path, max_mb: float,
          report: Callable[[str], None] = logger.info) -> dict[str, dict]:
    """Write the shards; {domain: {"train": path, "val": path, "documents": n, "tokens": n}}. ``report``
    receives one line per domain (and per skipped one)."""
    tok = open_tokenizer(tokenizer, vocab_size, cache_dir)
    eot = np.array([tok.eot_id], dtype=np.int32)
    built = {}
    for name, source in SOURCES.items():
        try:
            files = source()
        except OSError:
            files = []
        if not files:
            report(f"warning: domain {name!r}: no source files on this machine, skipped")
            continue
        parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        budget, docs = int(max_mb * 1e6), 0
        for f in files:
            text = _read(f)
            if len(text) < 200:
                continue
            split = "val" if zlib.crc32(str(f).encode()) % 50 == 0 else "train"
            parts[split] += [np.asarray(tok.encode(text), dtype=np.int32), eot]
            docs += 1
            budget -= len(text)
            if budget <= 0:
                break
        if not parts["val"]:  # a tiny source: its last document validates
            parts["train"], parts["val"] = parts["train"][:-2], parts["train"][-2:]
        folder = output / tok.name / name
        folder.mkdir(parents=True, exist_ok=True)
        entry = {"documents": docs}
        for split, arrays in parts.items():
            write_shard(folder / f"{split}.bin", np.concatenate(arrays))
            entry[split] = str(folder / f"{split}.bin")
            entry[f"{split}_tokens"] = int(sum(map(len, arrays)))
        built[name] = entry
        report(f"{name}: {docs:,} documents, {entry['train_tokens']:,} train + {entry['val_tokens']:,} val "
               f"tokens -> {folder}")
    if len(built) < 2:
        raise FileNotFoundError(f"only {len(built)} domain(s) found on this machine; mixing needs two or more")
    return built
