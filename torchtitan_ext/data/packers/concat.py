"""``data.packing = "concat"``: a deterministic, stateful, distributed loader of fixed-length windows from
token shards.

The shards' tokens are cut into windows of ``seq_len + 1`` tokens (inputs and the labels shifted by one),
shuffled per epoch by a seeded permutation. Global step s uses the windows at global positions
``[s * G, (s + 1) * G)`` with G the global micro-batch; data-parallel rank r reads its contiguous slice of
``local_batch_size``. The state is the global position (``data/base.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from torchtitan_ext.data.base import Batch, EpochOrder, LoaderContext, PositionState, rows_to_batch
from torchtitan_ext.data.documents import Documents
from torchtitan_ext.data.shards import ShardError, read_shard


class TokenDataLoader(PositionState):
    """``sidecars(loader)`` (distillation) is called once the windows are known; its result is read in step
    with them. ``documents`` adds data.attention = "document" visibility and positions to every batch."""

    def __init__(self, shards: list[Path], seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool, *, vocab_limit: int = 0,
                 documents: Documents | None = None, sidecars: Callable | None = None):
        self.shards, self.seq_len, self.local_batch_size = shards, seq_len, local_batch_size
        self.dp_rank, self.dp_world_size, self.seed, self.shuffle = dp_rank, dp_world_size, seed, shuffle
        self.tokens = [read_shard(p) for p in shards]
        self.first_window = np.cumsum([0] + [max(0, (len(t) - 1) // seq_len) for t in self.tokens])
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < local_batch_size * dp_world_size:
            raise ShardError(f"{shards[0].parent}: {self.n_windows} windows of {seq_len + 1} tokens in "
                             f"{len(shards)} shard(s), fewer than one global batch "
                             f"({local_batch_size * dp_world_size})")
        self.vocab_limit = vocab_limit
        self._order = EpochOrder(self.n_windows, seed, shuffle)
        self.documents = documents
        self.sidecars = sidecars(self) if sidecars is not None else None  # distill.sidecar.SidecarSet

    def _window(self, g: int) -> np.ndarray:
        shard, start = self.window_start(g)
        return self.tokens[shard][start:start + self.seq_len + 1]

    def window_start(self, g: int) -> tuple[int, int]:
        """(shard, first token) of global window ``g``."""
        i = self._order(g)
        shard = int(np.searchsorted(self.first_window, i, side="right")) - 1
        return shard, (i - int(self.first_window[shard])) * self.seq_len

    def next_batch(self) -> Batch:
        starts = [self.window_start(g) for g in self._advance()]
        rows = [self.tokens[shard][start:start + self.seq_len + 1] for shard, start in starts]
        batch = rows_to_batch(rows, [shard for shard, _ in starts], self.vocab_limit, lambda d: self.shards[d])
        batch.teacher = self.sidecars.read(starts, self.seq_len) if self.sidecars is not None else None
        if self.documents is not None:
            batch.visibility, batch.positions = self.documents.batch(batch.inputs, self.tokens, starts)
        return batch


def build(files: list[Path], ctx: LoaderContext, shuffle: bool, sidecars: Callable | None = None,
          documents: Documents | None = None) -> TokenDataLoader:
    return TokenDataLoader(files, shuffle=shuffle, documents=documents, sidecars=sidecars, **ctx.window_args())
