"""Document filters for ``data.prepare``, applied in order, each counting what it removed.

- ``heuristics`` (Zen / Gopher-style quality rules, our thresholds): token count within
  [min_tokens, max_tokens]; symbol-to-word ratio (``#``, ``...`` and ``…`` per whitespace word) at most
  ``max_symbol_ratio``; repeated n-gram ratio (word n-grams that repeat an earlier one, over all of the
  document's n-grams) at most ``max_repeat_ratio``.
- ``minhash``: near-duplicate removal. Shingles are word 13-grams; a signature of 200 min-hashes is split
  into 20 bands of 10 rows (LSH: pairs of Jaccard s collide with probability 1 - (1 - s^10)^20, about 0.99
  at 0.8 and 0.12 at 0.6); a candidate pair is a duplicate when the signatures agree on more than 80% of
  their rows (estimated Jaccard > 0.8). The first document of a group is kept. Exact duplicates (same text)
  are caught before hashing and counted apart.
- ``ppl``: a checkpoint of ours (loaded by ``eval.load.perplexity_scores``, scored by ``model_scores``) scores each
  remaining document (mean next-token loss of its first ``ppl_max_tokens`` tokens, on GPU when present);
  documents above the ``ppl_percentile`` of the scores (Zen: 90th) are dropped.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

SHINGLE = 13
BANDS, ROWS = 20, 10
NUM_PERM = BANDS * ROWS
_PRIME = 4294967311  # > 2^32: (a x + b) mod p with a < 2^31, x < 2^32 stays below 2^64
_RNG = np.random.default_rng(20240520)
_A = _RNG.integers(1, 2**31, NUM_PERM, dtype=np.uint64)
_B = _RNG.integers(0, 2**32, NUM_PERM, dtype=np.uint64)
_WORD = re.compile(r"\S+")


@dataclass
class HeuristicRules:
    min_tokens: int = 16
    max_tokens: int = 1_000_000
    max_symbol_ratio: float = 0.1
    max_repeat_ratio: float = 0.3
    repeat_n: int = 3


def symbol_ratio(words: list[str], text: str) -> float:
    return (text.count("#") + text.count("...") + text.count("\u2026")) / max(1, len(words))


def repeat_ratio(words: list[str], n: int) -> float:
    """Fraction of the word n-grams that repeat an earlier n-gram of the same document."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def heuristic_reason(text: str, n_tokens: int, rules: HeuristicRules) -> str | None:
    """Why the document fails the heuristics ("tokens", "symbols", "repetition"), or None."""
    if not rules.min_tokens <= n_tokens <= rules.max_tokens:
        return "tokens"
    words = _WORD.findall(text)
    if symbol_ratio(words, text) > rules.max_symbol_ratio:
        return "symbols"
    if repeat_ratio(words, rules.repeat_n) > rules.max_repeat_ratio:
        return "repetition"
    return None


def minhash_signature(text: str) -> np.ndarray:
    """(NUM_PERM,) uint64 min-hashes of the document's word 13-gram shingles."""
    words = _WORD.findall(text)
    grams = [" ".join(words[i:i + SHINGLE]) for i in range(max(1, len(words) - SHINGLE + 1))]
    x = np.fromiter((zlib.crc32(g.encode()) for g in set(grams)), dtype=np.uint64)
    return ((x[:, None] * _A[None, :] + _B[None, :]) % _PRIME).min(axis=0)


