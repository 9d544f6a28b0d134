"""The teacher pass of offline distillation: a trained teacher's top-k logits as sidecars of its training shards:

    python -m torchtitan_ext.distill.teacher --config outputs/debug/config.toml --output outputs/sidecars --k 32
        [--batch N]

``--config``: the teacher's job config, usually its dump folder's ``config.toml`` (here the default job's run);
a student then trains with ``--distill.path outputs/sidecars``. The teacher's latest checkpoint is loaded from
its dump folder (any data-parallel or TP layout: run it under ``torchrun`` with the parallelism the teacher
needs) and the sidecars are written (``distill/teacher``). Other ``--section.key value`` arguments override the
config; ``--batch N`` sets the windows per rank per forward.

A run's own ``config.toml`` (``--config DUMP/config.toml``) reads the run in that file's folder, also when the
folder was copied or moved, as eval does; ``--job.dump_folder`` names one explicitly. The checkpoint read is
said on stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from torchtitan_ext import cli
from torchtitan_ext.checkpoint.manager import CheckpointManager, ModelParts
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.data.packers.concat import TokenDataLoader
from torchtitan_ext.distill.teacher import write_sidecars
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.locate import config_dump_folder
from torchtitan_ext.train.build import build_data, build_model, build_runtime, forward_context

log = logging.getLogger("torchtitan_ext.distill.teacher")


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.distill.teacher", description=__doc__,
                           epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    p.add_argument("--output", action=cli.OptionValue, required=True, metavar="DIR", help="the folder for the sidecars")
    p.add_argument("--k", action=cli.OptionValue, type=cli.positive_whole, default=32, metavar="K",
                   help="logits kept per token (default: 32)")
    p.add_argument("--batch", action=cli.OptionValue, type=cli.positive_whole, default=None, metavar="N",
                   help="windows per rank per forward (default: the config's training.local_batch_size)")
    return p


class Progress:
    """The pass's progress on stderr: on a terminal one line per shard, rewritten in place; elsewhere (a log
    file, a pipe) a line every ``period`` seconds and at each shard's end: a file keeps the terminal's carriage
    returns as one endless line."""

    def __init__(self, stream: TextIO = sys.stderr, period: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.period, self.clock = stream, period, clock
        self.in_place = stream.isatty()
        self.last = clock()

    def __call__(self, shard: str, done: int, total: int, rate: float) -> None:
        line = f"{shard}: {done}/{total} windows, {rate:,.0f} tokens/s"
        if self.in_place:
            print(f"\r{line}", end="\n" if done == total else "", file=self.stream, flush=True)
        elif done == total or self.clock() - self.last >= self.period:
            self.last = self.clock()
            print(line, file=self.stream, flush=True)


def _main(argv: list[str]) -> int:
    ns, rest = parser().parse_known_args(argv)
    k = ns.k
    cfg = parse_args(cli.job_argv(ns, rest))
    dump, note = config_dump_folder(ns.config, cfg, rest)  # a copied dump folder: the copy, not the original
    cfg.job.dump_folder = str(dump)
    cfg.checkpoint.enabled, cfg.distill.path, cfg.ema.decay, cfg.eval.use_ema = True, "", 0.0, False
    if ns.batch is not None:
        cfg.training.local_batch_size = ns.batch
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
    if (step := checkpoint.load()) == 0:
        raise ConfigError(f"no teacher checkpoint in {checkpoint.folder}")
    if runtime.rank == 0:
        print(f"teacher: read checkpoint {checkpoint.folder / f'step-{step}'}{f' ({note})' if note else ''}",
              file=sys.stderr, flush=True)
    loader = data.loader
    figures = write_sidecars(model.parts[0], loader.shards, loader.tokens, loader.seq_len, loader.local_batch_size,
                             dims.dp_rank, dims.dp, args.vocab_size, k, Path(ns.output), cfg.job.seed, runtime.device,
                             lambda: forward_context(cfg, runtime), Progress() if runtime.rank == 0 else None)
    log.info(f"teacher pass: {figures['tokens']:,} tokens in {figures['seconds']:.1f} s "
             f"({figures['tokens_per_sec']:,.0f} tokens/s); sidecar {figures['bytes_per_token']} bytes/token at "
             f"k = {k} vs dense bf16 {2 * args.vocab_size:,} "
             f"({2 * args.vocab_size / figures['bytes_per_token']:.0f}x smaller)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
