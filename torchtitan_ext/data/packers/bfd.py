"""Best-fit-decreasing packing of whole documents into training windows (``data.packing = "bfd"``).

Documents (each ending with its end-of-text token) are placed, longest first, into the window whose free
space is smallest among those it fits in, opening a new window when none fits; only documents longer
than a window are split (into window-sized pieces). Padding fills each window's tail and is marked -1:
the loader turns it into label -100, which the cross-entropy ignores, and since padding only follows the
documents no real token attends to it. The whole training split is packed in memory at start-up.
"""

from __future__ import annotations

import bisect
import logging
from pathlib import Path

import numpy as np

from torchtitan_ext.data.base import Batch, EpochOrder, LoaderContext, PositionState, rows_to_batch
from torchtitan_ext.data.shards import ShardError, read_shard

PAD = -1
logger = logging.getLogger(__name__)


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
    ends = (np.flatnonzero(tokens == eot_id) + 1).tolist()
    return [tokens[s:min(b, s + window)] for a, b in zip([0, *ends], [*ends, len(tokens)], strict=True)
            for s in range(a, b, window)]


def pack(tokens: np.ndarray, eot_id: int, window: int) -> tuple[np.ndarray, float]:
    """(windows (n, window) int64 with PAD padding, padding fraction)."""
    docs = split_documents(np.asarray(tokens), eot_id, window)
    bins = bfd_bins([len(d) for d in docs], window)
    out = np.full((len(bins), window), PAD, dtype=np.int64)
    for row, members in enumerate(bins):
        joined = np.concatenate([docs[i] for i in members])
        out[row, :len(joined)] = joined
    return out, (float((out == PAD).sum()) / out.size if out.size else 0.0)


class PackedDataLoader(PositionState):
    """Windows of ``seq_len + 1`` tokens packed with whole documents (same interface and state as the
    concat loader). Its windows are not the shards' fixed windows: no sidecars, no document offsets."""

    sidecars = None

    def __init__(self, shards: list[Path], seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool, eot_id: int = 0, *, vocab_limit: int = 0):
        self.shards, self.seq_len, self.local_batch_size = shards, seq_len, local_batch_size
        self.dp_rank, self.dp_world_size, self.seed, self.shuffle = dp_rank, dp_world_size, seed, shuffle
        stream = np.concatenate([np.asarray(read_shard(p), dtype=np.int64) for p in shards])
        self.windows, self.padding_fraction = pack(stream, eot_id, seq_len + 1)
        self.n_windows = len(self.windows)
        if self.n_windows < local_batch_size * dp_world_size:
            raise ShardError(f"{shards[0].parent}: {self.n_windows} packed windows, fewer than one global batch "
                             f"({local_batch_size * dp_world_size})")
        self.vocab_limit = vocab_limit
        self._order = EpochOrder(self.n_windows, seed, shuffle)
        logger.info(f"data.packing = 'bfd': {self.n_windows:,} windows of {seq_len + 1} tokens, padding "
                    f"{100 * self.padding_fraction:.2f}%")

    def _window(self, g: int) -> np.ndarray:
        return self.windows[self._order(g)]

    def next_batch(self) -> Batch:
        rows = [self._window(g) for g in self._advance()]
        return rows_to_batch(rows, [0] * len(rows), self.vocab_limit, lambda d: str(self.shards[0].parent))


def build(files: list[Path], ctx: LoaderContext, shuffle: bool, sidecars=None, documents=None) -> PackedDataLoader:
    """The training loader; ``sidecars`` and ``documents`` do not apply to packed windows (distillation
    refuses a loader without sidecars; the trainer derives document visibility from the inputs)."""
    return PackedDataLoader(files, shuffle=shuffle, eot_id=ctx.eot_id, **ctx.window_args())
