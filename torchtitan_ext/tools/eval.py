"""Evaluate a job's checkpoint on one process and print JSON:

    python -m torchtitan_ext.eval --config FILE [--checkpoint.load_step N] [--eval.stride 64] [...]

The same config (and overrides) as the training job; the latest complete checkpoint in its dump folder (or
``checkpoint.load_step``) is loaded whatever layout saved it. Each validation split (every domain's with
``[[data.domains]]``) contributes its first ``eval.steps x local_batch_size`` windows' worth of tokens
(all of it when ``eval.steps = 0``), scored with sliding windows when ``eval.stride > 0``.
"""

from __future__ import annotations

import json

import torch

from torchtitan_ext import cli
from torchtitan_ext.config.loader import parse_args


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.eval", description=__doc__, epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    return p


def _main(argv: list[str]) -> int:
    from torchtitan_ext.eval.load import load_trained
    from torchtitan_ext.eval.validation import evaluate_model

    ns, rest = parser().parse_known_args(argv)
    cfg = parse_args(cli.job_argv(ns, rest))
    device = "cuda" if cfg.job.device != "cpu" and torch.cuda.is_available() else "cpu"
    model, tok, _, ckpt = load_trained(cfg.job.dump_folder, device, cfg=cfg)
    val, metrics, scored = evaluate_model(model, tok, cfg)  # val_bpb and per-domain figures
    print(json.dumps({"checkpoint": str(ckpt), "stride": cfg.eval.stride or cfg.training.seq_len,
                      "scored_tokens": scored, "val_loss": val, **metrics}))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
