"""The teacher pass: ``python -m torchtitan_ext.distill.teacher --config teacher.toml --output DIR --k 32``.

Loads the teacher's latest checkpoint from its job config (``job.dump_folder``; any layout: run it under
``torchrun`` with the parallelism the teacher needs), runs it over the training shards in the student's
windows of ``training.seq_len + 1`` tokens and writes one sidecar per shard (distill/sidecar.py) with the
Gumbel top-k of each position. Every window's noise comes from a generator seeded by (seed, shard, window),
so a pass resumed after a crash (from the sidecar's windows-complete count) writes the same bytes. Other
``--section.key value`` arguments override the config; ``--batch N`` sets the windows per rank per forward.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_ext.config.loader import ConfigError, parse_args


def _take(argv: list[str], flag: str, default: str | None) -> tuple[str | None, list[str]]:
    if flag not in argv:
        return default, argv
    i = argv.index(flag)
    if i + 1 >= len(argv):
        raise ConfigError(f"{flag} needs a value")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def run(argv: list[str]) -> dict:
    """The pass; returns its figures (tokens, seconds, bytes per token, dense bf16 bytes per token)."""
    from torchtitan_ext.data.loader import TokenDataLoader
    from torchtitan_ext.distill.gumbel import sample_topk
    from torchtitan_ext.distill.sidecar import Sidecar, bytes_per_token, sidecar_path
    from torchtitan_ext.train.trainer import Trainer

    output, argv = _take(argv, "--output", None)
    k, argv = _take(argv, "--k", "32")
    batch, argv = _take(argv, "--batch", "0")
    if not output:
        raise ConfigError("--output DIR is required (the folder for the sidecars)")
    try:
        k, batch = int(k), int(batch)
    except ValueError:
        raise ConfigError(f"--k / --batch: expected integers, got {k!r} / {batch!r}") from None
    cfg = parse_args(argv)
    cfg.metrics.jsonl = cfg.metrics.tensorboard = False
    cfg.checkpoint.enabled, cfg.distill.path, cfg.ema.decay, cfg.eval.use_ema = True, "", 0.0, False
    if batch:
        cfg.training.local_batch_size = batch
    trainer = Trainer(cfg)
    if trainer.step == 0:
        raise ConfigError(f"no teacher checkpoint in {trainer.checkpointer.folder}")
    if trainer.dims.pp > 1 or type(trainer.loader) is not TokenDataLoader:
        raise ConfigError("teacher pass: no pipeline parallelism, and a plain shard stream (no data.domains)")
    vocab = trainer.model_args.vocab_size
    if not 1 <= k < vocab:
        raise ConfigError(f"--k = {k}: expected between 1 and the vocabulary - 1 ({vocab - 1})")
    loader, model, dims = trainer.loader, trainer.model_parts[0], trainer.dims
    seq, per_rank = loader.seq_len, loader.local_batch_size
    out = Path(output)
    if trainer.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    model.eval()
    done_tokens, t0 = 0, time.perf_counter()
    for s, (shard, tokens) in enumerate(zip(loader.shards, loader.tokens, strict=True)):
        path = sidecar_path(out, shard)
        if trainer.rank == 0:
            Sidecar.create(path, k, vocab, tokens, seq)
        dist.barrier()
        side = Sidecar(path, "r+")
        n, chunk = side.n_windows(), per_rank * dims.dp
        for first in range(side.windows_done, n, chunk):
            mine = [min(first + dims.dp_rank * per_rank + j, n - 1) for j in range(per_rank)]  # tail: repeats
            x = torch.stack([torch.from_numpy(tokens[w * seq:w * seq + seq].astype("int64")) for w in mine])
            with torch.no_grad(), trainer._autocast(), trainer._loss_context():
                logits = model(x.to(trainer.device))
                if isinstance(logits, DTensor):
                    logits = logits.full_tensor()
                log_probs = torch.log_softmax(logits.float(), dim=-1)
            for row, w in enumerate(mine):
                if w < first + dims.dp_rank * per_rank + row:
                    continue  # a repeated tail window: its rows belong to another rank
                gen = torch.Generator(device=log_probs.device)
                gen.manual_seed((cfg.job.seed * 1_000_003 + s * 65_537 + w) % (1 << 62))
                tok, lp, thr = (t.cpu().numpy() for t in sample_topk(log_probs[row], k, generator=gen))
                rows = slice(w * seq + 1, w * seq + 1 + seq)
                side.tokens[rows], side.log_probs[rows], side.thresholds[rows] = tok, lp, thr
            side.tokens.flush()
            side.log_probs.flush()
            side.thresholds.flush()
            dist.barrier()
            if trainer.rank == 0:
                side.set_windows_done(min(first + chunk, n))
                done_tokens += (min(first + chunk, n) - first) * seq
                rate = done_tokens / (time.perf_counter() - t0)
                print(f"\r{shard.name}: {min(first + chunk, n)}/{n} windows, {rate:,.0f} tokens/s",
                      end="", file=sys.stderr, flush=True)
        if trainer.rank == 0:
            print(file=sys.stderr)
    seconds = time.perf_counter() - t0
    figures = {"tokens": done_tokens, "seconds": seconds, "tokens_per_sec": done_tokens / max(seconds, 1e-9),
               "bytes_per_token": bytes_per_token(k), "dense_bf16_bytes_per_token": 2 * vocab}
    trainer.log(f"teacher pass: {done_tokens:,} tokens in {seconds:.1f} s ({figures['tokens_per_sec']:,.0f} "
                f"tokens/s); sidecar {figures['bytes_per_token']} bytes/token at k = {k} vs dense bf16 "
                f"{2 * vocab:,} ({2 * vocab / figures['bytes_per_token']:.0f}x smaller)")
    trainer.metrics.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    from torchtitan_ext.data.shards import ShardError
    from torchtitan_ext.distill.sidecar import SidecarError
    from torchtitan_ext.parallel.dims import ParallelDimsError

    try:
        run(sys.argv[1:] if argv is None else argv)
        dist.barrier()
    except (ConfigError, ParallelDimsError, ShardError, SidecarError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
