"""A deterministic, stateful, distributed loader of fixed-length windows from token shards.

The shards' tokens are cut into windows of ``seq_len + 1`` tokens (inputs and the labels shifted by one),
shuffled per epoch by a seeded permutation. Global step s uses the windows at global positions
``[s * G, (s + 1) * G)`` with G the global micro-batch; data-parallel rank r reads its contiguous slice of
``local_batch_size``. The state is one number, the global position, so it is the same on every rank and a
checkpoint resumes under any world size with the same data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.config.loader import ConfigError
from torchtitan_ext.data.corpus import builtin_shards, builtin_tokenizer
from torchtitan_ext.data.shards import ShardError, list_shards, read_shard


@dataclass
class Batch:
    inputs: torch.Tensor  # (batch, seq) int64
    labels: torch.Tensor  # (batch, seq) int64
    domains: torch.Tensor  # (batch,) index of the shard each sequence came from
    teacher: tuple | None = None  # distillation: sidecar (tokens, log-probs, thresholds) at the labels' positions
    visibility: tuple[torch.Tensor, torch.Tensor] | None = None  # (start, limit) per key token (ops/visibility.py)
    positions: torch.Tensor | None = None  # (batch, seq) RoPE positions; None: 0, 1, ...


class TokenDataLoader:
    def __init__(self, shards: list[Path], seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool):
        self.shards, self.seq_len, self.local_batch_size = shards, seq_len, local_batch_size
        self.dp_rank, self.dp_world_size, self.seed, self.shuffle = dp_rank, dp_world_size, seed, shuffle
        self.tokens = [read_shard(p) for p in shards]
        self.first_window = np.cumsum([0] + [max(0, (len(t) - 1) // seq_len) for t in self.tokens])
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < local_batch_size * dp_world_size:
            raise ShardError(f"{shards[0].parent}: {self.n_windows} windows of {seq_len + 1} tokens in "
                             f"{len(shards)} shard(s), fewer than one global batch "
                             f"({local_batch_size * dp_world_size})")
        self.vocab_limit = 0  # when set, a token id >= it is reported with its shard
        self.position = 0
        self._perm: tuple[int, np.ndarray] | None = None
        self.sidecars = None  # distill.sidecar.SidecarSet: read in step with the windows
        self.documents = None  # data.documents.Documents: data.attention = "document" visibility and positions

    def _window(self, g: int) -> tuple[np.ndarray, int]:
        shard, start = self.window_start(g)
        return self.tokens[shard][start:start + self.seq_len + 1], shard

    def window_start(self, g: int) -> tuple[int, int]:
        """(shard, first token) of global window ``g``."""
        epoch, i = divmod(g, self.n_windows)
        if self.shuffle:
            if self._perm is None or self._perm[0] != epoch:
                self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
            i = int(self._perm[1][i])
        shard = int(np.searchsorted(self.first_window, i, side="right")) - 1
        return shard, (i - int(self.first_window[shard])) * self.seq_len

    def next_batch(self) -> Batch:
        first = self.position + self.dp_rank * self.local_batch_size
        windows = [self._window(first + j) for j in range(self.local_batch_size)]
        self.position += self.local_batch_size * self.dp_world_size
        data = torch.from_numpy(np.stack([w for w, _ in windows]).astype(np.int64))
        domains = torch.tensor([s for _, s in windows])
        if self.vocab_limit and int(data.max()) >= self.vocab_limit:
            bad = int(domains[data.max(dim=1).values.argmax()])
            raise ShardError(f"{self.shards[bad]}: token id {int(data.max())} >= model vocabulary "
                             f"{self.vocab_limit}; set model.vocab_size")
        teacher = None
        if self.sidecars is not None:
            teacher = self.sidecars.read([self.window_start(first + j) for j in range(self.local_batch_size)],
                                         self.seq_len)
        batch = Batch(data[:, :-1], data[:, 1:], domains, teacher=teacher)
        if self.documents is not None:
            batch.visibility, batch.positions = self.documents.batch(
                batch.inputs, self.tokens, [self.window_start(first + j) for j in range(self.local_batch_size)])
        return batch

    def reset(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class PretokenizedVocab:
    """``data.tokenizer = "none"``: shards tokenized elsewhere; the vocabulary comes from model.vocab_size."""

    vocab_size = 0
    name = "none"


def build_data(*, dataset: str, train_path: str, val_path: str, tokenizer: str, tokenizer_vocab_size: int,
               cache_dir: str, seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int,
               seed: int, shuffle: bool, domains: dict | None = None, packing: str = "concat",
               attention: str = "causal", position_reset: bool = False):
    """(tokenizer, training loader, validation loader or None) for this data-parallel rank. ``domains``
    (data.domains and the mixing keys) replaces the single stream by a MixingLoader and per-domain
    validation loaders; ``packing = "bfd"`` packs whole documents into the training windows."""
    cache = Path(cache_dir).expanduser()
    if tokenizer == "none":
        if dataset == "builtin":
            raise ConfigError("data.tokenizer = 'none' needs data.dataset = 'shards' (the built-in corpus is "
                              "raw text)")
        tok = PretokenizedVocab()
    else:
        tok = builtin_tokenizer(tokenizer, tokenizer_vocab_size, cache)
    train_cls = TokenDataLoader
    if packing == "bfd":
        from torchtitan_ext.data.packing import PackedDataLoader

        train_cls = functools.partial(PackedDataLoader, eot_id=getattr(tok, "eot_id", 0))
    val_cls = TokenDataLoader
    if attention == "tree":  # shards of whole conversation trees with their node sidecars (data/trees.py)
        from torchtitan_ext.data.trees import TreeDataLoader

        if dataset != "shards" or packing != "concat" or (domains and domains["domains"]):
            raise ConfigError("data.attention = 'tree' reads tree shards: needs data.dataset = 'shards', "
                              "data.packing = 'concat' and no data.domains")
        train_cls = val_cls = functools.partial(TreeDataLoader, eot_id=getattr(tok, "eot_id", 0),
                                                position_reset=position_reset)
    if domains and domains["mixing"] == "adaptive" and not domains["domains"]:
        raise ConfigError("data.mixing = 'adaptive' needs [[data.domains]] tables (it reweights domains)")
    if domains and domains["domains"]:
        from torchtitan_ext.data.mixing import build_mixing

        return (tok, *build_mixing(**domains, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                                   dp_world_size=dp_world_size, seed=seed, shuffle=shuffle, source=train_cls))
    if dataset == "builtin":
        train, val = builtin_shards(tok, cache)
        train_files, val_files = [train], [val]
    else:
        if not train_path:
            raise ConfigError("data.train_path is empty: expected a folder or glob of token shards "
                              "(data.dataset = 'shards')")
        train_files = list_shards(train_path, "data.train_path")
        val_files = list_shards(val_path, "data.val_path") if val_path else []
    common = dict(seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                  dp_world_size=dp_world_size, seed=seed)
    loader = train_cls(train_files, shuffle=shuffle, **common)
    val_loader = val_cls(val_files, shuffle=False, **common) if val_files else None
    return tok, loader, val_loader
