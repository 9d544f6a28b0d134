"""``python -m torchtitan_ext.data.prepare``: a shim over ``torchtitan_ext/tools/prepare.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.prepare import main, trees_main

__all__ = ["main", "trees_main"]

if __name__ == "__main__":
    exit_now(main())
