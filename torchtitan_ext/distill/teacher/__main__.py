"""``python -m torchtitan_ext.distill.teacher --config teacher.toml --output DIR --k 32 [--batch N]``.

Loads the teacher's latest checkpoint from its job config (``job.dump_folder``; any data-parallel or TP
layout: run it under ``torchrun`` with the parallelism the teacher needs) and writes the sidecars
(``distill/teacher``). Other ``--section.key value`` arguments override the config; ``--batch N`` sets the
windows per rank per forward.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from torchtitan_ext.checkpoint.manager import CheckpointManager, ModelParts
from torchtitan_ext.cli import exit_now, run_tool
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.data.packers.concat import TokenDataLoader
from torchtitan_ext.distill.teacher import write_sidecars
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.train.build import build_data, build_model, build_runtime, forward_context

log = logging.getLogger("torchtitan_ext.distill.teacher")


def _take(argv: list[str], flag: str, default: str | None) -> tuple[str | None, list[str]]:
    if flag not in argv:
        return default, argv
    i = argv.index(flag)
    if i + 1 >= len(argv):
        raise ConfigError(f"{flag} needs a value")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def _progress(shard: str, done: int, total: int, rate: float) -> None:
    """One console line per shard, rewritten in place."""
    end = "\n" if done == total else ""
    print(f"\r{shard}: {done}/{total} windows, {rate:,.0f} tokens/s", end=end, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
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
    cfg.checkpoint.enabled, cfg.distill.path, cfg.ema.decay, cfg.eval.use_ema = True, "", 0.0, False
    if batch:
        cfg.training.local_batch_size = batch
    runtime = build_runtime(cfg)
    dims = runtime.dims
    _, args, data = build_data(cfg, dims)
    if dims.pp > 1 or type(data.loader) is not TokenDataLoader:
        raise ConfigError("teacher pass: no pipeline parallelism, and a plain shard stream (no data.domains)")
    if not 1 <= k < args.vocab_size:
        raise ConfigError(f"--k = {k}: expected between 1 and the vocabulary - 1 ({args.vocab_size - 1})")
    model = build_model(cfg, runtime, args)
    checkpoint = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, {"model": ModelParts(model.parts)},
                                   log=log.info)
    if checkpoint.load() == 0:
        raise ConfigError(f"no teacher checkpoint in {checkpoint.folder}")
    loader = data.loader
    figures = write_sidecars(model.parts[0], loader.shards, loader.tokens, loader.seq_len, loader.local_batch_size,
                             dims.dp_rank, dims.dp, args.vocab_size, k, Path(output), cfg.job.seed, runtime.device,
                             lambda: forward_context(cfg, runtime), _progress if runtime.rank == 0 else None)
    log.info(f"teacher pass: {figures['tokens']:,} tokens in {figures['seconds']:.1f} s "
             f"({figures['tokens_per_sec']:,.0f} tokens/s); sidecar {figures['bytes_per_token']} bytes/token at "
             f"k = {k} vs dense bf16 {2 * args.vocab_size:,} "
             f"({2 * args.vocab_size / figures['bytes_per_token']:.0f}x smaller)")
    return 0


if __name__ == "__main__":
    exit_now(run_tool(main))
