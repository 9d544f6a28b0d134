"""Visibility masks: which keys each query may attend to, as two integers per key token.

For batch row b and key k, query q may attend over k iff ``start[b, k] <= q < limit[b, k]``. Causal
documents, packed documents, conversation trees, bidirectional prefixes and paged beam-search layouts are
all instances; the pair costs O(seq) memory instead of the O(seq^2) of a dense mask, and a GPU kernel can
derive which (query, key) tiles are fully masked from it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch


def visibility_mask(start: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """(batch, seq) start/limit -> bool (batch, seq_q, seq_k), ``[b, q, k]`` true where q may attend k."""
    q = torch.arange(start.shape[-1], device=start.device)[None, :, None]
    return (start[:, None, :] <= q) & (q < limit[:, None, :])


def document_visibility(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed causal documents of the given lengths: (start, limit) of shape (1, sum(lengths))."""
    limit = torch.repeat_interleave(torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0),
                                    torch.tensor(lengths, dtype=torch.long))
    return torch.arange(limit.numel())[None], limit[None]


def tree_visibility(parents: Sequence[int], lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes in depth-first pre-order (``parents[i] < i``, -1 for a root), ``lengths[i]`` tokens each.

    In pre-order a node's subtree is a contiguous run of tokens right after it, so a key token is seen by
    the later tokens of its node and by its node's whole subtree: start = its own index, limit = the end of
    its node's subtree. Siblings' subtrees lie outside that run and never see each other."""
    n = len(parents)
    if len(lengths) != n:
        raise ValueError(f"tree_visibility: {n} parents but {len(lengths)} lengths")
    if (negative := next((length for length in lengths if length < 0), None)) is not None:
        raise ValueError(f"tree_visibility: negative node length {negative}")
    offsets = list(itertools.accumulate(lengths, initial=0))
    subtree_end = list(offsets[1:])  # token index after each node's subtree
    for i in range(n - 1, -1, -1):  # children come after parents: propagate ends upwards
        p = parents[i]
        if not -1 <= p < i:
            raise ValueError(f"tree_visibility: node {i} has parent {p}; expected -1 or an earlier node")
        if p >= 0:
            subtree_end[p] = max(subtree_end[p], subtree_end[i])
    limit = torch.tensor([subtree_end[i] for i in range(n) for _ in range(lengths[i])], dtype=torch.long)
    return torch.arange(offsets[-1])[None], limit[None]


def prefix_visibility(prefix_len: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``prefix_len`` tokens see each other (bidirectional); the rest is causal after them."""
    if not 0 <= prefix_len <= seq_len:
        raise ValueError(f"prefix_visibility: prefix_len {prefix_len} outside [0, {seq_len}]")
    start = torch.arange(seq_len)
    start[:prefix_len] = 0
    return start[None], torch.full((1, seq_len), seq_len, dtype=torch.long)


def causal_visibility(batch: int, seq_len: int, device: torch.device | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain causal attention as a visibility pair (one document per row)."""
    start = torch.arange(seq_len, device=device).expand(batch, seq_len)
    return start, torch.full((batch, seq_len), seq_len, device=device, dtype=torch.long)


class BlockMaskCache:
    """FlexAttention ``BlockMask`` of the latest (start, limit) pair: every layer of one forward (and its
    recomputation under activation checkpointing) reuses the one built for the batch, so the tile map that
    lets the kernel skip fully masked (query, key) blocks is computed once per batch."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._mask = None

    def get(self, start: torch.Tensor, limit: torch.Tensor):
        key = (start, limit, start._version, limit._version)
        if self._key is not None and all(a is b if isinstance(a, torch.Tensor) else a == b
                                         for a, b in zip(self._key, key, strict=True)):
            return self._mask
        self._mask = flex_block_mask(start, limit)
        self._key = key
        return self._mask


def flex_block_mask(start: torch.Tensor, limit: torch.Tensor):
    """The FlexAttention BlockMask of a visibility pair (broadcast over heads; over the batch too when the
    pair has one row). FlexAttention calls the mask function with each row's own batch index even when the
    BlockMask broadcasts, so a one-row pair is read without it: indexing its missing rows would read past the
    tensor (an index error on CPU, other memory in the CUDA kernel)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = start.shape

    def mask_mod(b, h, q, k):
        row = b if batch > 1 else 0
        return (start[row, k] <= q) & (q < limit[row, k])

    return create_block_mask(mask_mod, batch, None, seq, seq, device=start.device)


block_masks = BlockMaskCache()


@functools.cache
def causal_block_mask(seq_len: int, device: torch.device):
    """The causal BlockMask (batch and heads broadcast), built once per length and device."""
    start, limit = causal_visibility(1, seq_len, device)
    return flex_block_mask(start.contiguous(), limit)
