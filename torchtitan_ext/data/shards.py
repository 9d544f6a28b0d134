"""Token shards in the modded-nanogpt / parameter-golf format, read with ``os.pread``.

A shard is a header of 256 little-endian int32 (``[0]`` magic 20240520, ``[1]`` version, ``[2]`` token
count), then the tokens: uint16 for version 1 (the published format, so FineWeb shards train as they are)
and uint32 for version 2 (our extension for vocabularies over 65,535).

``scan_shards`` checks every shard's header and token range at start-up, so a damaged file or a token id
beyond the model's vocabulary stops the job before any work rather than at the batch that holds it; the
largest id of each shard is cached by path, size and mtime, so a large dataset is read once.

A shard is read through ``FileArray``, never a live memory map: a mapped file truncated while a run reads
it kills the process with SIGBUS (exit 135, no line) at the first page past its new end. Each read compares
the file's size and modification time with those checked when it was opened, so a shard shortened or
rewritten in place under a run stops it with a ``ShardError`` naming the file (the run resumes from its last
checkpoint once the file is restored); a shard replaced by a new file (renamed over it) is read as it was
checked, through the descriptor opened then.
"""

from __future__ import annotations

import glob
import json
import os
import weakref
from pathlib import Path

import numpy as np

from torchtitan_ext.errors import UserError

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
DTYPES = {1: np.uint16, 2: np.uint32}


class ShardError(UserError):
    """A token shard that cannot be read as one (bad magic, unknown version, truncated body)."""


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write ``tokens`` atomically (temporary file, then rename); uint16 when every id fits."""
    tokens = np.asarray(tokens)
    version = 1 if tokens.size == 0 or int(tokens.max()) < 2**16 else 2
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, version, tokens.size)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype(np.dtype(DTYPES[version]).newbyteorder("<"), copy=False).tobytes())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, Ctrl-C: no partial file; an earlier shard at ``path`` stays
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # write() and close() do not say which file
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


_READ_CHUNK = 1 << 30  # bytes per pread: Linux returns at most ~2 GiB from one call


class FileArray:
    """A read-only array of ``shape`` stored in a file at ``offset``, read on demand with ``os.pread`` from a
    descriptor it owns (``fd``): ``len``, an index or a slice of rows (a read-only array of them) and
    ``np.asarray`` (all of it), like the memmap it replaces. Each read checks the file's size and modification
    time against those at opening: ``ShardError`` naming the file (``what`` it is) when it changed."""

    def __init__(self, path: Path, fd: int, dtype: np.dtype, offset: int, shape: tuple[int, ...], what: str):
        self.path, self.dtype, self.shape, self.what = path, np.dtype(dtype), shape, what
        self._offset, self._row_bytes = offset, self.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        st = os.fstat(fd)
        self._fd, self._stamp = fd, (st.st_size, st.st_mtime_ns)
        weakref.finalize(self, os.close, fd)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: int | slice) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            rows = self._rows(start, max(0, stop - start))
            return rows[::step] if step != 1 else rows
        index = int(key)
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.path}: row {index} of {len(self)}")
        return self._rows(index % len(self), 1)[0]

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype)

    def _rows(self, start: int, n: int) -> np.ndarray:
        data = self._read(self._offset + start * self._row_bytes, n * self._row_bytes)
        return np.frombuffer(data, self.dtype).reshape((n, *self.shape[1:]))

    def _read(self, offset: int, nbytes: int) -> bytes:
        self._check()
        parts, done = [], 0
        while done < nbytes:
            part = os.pread(self._fd, min(_READ_CHUNK, nbytes - done), offset + done)
            if not part:  # shortened between the check and the read
                self._check()
                raise self._changed(os.fstat(self._fd).st_size)
            parts.append(part)
            done += len(part)
        return b"".join(parts)

    def _check(self) -> None:
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            raise self._changed(st.st_size)

    def _changed(self, size: int) -> ShardError:
        was = self._stamp[0]
        how = f"{was} bytes when the run opened it, {size} now" if size != was else "rewritten in place"
        return ShardError(f"{self.path}: the {self.what} changed while this run read it ({how}); restore the file "
                          f"and start the job again: it resumes from its last checkpoint")


def read_shard(path: str | os.PathLike) -> FileArray | np.ndarray:
    """The shard's tokens (a ``FileArray``; an empty array for an empty shard), after checking its header and
    length; ShardError naming the file when it is not valid."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return _checked(path, fd)
    except BaseException:
        os.close(fd)
        raise


