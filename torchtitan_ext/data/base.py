"""The data layer's base types: the ``Batch`` every loader yields, the ``Loader`` protocol, the position
state that makes loaders resumable, and ``LoaderContext``, what every source and packer is built from.

A loader's state is its global position (windows, or global micro-batches for a mixture), the same on
every data-parallel rank, so a checkpoint resumes under any world size with the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from torchtitan_ext.data.documents import Documents
from torchtitan_ext.data.shards import ShardError
from torchtitan_ext.errors import ConfigError


@dataclass
class Batch:
    inputs: torch.Tensor  # (batch, seq) int64
    labels: torch.Tensor  # (batch, seq) int64
    domains: torch.Tensor  # (batch,) index of the shard each sequence came from
    teacher: tuple | None = None  # distillation: sidecar (tokens, log-probs, thresholds) at the labels' positions
    visibility: tuple[torch.Tensor, torch.Tensor] | None = None  # (start, limit) per key token (ops/visibility.py)
    positions: torch.Tensor | None = None  # (batch, seq) RoPE positions; None: 0, 1, ...


class Loader(Protocol):
    """What the trainer, the checkpoint and evaluation use of a loader."""

    position: int
    vocab_limit: int  # a token id >= it is reported with its source (0: unchecked)

    def next_batch(self) -> Batch: ...

    def reset(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class PretokenizedVocab:
    """``data.tokenizer = "none"``: shards tokenized elsewhere; the vocabulary comes from model.vocab_size."""

    vocab_size = 0
    name = "none"


class PositionState:
    """The loader protocol's state half: one global position, saved and restored as ``{"position": n}``."""

    position = 0

    def reset(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def _advance(self) -> range:
        """This rank's slice of the next global batch (global window indices); moves the position past it."""
        first = self.position + self.dp_rank * self.local_batch_size
        self.position += self.local_batch_size * self.dp_world_size
        return range(first, first + self.local_batch_size)


class EpochOrder:
    """Global window ``g`` -> window index: epoch ``g // n`` read in a permutation seeded by (seed, epoch)
    when shuffling, else in order."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perm: tuple[int, np.ndarray] | None = None

    def __call__(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        if self.shuffle:
            if self._perm is None or self._perm[0] != epoch:
                self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
            i = int(self._perm[1][i])
        return i


def rows_to_batch(rows: list[np.ndarray], domains: list[int], vocab_limit: int, where) -> Batch:
    """Windows of seq_len + 1 tokens -> a Batch; packing padding (-1) becomes input 0 and label -100 (ignored
    by the cross-entropy). ``where(domain)`` names the source of an out-of-vocabulary id."""
    data = torch.from_numpy(np.stack(rows).astype(np.int64))
    if vocab_limit and int(data.max()) >= vocab_limit:
        bad = domains[int(data.max(dim=1).values.argmax())]
        raise ShardError(f"{where(bad)}: token id {int(data.max())} >= model vocabulary {vocab_limit}; set "
                         "model.vocab_size")
    inputs, labels = data[:, :-1].clamp(min=0), data[:, 1:]
    return Batch(inputs, labels.masked_fill(labels < 0, -100), torch.tensor(domains))


# A packer: (shard files, context, shuffle) -> the training loader over them (data/packers/).
Packer = Callable[..., Loader]


@dataclass
class LoaderContext:
    """What a source needs besides ``cfg.data``: the tokenizer, the window geometry of this data-parallel
    rank, the training packer, and what the loaders are handed (``documents``, ``sidecars``)."""

    tokenizer: Any
    cache_dir: Path
    seq_len: int
    local_batch_size: int
    dp_rank: int
    dp_world_size: int
    seed: int
    shuffle: bool
    vocab_limit: int = 0
    packer: Packer | None = None  # builds the training loader from shard files (data.packing)
    documents: Documents | None = None  # data.attention = "document"
    sidecars: Callable[[Loader], Any] | None = None  # distillation: called by the plain shard stream

    @property
    def eot_id(self) -> int:
        return getattr(self.tokenizer, "eot_id", 0)

    def window_args(self) -> dict:
        """The keywords every shard loader takes from the context: its geometry (seq_len ... seed), vocab_limit."""
        return dict(seq_len=self.seq_len, local_batch_size=self.local_batch_size, dp_rank=self.dp_rank,
                    dp_world_size=self.dp_world_size, seed=self.seed, vocab_limit=self.vocab_limit)


def require_static_mixing(data) -> None:
    """``data.mixing = 'adaptive'`` reweights domains: refused by the single-stream sources."""
    if data.mixing == "adaptive" and not data.domains:
        raise ConfigError("data.mixing = 'adaptive' needs [[data.domains]] tables (it reweights domains)")
