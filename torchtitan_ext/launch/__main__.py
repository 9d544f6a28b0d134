"""``python -m torchtitan_ext.launch``: a shim over ``torchtitan_ext/tools/launch.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