def _checked(path: Path, fd: int) -> FileArray | np.ndarray:
    size = os.fstat(fd).st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    header = np.frombuffer(os.pread(fd, HEADER_BYTES, 0), dtype="<i4")
    if len(header) < HEADER_INTS:  # shortened since the fstat
        raise ShardError(f"{path}: {len(header) * 4} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); not a token shard")
    version, count = int(header[1]), int(header[2])
    if count < 0:
        raise ShardError(f"{path}: the header announces {count} tokens (expected a count >= 0); damaged shard")
    if version not in DTYPES:
        raise ShardError(f"{path}: unknown shard version {version} (expected 1 = uint16 or 2 = uint32)")
    expected = HEADER_BYTES + count * np.dtype(DTYPES[version]).itemsize
    if size < expected:
        raise ShardError(f"{path}: truncated: the header announces {count} tokens ({expected} bytes) but "
                         f"the file has {size} bytes")
    if count == 0:
        os.close(fd)
        return np.zeros(0, dtype=DTYPES[version])
    return FileArray(path, fd, np.dtype(DTYPES[version]).newbyteorder("<"), HEADER_BYTES, (count,), "shard")


def list_shards(pattern: str, key: str) -> list[Path]:
    """Shards named by a folder (its ``*.bin``), a file or a glob, sorted; FileNotFoundError naming ``key``."""
    p = Path(os.path.expanduser(pattern))
    files = sorted(p.glob("*.bin")) if p.is_dir() else [Path(f) for f in sorted(glob.glob(str(p)))]
    if not files:
        raise FileNotFoundError(f"{key} = {pattern!r}: no token shards found")
    return files


SCAN_CACHE = "shard_scan.json"
_CHUNK = 1 << 26  # tokens per np.max call: bounded memory on multi-GiB shards


def _max_token(tokens: np.ndarray) -> int:
    return max((int(tokens[i:i + _CHUNK].max()) for i in range(0, len(tokens), _CHUNK)), default=-1)


def scan_shards(paths: list[Path], vocab_limit: int, cache_dir: str | os.PathLike) -> None:
    """ShardError naming the first shard whose header is bad or that holds a token id >= ``vocab_limit``."""
    cache_file = Path(cache_dir) / SCAN_CACHE
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):  # a damaged cache only costs a re-scan
        cache = {}
    changed = False
    for path in paths:
        st = Path(path).stat()
        key = str(Path(path).resolve())
        entry = cache.get(key)
        if not (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
                and isinstance(entry.get("max"), int)):
            entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "max": _max_token(read_shard(path))}
            cache[key], changed = entry, True
        else:
            read_shard(path)  # the header alone: cheap, and catches a file replaced within the mtime resolution
        if entry["max"] >= vocab_limit:
            break
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(f"{SCAN_CACHE}.{os.getpid()}.tmp")  # ranks may write at once
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # a read-only cache folder only costs a re-scan next time
    if paths and entry["max"] >= vocab_limit:
        raise ShardError(f"{path}: token id {entry['max']} >= model vocabulary {vocab_limit}; set "
                         f"model.vocab_size > {entry['max']} or re-tokenize the data")


def loader_shards(loader: object) -> list[Path]:
    """The shard files behind a loader (none for None), a mixture of domain loaders, or a dict of them."""
    if isinstance(loader, dict):
        return [p for v in loader.values() for p in loader_shards(v)]
    if hasattr(loader, "sources"):
        return [p for v in loader.sources for p in loader_shards(v)]
    return list(getattr(loader, "shards", []))
