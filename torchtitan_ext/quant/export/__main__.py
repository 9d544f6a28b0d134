"""``python -m torchtitan_ext.quant.export``: a shim over ``torchtitan_ext/tools/quant_export.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.quant_export import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
