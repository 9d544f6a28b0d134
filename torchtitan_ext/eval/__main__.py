"""``python -m torchtitan_ext.eval``: a shim over ``torchtitan_ext/tools/eval.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.eval import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
