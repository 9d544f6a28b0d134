"""Sliding-window evaluation (parameter-golf): windows of ``seq_len`` tokens advance by ``stride``; the
first window scores all its targets, every later one only the targets no earlier window scored (its last
``stride``), so each scored token after the first window sees at least ``seq_len - stride`` tokens of
context. ``stride = seq_len`` (or 0) is the plain non-overlapping evaluation. Windows run in batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_ext.eval.bpb import batch_sums


def windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int]]:
    """(window start, first scored offset within the window) covering targets 1 .. n_tokens - 1 once."""
    stride = stride or seq_len
    if not 0 < stride <= seq_len:
        raise ValueError(f"eval.stride = {stride}: expected 0 or 1 .. seq_len ({seq_len})")
    last = n_tokens - 1  # index of the last target
    if last < seq_len:
        raise ValueError(f"{n_tokens} validation tokens: fewer than one window of {seq_len + 1}")
    out, covered = [], 0  # targets <= covered are scored
    start = 0
    while covered < last:
        start = min(start, last - seq_len)
        out.append((start, covered - start))  # target index start + 1 + j scored for j >= covered - start
        covered = start + seq_len
        start += stride
    return out


@torch.no_grad()
def sliding_sums(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, stride: int, batch_size: int,
                 table: torch.Tensor | None) -> torch.Tensor:
    """[summed CE (nats), scored tokens, bytes] over ``tokens`` (1-D) with sliding windows, batched."""
    device = next(model.parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    total = torch.zeros(3, dtype=torch.float64, device=device)
    spans = windows(len(tokens), seq_len, stride)
    for i in range(0, len(spans), batch_size):
        group = spans[i:i + batch_size]
        idx = torch.tensor([s for s, _ in group], device=device)[:, None] + torch.arange(seq_len + 1,
                                                                                          device=device)
        data = tokens[idx]
        inputs, labels = data[:, :-1], data[:, 1:].clone()
        for row, (_, first) in enumerate(group):
            labels[row, :first] = -100  # already scored by an earlier window
        logits = model(inputs)
        logits = logits.float() if logits.element_size() < 4 else logits  # bf16 -> float32; float64 stays
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        n = (labels >= 0).sum()
        total += batch_sums(loss / n, labels, table)
    return total
