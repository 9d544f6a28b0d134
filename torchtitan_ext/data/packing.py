"""Best-fit-decreasing packing of whole documents into training windows (``data.packing = "bfd"``).

Documents (each ending with its end-of-text token) are placed, longest first, into the window whose free
space is smallest among those it fits in, opening a new window when none fits; only documents longer
than a window are split (into window-sized pieces). Padding fills each window's tail and is marked -1:
the loader turns it into label -100, which the cross-entropy ignores, and since padding only follows the
documents no real token attends to it. The whole training split is packed in memory at start-up.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import numpy as np

from torchtitan_ext.data.loader import TokenDataLoader
from torchtitan_ext.data.shards import ShardError, read_shard

PAD = -1


def bfd_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` by best-fit decreasing."""
    if any(n > capacity or n < 0 for n in lengths):
        raise ValueError(f"bfd_bins: every length must be within [0, {capacity}]")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free: list[tuple[int, int]] = []  # (free space, bin id), sorted
    bins: list[list[int]] = []
    for i in order:
        pos = bisect.bisect_left(free, (lengths[i], -1))
        if pos == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
        else:
            space, b = free.pop(pos)
            bins[b].append(i)
            bisect.insort(free, (space - lengths[i], b))
    return bins


def split_documents(tokens: np.ndarray, eot_id: int, window: int) -> list[np.ndarray]:
    """The documents of a token stream (each with its end-of-text), those over ``window`` cut into pieces."""
    ends = np.flatnonzero(tokens == eot_id) + 1
    starts = np.concatenate([[0], ends])
    stops = np.concatenate([ends, [len(tokens)]])
    docs = []
    for a, b in zip(starts, stops, strict=True):
        for s in range(int(a), int(b), window):
            docs.append(tokens[s:min(int(b), s + window)])
    return [d for d in docs if len(d)]


def pack(tokens: np.ndarray, eot_id: int, window: int) -> tuple[np.ndarray, float]:
    """(windows (n, window) int64 with PAD padding, padding fraction)."""
    docs = split_documents(np.asarray(tokens), eot_id, window)
    bins = bfd_bins([len(d) for d in docs], window)
    out = np.full((len(bins), window), PAD, dtype=np.int64)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            out[row, at:at + len(docs[i])] = docs[i]
            at += len(docs[i])
    total = out.size
    return out, (float((out == PAD).sum()) / total if total else 0.0)


class PackedDataLoader(TokenDataLoader):
    """TokenDataLoader over BFD-packed windows of ``seq_len + 1`` tokens instead of a cut stream."""

    def __init__(self, shards: list[Path], seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool, eot_id: int = 0):
        self.shards, self.seq_len, self.local_batch_size = shards, seq_len, local_batch_size
        self.dp_rank, self.dp_world_size, self.seed, self.shuffle = dp_rank, dp_world_size, seed, shuffle
        stream = np.concatenate([np.asarray(read_shard(p), dtype=np.int64) for p in shards])
        self.windows, self.padding_fraction = pack(stream, eot_id, seq_len + 1)
        self.n_windows = len(self.windows)
        if self.n_windows < local_batch_size * dp_world_size:
            raise ShardError(f"{shards[0].parent}: {self.n_windows} packed windows, fewer than one global batch "
                             f"({local_batch_size * dp_world_size})")
        self.vocab_limit = 0
        self.position = 0
        self._perm = None
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"data.packing = 'bfd': {self.n_windows:,} windows of {seq_len + 1} tokens, padding "
                  f"{100 * self.padding_fraction:.2f}%", flush=True)

    def _window(self, g: int) -> tuple[np.ndarray, int]:
        epoch, i = divmod(g, self.n_windows)
        if self.shuffle:
            if self._perm is None or self._perm[0] != epoch:
                self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
            i = int(self._perm[1][i])
        return self.windows[i], 0

    def next_batch(self):
        from torchtitan_ext.data.mixing import rows_to_batch

        first = self.position + self.dp_rank * self.local_batch_size
        rows = [self._window(first + j)[0] for j in range(self.local_batch_size)]
        self.position += self.local_batch_size * self.dp_world_size
        return rows_to_batch(rows, [0] * len(rows), self.vocab_limit, lambda d: str(self.shards[0].parent))
