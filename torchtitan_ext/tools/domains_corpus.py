"""``python -m torchtitan_ext.data.domains_corpus``: arguments, console lines and exit codes (the corpus
itself is built by ``torchtitan_ext.data.domains_corpus.build``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from torchtitan_ext import cli
from torchtitan_ext.data.domains_corpus import __doc__ as DESCRIPTION
from torchtitan_ext.data.domains_corpus import build


def _main(argv: list[str]) -> int:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.data.domains_corpus", description=DESCRIPTION)
    p.add_argument("--output", default="~/.cache/torchtitan_ext/domains")
    p.add_argument("--tokenizer", default="byte", help="byte, builtin, or a SentencePiece .model path")
    p.add_argument("--tokenizer-vocab-size", type=int, default=4096)
    p.add_argument("--cache-dir", default="~/.cache/torchtitan_ext")
    p.add_argument("--max-mb", type=float, default=8.0, help="text per domain")
    args = p.parse_args(argv)
    try:
        build(Path(args.output).expanduser(), args.tokenizer, args.tokenizer_vocab_size,
              Path(args.cache_dir).expanduser(), args.max_mb, report=functools.partial(print, file=sys.stderr))
    except ValueError as e:
        raise cli.user_error(e) from None
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
