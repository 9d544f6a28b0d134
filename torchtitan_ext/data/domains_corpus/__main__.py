"""``python -m torchtitan_ext.data.domains_corpus``: arguments, console lines and exit codes (the corpus
itself is built by ``torchtitan_ext.data.domains_corpus.build``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_ext.cli import run_tool
from torchtitan_ext.data.domains_corpus import __doc__ as DESCRIPTION
from torchtitan_ext.data.domains_corpus import build
from torchtitan_ext.errors import UserError


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan_ext.data.domains_corpus", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="~/.cache/torchtitan_ext/domains")
    p.add_argument("--tokenizer", default="byte", help="byte, builtin, or a SentencePiece .model path")
    p.add_argument("--tokenizer-vocab-size", type=int, default=4096)
    p.add_argument("--cache-dir", default="~/.cache/torchtitan_ext")
    p.add_argument("--max-mb", type=float, default=8.0, help="text per domain")
    args = p.parse_args(argv)
    try:
        build(Path(args.output).expanduser(), args.tokenizer, args.tokenizer_vocab_size,
              Path(args.cache_dir).expanduser(), args.max_mb, report=_stderr)
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UserError(str(e)) from None
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
