"""torch.compile per transformer block: small graphs compile fast and are reused by identical blocks."""

from __future__ import annotations

import torch
import torch.nn as nn


def apply_compile(model: nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)


def clean_fqn(name: str) -> str:
    """A parameter's name as the plain model knows it, without wrapper prefixes (compile, AC, DDP)."""
    parts = [p for p in name.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module")]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)
