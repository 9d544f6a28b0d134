"""``python -m torchtitan_ext.export``: a shim over ``torchtitan_ext/tools/export.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.export import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
