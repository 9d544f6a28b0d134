"""Bits per byte: a tokenizer-independent validation metric (parameter-golf).

``bpb = loss / ln 2 x scored tokens / UTF-8 bytes of those tokens``, i.e. the summed cross-entropy in bits
over the bytes the scored tokens stand for. Bytes come from the tokenizer's own pieces: a byte token is
one byte, a SentencePiece piece is its text's UTF-8 length (``▁`` a space), a byte-fallback piece ``<0x..>``
one byte, a tiktoken or byte-level BPE token its bytes; end-of-text and other control tokens count zero
(``token_byte_lengths`` of each tokenizer in ``data/tokenizers``).
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def token_bytes(tokenizer, vocab_size: int) -> torch.Tensor | None:
    """(vocab_size,) int64 UTF-8 bytes of each token id; None when the tokenizer is unknown (pretokenized
    shards). Ids past the tokenizer's vocabulary (padding of the embedding) count zero."""
    lengths = getattr(tokenizer, "token_byte_lengths", None)
    if lengths is None:
        return None
    known = torch.as_tensor(lengths(), dtype=torch.int64)[:vocab_size]
    table = torch.zeros(vocab_size, dtype=torch.int64)
    table[:len(known)] = known
    return table


def batch_sums(loss: torch.Tensor, labels: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """[loss x scored tokens, scored tokens, bytes] (float64) of one batch whose mean loss is ``loss``;
    labels < 0 are not scored; a batch that scores nothing (whose mean loss is NaN) adds zeros."""
    scored = labels >= 0
    n = scored.sum().double()
    nbytes = (table[labels.clamp(min=0)] * scored).sum().double() if table is not None else n.new_zeros(())
    return torch.stack([torch.where(n > 0, loss.double() * n, n), n, nbytes])


def summarize(names: list[str], sums: torch.Tensor) -> tuple[float, dict[str, float]]:
    """(val_loss, metrics) from per-domain sums (rows as in :func:`batch_sums`): token-weighted val_loss
    and val_bpb over everything, and ``val/loss/<d>``, ``val/bpb/<d>`` per named domain."""
    sums = sums.double().cpu()
    total = sums.sum(dim=0)
    metrics: dict[str, float] = {}
    if total[2] > 0:
        metrics["val_bpb"] = float(total[0] / LN2 / total[2])
    for name, row in zip(names, sums, strict=True):
        if name:
            metrics[f"val/loss/{name}"] = float(row[0] / row[1])
            if row[2] > 0:
                metrics[f"val/bpb/{name}"] = float(row[0] / LN2 / row[2])
    return float(total[0] / total[1]), metrics
