"""``python -m torchtitan_ext.scaling``: a shim over ``torchtitan_ext/tools/scaling.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.scaling import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
