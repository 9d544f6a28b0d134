"""``python -m torchtitan_ext.plan``: a shim over ``torchtitan_ext/tools/plan.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
