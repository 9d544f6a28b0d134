"""Hugging Face export (``python -m torchtitan_ext.export``); the conversion is ``hf/``."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.eval.load import load_trained
from torchtitan_ext.hf.architectures import hf_config
from torchtitan_ext.hf.load import export, load_hf  # noqa: F401  (README: export.load_hf)


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> tuple[Path, str, Path]:
    """(checkpoint folder read, transformers architecture, output folder)."""
    model, tok, _, ckpt = load_trained(checkpoint)
    return ckpt, hf_config(model.args)["architectures"][0], export(model, output, tok)
