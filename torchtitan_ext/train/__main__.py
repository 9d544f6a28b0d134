"""``python -m torchtitan_ext.train``: a shim over ``torchtitan_ext/tools/train.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.train import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