@dataclass
class NearDuplicates:
    """LSH index over the kept documents' signatures; ``seen`` decides and records one document."""

    threshold: float = 0.8
    buckets: list[dict[bytes, int]] = field(default_factory=lambda: [{} for _ in range(BANDS)])
    signatures: list[np.ndarray] = field(default_factory=list)
    exact: set[bytes] = field(default_factory=set)

    def check(self, text: str, sig: np.ndarray | None = None) -> str | None:
        """"exact" or "near" when a kept document duplicates ``text`` (then not recorded); else None and
        ``text`` is recorded as kept. ``sig``: its signature when already computed (by a worker)."""
        digest = hashlib.sha1(text.encode()).digest()
        if digest in self.exact:
            return "exact"
        sig = minhash_signature(text) if sig is None else sig
        keys = [sig[b * ROWS:(b + 1) * ROWS].tobytes() for b in range(BANDS)]
        for band, key in enumerate(keys):
            other = self.buckets[band].get(key)
            if other is not None and np.mean(self.signatures[other] == sig) > self.threshold:
                return "near"
        self._record(digest, sig, keys)
        return None

    def _record(self, digest: bytes, sig: np.ndarray, keys: list[bytes]) -> None:
        doc = len(self.signatures)
        self.signatures.append(sig)
        self.exact.add(digest)
        for band, key in enumerate(keys):
            self.buckets[band].setdefault(key, doc)

    def arrays(self) -> dict[str, np.ndarray]:
        """The index as plain arrays (the kept documents' signatures in order, their SHA-1 digests), from
        which :meth:`from_arrays` rebuilds it exactly: a saved state that holds no pickled object."""
        digests = np.frombuffer(b"".join(sorted(self.exact)), np.uint8).reshape(-1, 20)
        signatures = np.stack(self.signatures) if self.signatures else np.zeros((0, NUM_PERM), np.uint64)
        return {"signatures": signatures, "digests": digests}

    @classmethod
    def from_arrays(cls, threshold: float, signatures: np.ndarray, digests: np.ndarray) -> NearDuplicates:
        """The index that :meth:`arrays` saved: the buckets are refilled in the documents' order, so each
        band keeps its first document as before."""
        index = cls(threshold)
        for sig in signatures.astype(np.uint64):
            index.signatures.append(sig)
            for band in range(BANDS):
                index.buckets[band].setdefault(sig[band * ROWS:(band + 1) * ROWS].tobytes(), len(index.signatures) - 1)
        index.exact = {bytes(d) for d in digests.astype(np.uint8)}
        return index


def model_scores(texts: list[str], model, tok, device, max_tokens: int = 2048, batch_size: int = 16) -> np.ndarray:
    """Mean next-token loss (nats) of each text under ``model`` (a Decoder on ``device``) with its tokenizer
    ``tok``. The ``ppl`` filter takes a scorer (texts -> scores) that ``eval.load.perplexity_scores`` builds
    from a dump folder with this function (for ``python -m torchtitan_ext.data.prepare``)."""
    import torch
    import torch.nn.functional as F

    window = model.args.max_seq_len
    # Every document's first max_tokens + 1 tokens, cut into windows of up to max_seq_len + 1 (sharing one token).
    pieces: list[tuple[int, np.ndarray]] = []
    for i, text in enumerate(texts):
        ids = np.asarray(tok.encode(text), dtype=np.int64)[:max_tokens + 1]
        pieces += [(i, ids[s:s + window + 1]) for s in range(0, max(1, len(ids) - 1), window)]
    pieces.sort(key=lambda p: len(p[1]))  # similar lengths share a batch
    nll, count = np.zeros(len(texts)), np.zeros(len(texts))
    with torch.no_grad():
        for s in range(0, len(pieces), batch_size):
            group = pieces[s:s + batch_size]
            width = max(2, max(len(ids) for _, ids in group))
            data = torch.full((len(group), width), -100, dtype=torch.long)
            for row, (_, ids) in enumerate(group):
                data[row, :len(ids)] = torch.from_numpy(ids)
            data = data.to(device)
            logits = model(data[:, :-1].clamp(min=0)).float()
            loss = F.cross_entropy(logits.transpose(1, 2), data[:, 1:], reduction="none").sum(dim=1)
            n = (data[:, 1:] >= 0).sum(dim=1)
            for row, (i, _) in enumerate(group):
                nll[i] += float(loss[row])
                count[i] += int(n[row])
    return nll / np.maximum(count, 1)
