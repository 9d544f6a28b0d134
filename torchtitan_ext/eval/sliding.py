"""Sliding-window evaluation (parameter-golf): windows of ``seq_len`` tokens advance by ``stride``; the
first window scores all its targets, every later one only the targets no earlier window scored (its last
``stride``), so each scored token after the first window sees at least ``seq_len - stride`` tokens of
context. ``stride = seq_len`` (or 0) is the plain non-overlapping evaluation. Windows run in batches.

Both the standalone evaluator (``python -m torchtitan_ext.eval``, one process) and the trainer's periodic
evaluation (any data-parallel degree, the windows split over the ranks) score the same tokens in the same
windows: the first ``eval.steps x local_batch_size x seq_len + 1`` of each validation split (``eval_stream``),
so they give the same numbers on the same weights. Only jobs whose validation batches carry masks
(``data.attention`` document / tree, ``position_reset``, chat data; ``reads_stream`` False) evaluate, in the
trainer, the loader's first ``eval.steps`` batches on every rank with those masks instead (and refuse
``eval.stride``); the standalone evaluator scores plain causal windows there, a different number."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from torchtitan_ext.data.base import Batch
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.bpb import batch_sums


def windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int]]:
    """(window start, first scored offset within the window) covering targets 1 .. n_tokens - 1 once."""
    stride = stride or seq_len
    if not 0 < stride <= seq_len:
        raise ValueError(f"eval.stride = {stride}: expected 0 or 1 .. seq_len ({seq_len})")
    last = n_tokens - 1  # index of the last target
    if last < seq_len:
        raise ValueError(f"{n_tokens} validation tokens: fewer than one window of {seq_len + 1}")
    # a window every stride, the last moved back to end at the last target; window i scores the targets after
    # the end of window i - 1 (target index start + 1 + j for j >= that offset)
    starts = [*range(0, last - seq_len, stride), last - seq_len]
    return [(start, starts[i - 1] + seq_len - start if i else 0) for i, start in enumerate(starts)]


def eval_stream(loader, cfg) -> np.ndarray:
    """The tokens of a validation loader's stream (its shards in order) that an evaluation scores: the first
    ``eval.steps x local_batch_size x seq_len + 1``, all of them when ``eval.steps = 0``."""
    t = cfg.training
    n_tokens = cfg.eval.steps * t.local_batch_size * t.seq_len + 1 if cfg.eval.steps else None
    parts, have = [], 0
    for shard in loader.tokens:
        if n_tokens is not None and have >= n_tokens:
            break
        parts.append(np.asarray(shard[:None if n_tokens is None else n_tokens - have]))
        have += len(parts[-1])
    return np.concatenate(parts)


def reads_stream(cfg) -> bool:
    """Whether a job's validation is plain causal windows over each split's token stream (the standalone
    evaluator's view), so that the trainer evaluates exactly as ``python -m torchtitan_ext.eval`` does:
    always with ``eval.stride``, else unless the batches carry masks (document / tree attention, position
    resets, chat data's assistant-only labels)."""
    d = cfg.data
    plain = d.attention == "causal" and not d.position_reset and d.dataset != "chat"
    return cfg.eval.stride > 0 or plain


def check_trainer_stride(cfg, val_loader) -> None:
    """ConfigError (one line) for an evaluation the trainer cannot run: an ``eval.stride`` with masked data,
    or a validation split shorter than one window; ``val_loader``: None, one loader, or a dict by domain."""
    stride, seq_len = cfg.eval.stride, cfg.training.seq_len
    if val_loader is None or not cfg.eval.steps or not reads_stream(cfg):
        return
    val_loaders = val_loader if isinstance(val_loader, dict) else {"": val_loader}
    if stride and cfg.data.attention != "causal":
        raise ConfigError(f"eval.stride: sliding windows are plain causal windows; not supported with "
                          f"data.attention = {cfg.data.attention!r}")
    for name, loader in val_loaders.items():
        try:
            windows(len(eval_stream(loader, cfg)), seq_len, stride)
        except ValueError as e:
            raise ConfigError(f"validation split{f' {name!r}' if name else ''}: {e}") from None


def trainer_batches(loader, cfg, dp_rank: int, dp: int) -> Iterator[Batch]:
    """One validation split's batches for the trainer's evaluation: this rank's share of the windows (sliding
    with ``eval.stride``) over the tokens the standalone evaluator scores, or for masked data
    (``reads_stream`` False) the loader's first ``eval.steps`` batches."""
    t = cfg.training
    if not reads_stream(cfg):
        loader.reset()  # every evaluation sees the same batches
        return (loader.next_batch() for _ in range(cfg.eval.steps))
    return rank_batches(eval_stream(loader, cfg), t.seq_len, cfg.eval.stride or t.seq_len, t.local_batch_size,
                        dp_rank, dp)


def token_weighted_mean(losses: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Mean loss of a batch from its pipeline micro-batches' mean losses (the schedule splits ``labels`` into
    ``len(losses)`` chunks along the batch), each weighted by its scored labels; a micro-batch that scores
    nothing (a NaN mean) counts zero."""
    counts = torch.stack([(chunk >= 0).sum() for chunk in labels.tensor_split(len(losses))]).to(losses[0].device)
    means = torch.stack(losses)
    return torch.where(counts > 0, means * counts, 0).sum() / counts.sum()


def window_batch(tokens: torch.Tensor, group: list[tuple[int, int]], seq_len: int) -> tuple[torch.Tensor, ...]:
    """(inputs, labels) of windows (start, first scored offset); labels not scored are -100."""
    idx = torch.tensor([s for s, _ in group], device=tokens.device)[:, None] + torch.arange(
        seq_len + 1, device=tokens.device)
    data = tokens[idx]
    inputs, labels = data[:, :-1], data[:, 1:].clone()
    for row, (_, first) in enumerate(group):
        labels[row, :first] = -100  # already scored by an earlier window
    return inputs, labels


def rank_batches(tokens: np.ndarray, seq_len: int, stride: int, batch_size: int, rank: int,
                 world: int) -> Iterator[Batch]:
    """This data-parallel rank's share of the sliding windows over ``tokens``: ``batch_size`` windows of each
    global batch of ``world x batch_size``; the last global batch is filled with windows that score nothing,
    so that every rank runs the same forward passes (their collectives)."""
    spans = windows(len(tokens), seq_len, stride)
    per = batch_size * world
    spans += [(0, seq_len)] * (-len(spans) % per)
    stream = torch.from_numpy(tokens.astype(np.int64))
    for first in range(rank * batch_size, len(spans), per):
        inputs, labels = window_batch(stream, spans[first:first + batch_size], seq_len)
        yield Batch(inputs, labels, torch.zeros(batch_size, dtype=torch.long))


@torch.no_grad()
def sliding_sums(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, stride: int, batch_size: int,
                 table: torch.Tensor | None) -> torch.Tensor:
    """[summed CE (nats), scored tokens, bytes] over ``tokens`` (1-D) with sliding windows, batched."""
    device = next(model.parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    total = torch.zeros(3, dtype=torch.float64, device=device)
    spans = windows(len(tokens), seq_len, stride)
    for i in range(0, len(spans), batch_size):
        inputs, labels = window_batch(tokens, spans[i:i + batch_size], seq_len)
        logits = model(inputs)
        logits = logits.float() if logits.element_size() < 4 else logits  # bf16 -> float32; float64 stays
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        n = (labels >= 0).sum()
        total += batch_sums(loss / n, labels, table)
    return total
