"""A checksum per checkpoint file: ``step-N/checksums.json`` records each file's size and CRC-32, written
when the save completes and before the folder is published, and checked before a load reads anything.

Each rank sums the files it wrote itself (DCP's ``__<rank>_<i>.distcp``, its ``squinch_residuals/rank-<r>.pt``;
rank 0 also ``.metadata`` and anything else), so the cost of a save is spread like the writes; a load splits
the manifest's files over the ranks the same way. CRC-32 (``zlib``) finds zeroed blocks, random bytes,
truncation and empty files; it is not a defence against deliberate tampering. A checkpoint written before
checksums existed has no manifest and loads unverified (the manager says so).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

MANIFEST = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.pt)$")


class ManifestUnreadable(ValueError):
    """``checksums.json`` exists but is not a manifest (empty, truncated, not JSON)."""


def crc32_of(path: Path) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of ``path``, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def _writer_rank(name: str) -> int:
    """The rank that wrote a file of the checkpoint, by its name (0 for ``.metadata`` and the rest)."""
    m = _RANK_FILE.match(name)
    return int(m[1] or m[2]) if m else 0


def files_written_by(folder: Path, rank: int) -> list[str]:
    """The files of ``folder`` (relative, sorted) that ``rank`` sums at save time; the manifest excluded."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return [n for n in names if n != MANIFEST and _writer_rank(Path(n).name) == rank]


def checksum(folder: Path, names: list[str]) -> dict[str, dict]:
    """``name -> {"size", "crc32"}`` for ``names`` under ``folder`` (an OSError propagates)."""
    out = {}
    for name in names:
        size, crc = crc32_of(folder / name)
        out[name] = {"size": size, ALGORITHM: crc}
    return out


def write_manifest(folder: Path, files: dict[str, dict]) -> None:
    """``folder/checksums.json``, written whole (temporary file, fsync, rename)."""
    path, tmp = folder / MANIFEST, folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The manifest's files, or None when the checkpoint has none (written before checksums existed)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        if record.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {record.get('algorithm')!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestUnreadable(f"{path}: the checksum manifest is unreadable ({type(e).__name__}: "
                                 f"{str(e).strip()[:120] or 'empty'})") from None
    return files


def first_damage(folder: Path, files: dict[str, dict], part: int = 0, parts: int = 1) -> str | None:
    """Check every ``parts``-th file of the manifest starting at ``part``; the first damaged one as one line
    naming the file (missing, another size, another checksum), None when all of them match."""
    for name in sorted(files)[part::parts]:
        want, path = files[name], folder / name
        try:
            size, crc = crc32_of(path)
        except FileNotFoundError:
            return f"{path} is missing"
        except OSError as e:
            return f"{path} cannot be read ({e.strerror or e})"
        if size != want.get("size"):
            return f"{path} has {size} bytes, {want.get('size')} when saved: damaged after it was written"
        if crc != want.get(ALGORITHM):
            return (f"{path} fails its checksum ({ALGORITHM} {crc}, {want.get(ALGORITHM)} when saved): damaged "
                    f"after it was written")
    return None
