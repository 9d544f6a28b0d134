"""Turn text or JSONL files into token shards:

    python -m torchtitan_ext.data.prepare --input 'data/*.jsonl' --output data/shards --tokenizer byte

Each .txt file is one document; each JSONL line is one document (its ``--text-key`` field). Documents are
followed by the tokenizer's end-of-text id. Shards hold ``--shard-tokens`` tokens (the last may be
shorter); the first ``--val-shards`` go to ``val_*.bin``, the rest to ``train_*.bin``.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from torchtitan_ext.data.corpus import builtin_tokenizer
from torchtitan_ext.data.shards import write_shard


def documents(files: list[Path], text_key: str) -> Iterator[str]:
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)[text_key]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise SystemExit(f"error: {path}:{n}: expected a JSON object with a "
                                         f"{text_key!r} string") from None
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


class ShardWriter:
    """Buffers tokens and writes full shards: val_000000.bin ... then train_000000.bin ..."""

    def __init__(self, out: Path, shard_tokens: int, val_shards: int):
        self.out, self.shard_tokens, self.val_left = out, shard_tokens, val_shards
        self.buf: list[np.ndarray] = []
        self.buffered = self.written = 0
        self.index = {"val": 0, "train": 0}

    def add(self, tokens: np.ndarray) -> None:
        self.buf.append(tokens)
        self.buffered += len(tokens)
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        data = np.concatenate(self.buf)
        split = "val" if self.val_left > 0 else "train"
        self.val_left -= split == "val"
        write_shard(self.out / f"{split}_{self.index[split]:06d}.bin", data[:n])
        self.index[split] += 1
        self.written += n
        self.buf, self.buffered = [data[n:]], len(data) - n

    def close(self) -> None:
        if self.buffered:
            self._flush(self.buffered)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan_ext.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="files or globs (.txt, .jsonl, other text)")
    p.add_argument("--output", required=True, help="folder for the shards")
    p.add_argument("--tokenizer", default="byte", help="byte, builtin, or a SentencePiece .model path")
    p.add_argument("--tokenizer-vocab-size", type=int, default=4096, help="for --tokenizer builtin")
    p.add_argument("--cache-dir", default="~/.cache/torchtitan_ext")
    p.add_argument("--text-key", default="text", help="JSONL field holding the document")
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--val-shards", type=int, default=0)
    args = p.parse_args(argv)

    files = sorted({Path(f) for pattern in args.input for f in glob.glob(str(Path(pattern).expanduser()))})
    if not files:
        print(f"error: --input {' '.join(args.input)}: no such files", file=sys.stderr)
        return 2
    if args.shard_tokens < 1:
        print(f"error: --shard-tokens {args.shard_tokens}: expected >= 1", file=sys.stderr)
        return 2
    try:
        tok = builtin_tokenizer(args.tokenizer, args.tokenizer_vocab_size, Path(args.cache_dir).expanduser())
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, args.shard_tokens, args.val_shards)
    eot = np.array([tok.eot_id], dtype=np.int32)
    start, docs, done_bytes = time.time(), 0, 0
    total_bytes = sum(f.stat().st_size for f in files)
    for text in documents(files, args.text_key):
        writer.add(np.concatenate([tok.encode(text), eot]))
        docs += 1
        done_bytes += len(text.encode("utf-8", errors="replace"))
        if docs % 1000 == 0 or done_bytes >= total_bytes:
            frac = min(1.0, done_bytes / max(total_bytes, 1))
            bar = "#" * int(30 * frac)
            print(f"\r[{bar:<30}] {100 * frac:5.1f}%  {docs:,} docs  {writer.written + writer.buffered:,} tokens  "
                  f"{time.time() - start:.0f}s", end="", file=sys.stderr, flush=True)
    writer.close()
    print(f"\nwrote {writer.written:,} tokens from {docs:,} documents: {writer.index['train']} train and "
          f"{writer.index['val']} val shards in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
