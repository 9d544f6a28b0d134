"""Hugging Face export (``python -m torchtitan_ext.export``) of a run's checkpoint; the conversion is ``hf/``.

``export_run`` (``run.py``) and ``load_hf`` (``hf/load.py``) are imported on first use: the package itself
imports no torch, so the command checks its arguments and paths before the seconds that import takes."""

from __future__ import annotations

from typing import Any

_LAZY = {"export_run": "torchtitan_ext.export.run", "load_hf": "torchtitan_ext.hf.load"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = list(_LAZY)
