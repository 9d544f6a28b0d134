"""Teacher sidecar files: a teacher's Gumbel top-k per token position, aligned with one token shard.

``<shard name>.topk`` beside nothing else: a 256 x int32 header (magic 20241124, version 1, k, vocabulary,
token count of the shard, teacher window length, windows complete, crc32 of the shard's tokens), then three
(tokens, k) arrays: kept token ids (int32), their clean log-probabilities (float32), thresholds (float32).
Row j holds the teacher's prediction of token j of the shard from the tokens before it in the same window of
``window + 1`` tokens, the student's windows: window w covers tokens [w L, w L + L] and fills rows
w L + 1 .. w L + L; row 0 and the tail past the last whole window are never read (ids -1). The header's
windows-complete count makes the teacher pass resumable; a reader accepts only complete sidecars whose
token count, window length and checksum match the shard, and checks every batch it reads.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.data.shards import FileArray, ShardError

MAGIC, VERSION, HEADER_INTS = 20241124, 1, 256
ROW_BYTES_PER_K = 4 + 4 + 4


class SidecarError(ShardError):
    """A missing, incomplete, corrupted or misaligned sidecar (one line, names the file; the trainer reports
    it like a bad shard: ``error: ...``, exit 2)."""


def sidecar_path(folder: str | Path, shard: Path) -> Path:
    return Path(folder) / (shard.name + ".topk")


def shard_checksum(tokens: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(tokens).tobytes()) & 0x7FFFFFFF


class Sidecar:
    """The arrays of one sidecar file, read with ``os.pread`` (``FileArray``) in mode "r", memory-mapped for
    the teacher pass that writes them (mode "r+"); ``create`` makes a new (or reopens a partial) one."""

    def __init__(self, path: Path, mode: str = "r"):
        self.path = path
        try:
            header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
        except OSError as e:
            raise SidecarError(f"{path}: cannot read sidecar ({e.strerror})") from None
        if len(header) < HEADER_INTS or header[0] != MAGIC:
            raise SidecarError(f"{path}: not a teacher sidecar (bad magic number)")
        if header[1] != VERSION:
            raise SidecarError(f"{path}: sidecar version {header[1]}, expected {VERSION}")
        self.k, self.vocab, self.n_tokens, self.window, self.windows_done, self.checksum = map(int, header[2:8])
        expect = HEADER_INTS * 4 + self.n_tokens * self.k * ROW_BYTES_PER_K
        if self.k < 1 or self.n_tokens < 0 or path.stat().st_size != expect:
            raise SidecarError(f"{path}: {path.stat().st_size} bytes, expected {expect} for k = {self.k} and "
                               f"{self.n_tokens} tokens (truncated or corrupted)")
        off, rows = HEADER_INTS * 4, (self.n_tokens, self.k)
        offsets = (off, off + self.n_tokens * self.k * 4, off + self.n_tokens * self.k * 8)
        if mode == "r":  # read by a training run: pread, never a map that a shortened file turns into SIGBUS
            self.tokens, self.log_probs, self.thresholds = (
                FileArray(path, os.open(path, os.O_RDONLY), dtype, at, rows, "sidecar")
                for dtype, at in zip((np.int32, np.float32, np.float32), offsets, strict=True))
        else:  # written by the teacher pass, its own file
            self.tokens, self.log_probs, self.thresholds = (
                np.memmap(path, dtype, mode, at, rows)
                for dtype, at in zip((np.int32, np.float32, np.float32), offsets, strict=True))

    @classmethod
    def create(cls, path: Path, k: int, vocab: int, shard_tokens: np.ndarray, window: int) -> Sidecar:
        """A new sidecar (ids -1), or the partial one already at ``path`` when its header matches."""
        checksum = shard_checksum(shard_tokens)
        if path.exists():
            try:
                old = cls(path, "r+")
                if (old.k, old.vocab, old.n_tokens, old.window, old.checksum) == \
                        (k, vocab, len(shard_tokens), window, checksum):
                    return old
            except SidecarError:
                pass
        header = np.zeros(HEADER_INTS, np.int32)
        header[:8] = (MAGIC, VERSION, k, vocab, len(shard_tokens), window, 0, checksum)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            header.tofile(f)
            f.truncate(HEADER_INTS * 4 + len(shard_tokens) * k * ROW_BYTES_PER_K)
        tmp.replace(path)
        side = cls(path, "r+")
        side.tokens[:] = -1
        return side

    def set_windows_done(self, n: int) -> None:
        for array in (self.tokens, self.log_probs, self.thresholds):
            array.flush()
        with open(self.path, "r+b") as f:
            f.seek(6 * 4)
            f.write(np.int32(n).tobytes())
        self.windows_done = n

    def n_windows(self) -> int:
        return max(0, (self.n_tokens - 1) // self.window)


class SidecarSet:
    """The sidecars of a loader's shards, checked against them; reads the rows of a batch's label positions."""

    def __init__(self, folder: str | Path, shards: list[Path], shard_tokens: list[np.ndarray], seq_len: int):
        self.sidecars = []
        for shard, tokens in zip(shards, shard_tokens, strict=True):
            side = Sidecar(sidecar_path(folder, shard))
            if side.n_tokens != len(tokens) or side.checksum != shard_checksum(tokens):
                raise SidecarError(f"{side.path}: made for another shard ({side.n_tokens} tokens) than "
                                   f"{shard} ({len(tokens)} tokens): sidecars must line up with the shards")
            if side.window != seq_len:
                raise SidecarError(f"{side.path}: teacher windows of {side.window} tokens, but training.seq_len "
                                   f"= {seq_len}; rerun the teacher pass with the student's seq_len")
            if side.windows_done != side.n_windows():
                raise SidecarError(f"{side.path}: incomplete ({side.windows_done} of {side.n_windows()} "
                                   f"windows); rerun the teacher pass to finish it")
            if self.sidecars and (side.k, side.vocab) != (self.sidecars[0].k, self.sidecars[0].vocab):
                first = self.sidecars[0]
                raise SidecarError(f"{side.path}: k = {side.k} over a vocabulary of {side.vocab}, but {first.path} "
                                   f"has k = {first.k} over {first.vocab}; rerun the teacher pass with one --k")
            self.sidecars.append(side)
        self.k = self.sidecars[0].k if self.sidecars else 0
        self.vocab = self.sidecars[0].vocab if self.sidecars else 0

    def read(self, windows: list[tuple[int, int]], seq_len: int) -> tuple[torch.Tensor, ...]:
        """(tokens int64, log-probs, thresholds), each (batch, seq_len, k), for windows given as
        (shard, first token): rows first + 1 .. first + seq_len, the labels' positions."""
        rows = []
        for s, a in windows:
            side, r = self.sidecars[s], slice(a + 1, a + 1 + seq_len)
            tok, lp, thr = side.tokens[r], side.log_probs[r], side.thresholds[r]
            if tok.min() < 0 or tok.max() >= self.vocab or (lp > 1e-4).any() or not np.isfinite(lp).all() \
                    or not np.isfinite(thr).all():
                raise SidecarError(f"{side.path}: corrupted rows (token ids outside [0, {self.vocab}), positive or "
                                   f"non-finite log-probabilities or thresholds)")
            rows.append((tok, lp, thr))
        tok, lp, thr = (np.stack(arrays) for arrays in zip(*rows, strict=True))
        return torch.from_numpy(tok.astype(np.int64)), torch.from_numpy(lp), torch.from_numpy(thr)
