"""Hugging Face interchange (``python -m torchtitan_ext.export``): the conversion lives with the checkpoints
(``torchtitan_ext/checkpoint/hf.py``, which the trainer also uses for ``checkpoint.initial_load_path``), the
command line in ``__main__.py``."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.checkpoint.hf import (
    ExportError,
    architecture,
    export,
    hf_config,
    hf_name,
    load_hf,
    load_hf_weights,
    to_hf_state,
)
from torchtitan_ext.eval.load import load_trained

__all__ = ["ExportError", "architecture", "export", "export_checkpoint", "hf_config", "hf_name", "load_hf",
           "load_hf_weights", "to_hf_state"]


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> tuple[Path, str, Path]:
    """Export the model of a dump or ``step-N`` folder into ``output``: (checkpoint folder read, transformers
    architecture, output folder)."""
    model, tok, _, ckpt = load_trained(checkpoint)
    out = export(model, output, tok)
    return ckpt, hf_config(model.args)["architectures"][0], out
