"""The teacher pass: the teacher model over the training shards in the student's windows of
``training.seq_len + 1`` tokens, writing one sidecar per shard (distill/sidecar.py) with the Gumbel top-k of
each position. Every window's noise comes from a generator seeded by (seed, shard, window), so a pass resumed
after a crash (from the sidecar's windows-complete count) writes the same bytes. The command line that builds
the teacher from its checkpoint is ``tools/teacher.py``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan_ext.distill.gumbel import sample_topk
from torchtitan_ext.distill.sidecar import ROW_BYTES_PER_K, Sidecar, sidecar_path


def _write_rows(side: Sidecar, log_probs: torch.Tensor, mine: list[int], first: int, k: int, seq: int,
                shard_seed: int) -> None:
    """The Gumbel top-k of this rank's windows (``first`` is its first) into the sidecar; window w's noise is
    seeded by ``shard_seed + w``; a repeated tail window belongs to another rank."""
    for row, w in enumerate(mine):
        if w < first + row:
            continue
        gen = torch.Generator(device=log_probs.device)
        gen.manual_seed((shard_seed + w) % (1 << 62))
        tok, lp, thr = (t.cpu().numpy() for t in sample_topk(log_probs[row], k, generator=gen))
        rows = slice(w * seq + 1, w * seq + 1 + seq)
        side.tokens[rows], side.log_probs[rows], side.thresholds[rows] = tok, lp, thr


def write_sidecars(model: nn.Module, shards: list[Path], tokens: list[np.ndarray], seq: int, per_rank: int,
                   dp_rank: int, dp: int, vocab: int, k: int, output: Path, seed: int, device: torch.device,
                   forward_context: Callable[[], contextlib.AbstractContextManager],
                   progress: Callable[[str, int, int, float], None] | None = None) -> dict:
    """One sidecar per shard in ``output``, resuming each from its windows-complete count; returns the
    figures (tokens, seconds, tokens/s, sidecar and dense bf16 bytes per token). Rank 0 calls
    ``progress(shard name, windows done, windows, tokens/s)`` after each chunk."""
    rank = dist.get_rank()
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
    model.eval()
    done_tokens, t0 = 0, time.perf_counter()
    for s, (shard, shard_tokens) in enumerate(zip(shards, tokens, strict=True)):
        path = sidecar_path(output, shard)
        if rank == 0:
            Sidecar.create(path, k, vocab, shard_tokens, seq)
        dist.barrier()
        side = Sidecar(path, "r+")
        n, chunk = side.n_windows(), per_rank * dp
        for first in range(side.windows_done, n, chunk):
            mine = [min(first + dp_rank * per_rank + j, n - 1) for j in range(per_rank)]  # tail: repeats
            x = torch.stack([torch.from_numpy(shard_tokens[w * seq:w * seq + seq].astype("int64")) for w in mine])
            with torch.no_grad(), forward_context():
                logits = model(x.to(device))
                if isinstance(logits, DTensor):
                    logits = logits.full_tensor()
                log_probs = torch.log_softmax(logits.float(), dim=-1)
            _write_rows(side, log_probs, mine, first + dp_rank * per_rank, k, seq, seed * 1_000_003 + s * 65_537)
            for array in (side.tokens, side.log_probs, side.thresholds):
                array.flush()
            dist.barrier()
            if rank == 0:
                side.set_windows_done(min(first + chunk, n))
                done_tokens += (min(first + chunk, n) - first) * seq
                if progress is not None:
                    progress(shard.name, min(first + chunk, n), n, done_tokens / (time.perf_counter() - t0))
    seconds = time.perf_counter() - t0
    return {"tokens": done_tokens, "seconds": seconds, "tokens_per_sec": done_tokens / max(seconds, 1e-9),
            "bytes_per_token": k * ROW_BYTES_PER_K, "dense_bf16_bytes_per_token": 2 * vocab}
