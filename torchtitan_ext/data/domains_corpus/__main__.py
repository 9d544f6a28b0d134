"""``python -m torchtitan_ext.data.domains_corpus``: a shim over ``torchtitan_ext/tools/domains_corpus.py``."""

from torchtitan_ext.cli import exit_now
from torchtitan_ext.tools.domains_corpus import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_now(main())
