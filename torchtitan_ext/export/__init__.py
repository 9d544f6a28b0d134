"""Hugging Face export (``python -m torchtitan_ext.export``); the conversion is ``checkpoint/hf.py``."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.checkpoint.hf import export, hf_config, load_hf  # noqa: F401  (README: export.load_hf)
from torchtitan_ext.eval.load import load_trained


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> tuple[Path, str, Path]:
    """(checkpoint folder read, transformers architecture, output folder)."""
    model, tok, _, ckpt = load_trained(checkpoint)
    return ckpt, hf_config(model.args)["architectures"][0], export(model, output, tok)
