"""``python -m torchtitan_ext.distill.teacher``: a shim over ``torchtitan_ext/tools/teacher.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.teacher import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
