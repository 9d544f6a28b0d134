"""``python -m torchtitan_ext.data.prepare``: arguments, console lines and exit codes; the work is
``torchtitan_ext.data.prepare.prepare`` (with ``--trees``, ``data.sources.trees.prepare_trees``)."""

from __future__ import annotations

import argparse
import errno
import glob
import json
import sys
import time
from pathlib import Path

from torchtitan_ext import cli
from torchtitan_ext.data.filters import HeuristicRules
from torchtitan_ext.data.prepare import FILTERS, STATE, Hooks, Progress, prepare
from torchtitan_ext.data.prepare import __doc__ as DESCRIPTION
from torchtitan_ext.data.shards import write_shard
from torchtitan_ext.data.sources.trees import TREE_SHARD_TOKENS, TreeError, prepare_trees
from torchtitan_ext.data.tokenizers import open_tokenizer
from torchtitan_ext.errors import EXIT_INTERRUPTED, UserError
from torchtitan_ext.eval.load import perplexity_scores

SHARD_TOKENS = 100_000_000


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


class _ConsoleProgress:
    """A tqdm bar of input bytes on a terminal; in a log file, a plain line every ``LOG_SECONDS`` and at the
    end (documents, tokens, MB/s of text, percent, ETA)."""

    LOG_SECONDS = 10.0

    def __init__(self) -> None:
        self.bar = None
        self.logged = 0.0
        try:
            from tqdm import tqdm
        except ImportError:  # the data extra is not installed: plain lines
            tqdm = None
        self.tqdm = tqdm

    def __call__(self, p: Progress, final: bool) -> None:
        mb = p.mb_per_s
        eta = max((p.total - p.bytes) / (mb * 1e6), 0.0) if mb > 0 else 0.0
        stats = f"{p.docs:,} docs  {p.tokens:,} tokens  {mb:.2f} MB/s"
        if sys.stderr.isatty() and self.tqdm is not None:
            if self.bar is None:
                self.bar = self.tqdm(total=p.total, desc=p.label, unit="B", unit_scale=True, file=sys.stderr)
            self.bar.update(min(p.bytes, p.total) - self.bar.n)
            self.bar.set_postfix_str(f"{stats}  ETA {eta:.0f}s", refresh=False)
            if final:
                self.close()
        elif final or time.monotonic() - self.logged >= self.LOG_SECONDS:
            self.logged = time.monotonic()
            print(f"{p.label}: {stats}  {100 * min(1.0, p.bytes / max(p.total, 1)):5.1f}%  ETA {eta:.0f}s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """End an open bar (a finished pass, or an error line about to follow)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.data.prepare", description=DESCRIPTION)
    p.add_argument("--input", required=True, nargs="+", help="files, folders or globs: text, .jsonl[.gz|.zst], "
                   ".parquet, a datasets folder")
    p.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet", "datasets"),
                   help="auto: from each input's name (a folder is a datasets folder)")
    p.add_argument("--output-dir", "--output", dest="output", required=True, help="folder for the shards")
    p.add_argument("--tokenizer", default="byte", help="byte, builtin, a Hugging Face tokenizer.json (or its "
                   "folder), a .tiktoken file[:encoding], or a SentencePiece .model")
    p.add_argument("--tokenizer-vocab-size", type=int, default=4096, help="for --tokenizer builtin")
    p.add_argument("--cache-dir", default="~/.cache/torchtitan_ext")
    p.add_argument("--text-key", default="text", help="JSONL field / parquet or datasets column holding the text")
    p.add_argument("--shard-tokens", type=int, default=None,
                   help=f"tokens per shard (default {SHARD_TOKENS:,}; with --trees {TREE_SHARD_TOKENS:,})")
    p.add_argument("--val-shards", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--chunk-docs", type=int, default=64, help="documents per work item")
    p.add_argument("--filters", default="", help=f"comma-separated, applied in order: {', '.join(FILTERS)}")
    p.add_argument("--min-tokens", type=int, default=HeuristicRules.min_tokens)
    p.add_argument("--max-tokens", type=int, default=HeuristicRules.max_tokens)
    p.add_argument("--max-symbol-ratio", type=float, default=HeuristicRules.max_symbol_ratio)
    p.add_argument("--max-repeat-ratio", type=float, default=HeuristicRules.max_repeat_ratio)
    p.add_argument("--minhash-threshold", type=float, default=0.8, help="estimated Jaccard above which a "
                   "document is a near duplicate")
    p.add_argument("--ppl-checkpoint", default="", help="dump folder of our reference model (ppl filter)")
    p.add_argument("--ppl-percentile", type=float, default=90.0, help="drop documents scoring above it")
    p.add_argument("--ppl-max-tokens", type=int, default=2048, help="tokens scored per document")
    p.add_argument("--trees", action="store_true", help="JSONL conversation trees (one per line) -> shards of "
                   "whole trees with node sidecars, for data.attention = 'tree' (torchtitan_ext.data.sources.trees)")
    return p


# The options tree mode reads; it writes training shards of whole trees, unfiltered, in one process.
TREE_OPTIONS = ("input", "output", "tokenizer", "tokenizer_vocab_size", "cache_dir", "shard_tokens", "trees")


def _prepare(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.shard_tokens is None:
        args.shard_tokens = TREE_SHARD_TOKENS if args.trees else SHARD_TOKENS
    if args.trees:
        given = next((name for name, value in vars(args).items()
                      if name not in TREE_OPTIONS and value != parser.get_default(name)), None)
        if given:
            raise TreeError(f"--trees does not take --{given.replace('_', '-')} (tree mode writes training shards of "
                            f"whole trees; keep validation trees in files of their own and prepare them separately)")
        return _trees(args)
    scorer = (lambda texts: perplexity_scores(texts, args.ppl_checkpoint, args.ppl_max_tokens)) \
        if args.ppl_checkpoint else None
    show = _ConsoleProgress()
    hooks = Hooks(warn=_stderr, note=_stderr, show=show, write=write_shard, ppl_scorer=scorer)
    out = Path(args.output)
    try:
        report = prepare(args, hooks)
    except ValueError as e:
        show.close()
        raise cli.user_error(e) from None
    except OSError as e:  # a full disk, a forbidden folder: the path, the system's reason, what is kept
        show.close()
        code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
        where = f"{e.filename}: " if e.filename else ""
        raise UserError(f"{where}{e.strerror or e} ({code}); {_kept(out)}") from None
    except KeyboardInterrupt:  # workers ignore SIGINT; the pool is ended and no partial file is left
        show.close()
        _stderr(f"error: interrupted (SIGINT): stopped; {_kept(out)}")
        return EXIT_INTERRUPTED
    if report is not None:
        _stderr(json.dumps(report))
        _stderr(f"wrote {report['tokens']:,} tokens from {report['documents_kept']:,} documents: "
                f"{report['train_shards']} train and {report['val_shards']} val shards in {Path(args.output)}")
    return 0


def _kept(out: Path) -> str:
    """What an interrupted or failed preparation leaves: whole shards and the state to resume from."""
    if not (out / STATE).is_file():
        return "no shard was written"
    return f"the whole shards written so far are kept in {out}: run the same command again to resume"


def _trees(args: argparse.Namespace) -> int:
    patterns = [str(Path(pattern).expanduser()) for pattern in args.input]
    files = sorted({Path(f) for pattern in patterns for f in (glob.glob(pattern) or [pattern])})
    try:
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise TreeError(f"{missing[0]}: no such file")
        tok = open_tokenizer(args.tokenizer, args.tokenizer_vocab_size, Path(args.cache_dir).expanduser())
        counts = prepare_trees(files, Path(args.output), tok, args.shard_tokens)
    except UnicodeDecodeError as e:
        raise cli.user_error(e) from None
    print(f"{counts['trees']:,} trees, {counts['nodes']:,} nodes, {counts['tokens']:,} tokens in "
          f"{counts['shards']} shard(s) under {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_prepare, argv)


def trees_main(argv: list[str] | None = None) -> int:
    """The trees mode alone (the former ``python -m torchtitan_ext.data.trees``): ``main`` with ``--trees``."""
    return main(["--trees", *(sys.argv[1:] if argv is None else argv)])
