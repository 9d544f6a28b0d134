"""The ``[[data.domains]]`` source, multi-domain data mixing: every global batch draws its sequences from
the domains by weight.

Global micro-batch b assigns each of its G = local_batch_size x dp sequences a domain, drawn from
``numpy.random.default_rng([seed, b])`` with the current weights, so every rank computes the same
assignment; data-parallel rank r takes slots ``[r L, (r + 1) L)``. The k-th sequence ever drawn from a
domain is that domain's k-th window in its own seeded per-epoch order, and each domain's count advances by
its number of slots in the global batch, so the ranks' slices are disjoint and together consume exactly
what one process would. The state (batch index, per-domain counts, weights) is saved in the checkpoint, so
a resume continues exactly, also after adaptive updates changed the weights.

Adaptive mixing (Zen) applies at every evaluation
``w_d <- w_d * exp(eta * (L_d - mean(L)) / std(L))`` with ``L_d`` the per-domain validation loss and the
population standard deviation, then renormalises and clips to ``[floor, cap]`` (projected back to a sum of
one).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import NamedTuple

import numpy as np
import torch

from torchtitan_ext.data.base import Batch, LoaderContext, rows_to_batch
from torchtitan_ext.data.packers.concat import TokenDataLoader
from torchtitan_ext.data.shards import list_shards
from torchtitan_ext.errors import ConfigError

_KEYS = {"name": str, "train": str, "val": str, "weight": (int, float)}


class Domain(NamedTuple):
    name: str
    train: str  # shard glob or folder
    val: str  # shard glob or folder; "" for none
    weight: float


def parse_domains(tables: list) -> list[Domain]:
    """``[[data.domains]]`` tables -> Domains; ConfigError (one line) naming the table and key."""
    out: list[Domain] = []
    for i, t in enumerate(tables):
        where = f"data.domains[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: expected a table with name, train, val, weight; got {t!r}")
        for k, v in t.items():
            if k not in _KEYS:
                raise ConfigError(f"{where}: unknown key {k!r}; valid: {', '.join(_KEYS)}")
            if not isinstance(v, _KEYS[k]) or isinstance(v, bool):
                raise ConfigError(f"{where}.{k}: expected {'number' if k == 'weight' else 'string'}, got {v!r}")
        for k in ("name", "train"):
            if not t.get(k):
                raise ConfigError(f"{where}: missing {k!r}")
        w = float(t.get("weight", 1.0))
        if not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{where}.weight: expected a finite number > 0, got {t.get('weight')!r}")
        if any(d.name == t["name"] for d in out):
            raise ConfigError(f"{where}.name: {t['name']!r} is used twice")
        out.append(Domain(t["name"], t["train"], t.get("val", ""), w))
    return out


def project(w: np.ndarray, floor: float, cap: float) -> np.ndarray:
    """``clip(c w, floor, cap)`` with the one factor c > 0 that makes the weights sum to one (found by
    bisection: the sum grows with c), so the weights keep their order and, between the bounds, ratios."""
    w = np.asarray(w, dtype=np.float64) / np.sum(w)
    if floor <= 0 and cap >= 1:
        return w
    lo, hi = 0.0, 1.0
    while np.clip(hi * w, floor, cap).sum() < 1.0 and hi < 1e300:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.clip(mid * w, floor, cap).sum() < 1.0 else (lo, mid)
    out = np.clip(hi * w, floor, cap)
    return out / out.sum()


def adaptive_update(weights: np.ndarray, losses: np.ndarray, eta: float, floor: float = 0.0,
                    cap: float = 1.0) -> np.ndarray:
    """The Zen update: up-weight domains whose validation loss is above the mean, in units of the
    population standard deviation. Equal losses leave the weights unchanged."""
    losses = np.asarray(losses, dtype=np.float64)
    std = losses.std()
    factor = np.exp(eta * (losses - losses.mean()) / std) if std > 0 else 1.0
    return project(np.asarray(weights, dtype=np.float64) * factor, floor, cap)


class MixingLoader:
    """The training loader over several domains (same interface as TokenDataLoader)."""

    def __init__(self, domains: list[Domain], seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world_size: int, seed: int, shuffle: bool, mode: str = "static", rate: float = 0.01,
                 floor: float = 0.0, cap: float = 1.0, source=TokenDataLoader, *, vocab_limit: int = 0):
        if floor * len(domains) > 1 + 1e-9 or cap * len(domains) < 1 - 1e-9:
            raise ConfigError(f"data.mixing_floor = {floor} / data.mixing_cap = {cap}: no weights of "
                              f"{len(domains)} domains summing to one fit")
        self.domains, self.names = domains, [d.name for d in domains]
        self.local_batch_size, self.dp_rank, self.dp_world_size = local_batch_size, dp_rank, dp_world_size
        self.seed, self.mode, self.rate, self.floor, self.cap = seed, mode, rate, floor, cap
        self.sources = [source(list_shards(d.train, f"data.domains[{i}].train ({d.name})"), seq_len, 1, 0, 1,
                               seed * 1_000_003 + zlib.crc32(d.name.encode()), shuffle)
                        for i, d in enumerate(domains)]
        self.weights = project(np.array([d.weight for d in domains]), floor, cap)
        self.consumed = np.zeros(len(domains), dtype=np.int64)
        self.position = 0  # global micro-batches drawn
        self.vocab_limit = vocab_limit

    def assignment(self, batch_index: int) -> np.ndarray:
        """The domain of each slot of global micro-batch ``batch_index``."""
        g = self.local_batch_size * self.dp_world_size
        return np.random.default_rng([self.seed, batch_index]).choice(len(self.domains), size=g, p=self.weights)

    def next_batch(self) -> Batch:
        assign = self.assignment(self.position)
        # the k-th slot of a domain in this batch -> that domain's (consumed + k)-th window
        rank_in_domain = np.zeros(len(assign), dtype=np.int64)
        seen = np.zeros(len(self.domains), dtype=np.int64)
        for j, d in enumerate(assign):
            rank_in_domain[j] = seen[d]
            seen[d] += 1
        lo = self.dp_rank * self.local_batch_size
        doms = [int(d) for d in assign[lo:lo + self.local_batch_size]]
        rows = [self.sources[d]._window(int(self.consumed[d] + rank_in_domain[lo + j])) for j, d in enumerate(doms)]
        self.consumed += seen
        self.position += 1
        return rows_to_batch(rows, doms, self.vocab_limit, lambda d: f"data.domains {self.names[d]!r}")

    def reset(self) -> None:
        self.position = 0
        self.consumed[:] = 0

    def update(self, val_losses: dict[str, float]) -> None:
        """Apply the adaptive update from per-domain validation losses (no-op for static mixing)."""
        if self.mode != "adaptive":
            return
        losses = np.array([val_losses[n] for n in self.names])
        self.weights = adaptive_update(self.weights, losses, self.rate, self.floor, self.cap)

    def weight_metrics(self) -> dict[str, float]:
        return {f"data/weight/{n}": float(w) for n, w in zip(self.names, self.weights, strict=True)}

    def state_dict(self) -> dict:
        return {"position": self.position, "consumed": torch.from_numpy(self.consumed.copy()),
                "weights": torch.from_numpy(self.weights.copy())}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.consumed = state["consumed"].cpu().numpy().astype(np.int64).copy()
        self.weights = state["weights"].cpu().numpy().astype(np.float64).copy()


def _domain_stream(ctx: LoaderContext):
    """A domain's training stream: the packer over its shards, one window per draw, its own seed."""
    def make(files, seq_len, local_batch_size, dp_rank, dp_world_size, seed, shuffle):
        sub = dataclasses.replace(ctx, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                                  dp_world_size=dp_world_size, seed=seed, vocab_limit=0)
        return ctx.packer(files, sub, shuffle)
    return make


def build(data, ctx: LoaderContext) -> tuple[MixingLoader, dict[str, TokenDataLoader] | None]:
    """(training loader, per-domain validation loaders or None) for ``[[data.domains]]``."""
    parsed = parse_domains(data.domains)
    loader = MixingLoader(parsed, ctx.seq_len, ctx.local_batch_size, ctx.dp_rank, ctx.dp_world_size, ctx.seed,
                          ctx.shuffle, data.mixing, data.mixing_rate, data.mixing_floor, data.mixing_cap,
                          _domain_stream(ctx), vocab_limit=ctx.vocab_limit)
    val = {d.name: TokenDataLoader(list_shards(d.val, f"data.domains[{i}].val ({d.name})"), shuffle=False,
                                   **ctx.window_args())
           for i, d in enumerate(parsed) if d.val}
    if data.mixing == "adaptive" and len(val) != len(parsed):
        missing = next(d.name for d in parsed if d.name not in val)
        raise ConfigError(f"data.mixing = 'adaptive' needs a validation split (val) for every domain; "
                          f"{missing!r} has none")
    return loader, (val or None)
