"""Hugging Face export (``python -m torchtitan_ext.export``) of a run's checkpoint; the conversion is ``hf/``."""

from __future__ import annotations

from pathlib import Path

import torch

from torchtitan_ext.config.loader import ConfigError, parse_args
from torchtitan_ext.data.chat import DEFAULT_TEMPLATE
from torchtitan_ext.eval.load import find_checkpoint, run_tokenizer
from torchtitan_ext.hf.export import DEFAULT_SHARD_SIZE, ExportResult, export_checkpoint
from torchtitan_ext.hf.load import load_hf  # noqa: F401  (README: torchtitan_ext.export.load_hf)
from torchtitan_ext.models.flavors import resolve_model_args


def export_run(checkpoint: str | Path, output: str | Path, *, dtype: torch.dtype = torch.bfloat16,
               max_shard_size: int = DEFAULT_SHARD_SIZE, weights: str = "model") -> tuple[Path, ExportResult]:
    """(checkpoint folder read, what was written) for a dump folder (its latest checkpoint) or a ``step-N``
    folder: the run's ``config.toml`` gives the model's shape and its ``tokenizer/`` folder the tokenizer;
    the weights stream from the checkpoint one shard at a time (never the whole model in memory)."""
    dump, ckpt = find_checkpoint(checkpoint)
    toml = dump / "config.toml"
    if not toml.is_file():
        raise ConfigError(f"{dump}: no config.toml (the trainer writes it into the dump folder)")
    cfg = parse_args(["--config", str(toml)])
    tok = run_tokenizer(cfg, dump)
    args = resolve_model_args(cfg, getattr(tok, "vocab_size", 0))
    if cfg.data.dataset == "chat" and tok is not None and not tok.chat_template:
        tok.chat_template = DEFAULT_TEMPLATE  # what the run rendered its conversations with
    return ckpt, export_checkpoint(ckpt, args, output, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tok,
                                   weights=weights)
