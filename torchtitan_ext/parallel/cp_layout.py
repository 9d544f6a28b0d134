"""The context parallel sequence layout: which tokens of each sequence a CP rank holds.

Each sequence is cut into ``2 x cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``,
concatenated (head-tail balance): under causal attention a late chunk has more keys to attend over than an
early one, and pairing the ``r``-th chunk from the front with the ``r``-th from the back gives every rank
the same work. A rank's local tokens stay in increasing global order.
"""

from __future__ import annotations

import torch

from torchtitan_ext.errors import ConfigError


def check_cp_seq_len(seq_len: int, cp: int, tp: int = 1) -> None:
    """One line when the sequence cannot be cut into ``2 x cp`` equal chunks (each split again over TP's
    sequence-parallel ranks)."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ConfigError(f"training.seq_len = {seq_len} must be divisible by 2 x parallelism.cp = {2 * cp} "
                          "(context parallelism cuts each sequence into 2 x cp equal chunks)")
    if seq_len % (2 * cp * tp):
        raise ConfigError(f"training.seq_len = {seq_len} must be divisible by 2 x parallelism.cp x parallelism.tp "
                          f"= {2 * cp * tp} (each of the 2 x cp chunks is split over the TP ranks)")


def local_indices(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global sequence indices (seq_len / cp,) of CP rank ``rank``'s tokens, in their local order."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat((first, second))


def layout_order(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Every rank's local indices, rank after rank (seq_len,): position p of the gathered layout holds global
    index ``layout_order[p]``; its argsort puts a gathered sequence back into natural order."""
    return torch.cat([local_indices(seq_len, cp, r, device) for r in range(cp)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of ``x`` that CP rank ``rank`` holds along ``dim`` (the sequence dimension)."""
    seq_len = x.shape[dim]
    chunks = x.chunk(2 * cp, dim=dim)
    if len(chunks) != 2 * cp or seq_len % (2 * cp):
        raise ValueError(f"shard_sequence: length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)
