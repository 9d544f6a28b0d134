"""Evaluate a job's checkpoint on one process and print JSON:

    python -m torchtitan_ext.eval --config FILE [--checkpoint.load_step N] [--eval.stride 64] [...]

The same config (and overrides) as the training job; the latest complete checkpoint in its dump folder (or
``checkpoint.load_step``) is loaded whatever layout saved it. Each validation split (every domain's with
``[[data.domains]]``) contributes its first ``eval.steps x local_batch_size`` windows' worth of tokens
(all of it when ``eval.steps = 0``), scored with sliding windows when ``eval.stride > 0``.

A run's own ``config.toml`` (``--config DUMP/config.toml``) reads the run in that file's folder, also when the
folder was copied or moved (its recorded ``job.dump_folder`` is then another folder, or none);
``--job.dump_folder`` names one explicitly. The checkpoint read is said on stderr.
"""

from __future__ import annotations

import json
import sys

from torchtitan_ext import cli
from torchtitan_ext.config.job_config import JobSection
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.locate import config_dump_folder, find_checkpoint


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.eval", description=__doc__, epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    return p


def _main(argv: list[str]) -> int:
    ns, rest = parser().parse_known_args(argv)
    cfg = parse_args(cli.job_argv(ns, rest))
    dump, note = config_dump_folder(ns.config, cfg, rest)
    try:  # before the imports below take their seconds
        find_checkpoint(dump, cfg)
    except ConfigError as e:
        if cfg.job.dump_folder != JobSection().dump_folder or (dump / cfg.checkpoint.folder).is_dir():
            raise
        raise ConfigError(f"{e}; that is the default job.dump_folder (evaluate a run with --config "
                          "DUMP/config.toml)") from None
    import torch

    from torchtitan_ext.eval.load import load_trained
    from torchtitan_ext.eval.validation import evaluate_model

    device = "cuda" if cfg.job.device != "cpu" and torch.cuda.is_available() else "cpu"
    model, tok, _, ckpt = load_trained(dump, device, cfg=cfg)
    print(f"eval: read checkpoint {ckpt}{f' ({note})' if note else ''}", file=sys.stderr, flush=True)
    val, metrics, scored = evaluate_model(model, tok, cfg)  # val_bpb and per-domain figures
    print(json.dumps({"checkpoint": str(ckpt), "stride": cfg.eval.stride or cfg.training.seq_len,
                      "scored_tokens": scored, "val_loss": val, **metrics}))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
