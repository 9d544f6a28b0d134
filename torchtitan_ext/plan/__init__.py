"""Memory and communication planner: the figures in ``estimate.py``, the layout search in ``search.py``, the
command line in ``tools/plan.py``, and for the trainer's out-of-memory message (``out_of_memory.py``)
``predicted_peak_bytes`` and ``fitting_changes`` (``fit.py``), imported on first use so that the command line
starts without torch."""

from __future__ import annotations

from typing import Any

__all__ = ["fitting_changes", "predicted_peak_bytes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from torchtitan_ext.plan import fit

        return getattr(fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
