"""A run's checkpoint as a Hugging Face folder: the run's config and tokenizer found, the conversion in ``hf/``."""

from __future__ import annotations

from pathlib import Path

import torch

from torchtitan_ext.data.chat import DEFAULT_TEMPLATE
from torchtitan_ext.eval.load import trained_run
from torchtitan_ext.hf.export import DEFAULT_SHARD_SIZE, ExportResult, export_checkpoint


def export_run(checkpoint: str | Path, output: str | Path, *, dtype: torch.dtype = torch.bfloat16,
               max_shard_size: int = DEFAULT_SHARD_SIZE, weights: str = "model") -> tuple[Path, ExportResult]:
    """(checkpoint folder read, what was written) for a dump folder (its latest checkpoint) or a ``step-N``
    folder: the run's ``config.toml`` gives the model's shape and its ``tokenizer/`` folder the tokenizer;
    the weights stream from the checkpoint one shard at a time (never the whole model in memory)."""
    ckpt, cfg, tok, args = trained_run(checkpoint)
    if cfg.data.dataset == "chat" and tok is not None and not tok.chat_template:
        tok.chat_template = DEFAULT_TEMPLATE  # what the run rendered its conversations with
    return ckpt, export_checkpoint(ckpt, args, output, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tok,
                                   weights=weights)
