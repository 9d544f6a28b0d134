"""``python -m torchtitan_ext.generate``: a shim over ``torchtitan_ext/tools/generate.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.generate import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
