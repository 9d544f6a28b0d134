"""``python -m torchtitan_ext.mup.coord_check``: a shim over ``torchtitan_ext/tools/coord_check.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.coord_check import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
