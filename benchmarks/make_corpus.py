"""A benchmark corpus made on this machine and carried to the GPU machine (which has no network): the text
found here (Python sources: the standard library, the system's and this environment's packages; Debian's
package documentation: changelogs, copyright files, READMEs), deduplicated exactly (and, with
``--near-dup F``, without documents of which more than a fraction F of the 5-line passages came earlier), split
into train and validation by document (a hash of the path: about 2%), tokenized by a SentencePiece BPE trained on the
training documents, and written by ``python -m torchtitan_ext.data.prepare`` (train and validation in two
runs, so no document straddles the split) as shards the trainer reads with ``data.dataset = "shards"``.

    python benchmarks/make_corpus.py --out bench_data/code_doc_bpe512 --vocab 512 --train-tokens 24e6

Writes OUT/tokenizer.model, OUT/train_*.bin, OUT/val_000000.bin and OUT/corpus.json (what went in).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import random
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path

from torchtitan_ext.data.shards import read_shard
from torchtitan_ext.data.tokenizers.sentencepiece import SentencePieceTokenizer, train_bpe

MAX_DOC_BYTES = 1 << 20
SKIP_PARTS = {"test", "tests", "__pycache__", "testing", "_vendor", "vendored"}


def _python_roots() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"]),
             Path("/usr/lib/python3/dist-packages")]
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


def _documents() -> list[tuple[str, str]]:
    """(path, text) of every readable source and documentation file, exact duplicates dropped."""
    files = [p for root in _python_roots() for p in sorted(root.rglob("*.py"))
             if not SKIP_PARTS.intersection(p.relative_to(root).parts)]
    doc = Path("/usr/share/doc")
    if doc.is_dir():
        files += sorted(p for p in doc.rglob("*") if p.is_file() and not p.is_symlink()
                        and (p.name in ("copyright", "README", "NEWS") or p.name.startswith(("changelog", "README",
                                                                                            "NEWS"))))
    seen, out = set(), []
    for path in files:
        try:
            raw = path.read_bytes()
            if path.suffix == ".gz":
                raw = gzip.decompress(raw)
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        digest = hashlib.sha1(raw).digest()
        if not text.strip() or len(raw) > MAX_DOC_BYTES or digest in seen:
            continue
        seen.add(digest)
        out.append((str(path), text))
    return out


def _passages(text: str, k: int = 5) -> set[int]:
    """Hashes of every run of ``k`` consecutive non-blank lines (stripped): the unit copies share."""
    rows = [r.strip() for r in text.splitlines() if r.strip()]
    return {hash(tuple(rows[i:i + k])) for i in range(len(rows) - k + 1)}


def _drop_near_duplicates(docs: list[tuple[str, str]], limit: float) -> list[tuple[str, str]]:
    """The documents in order, without those of which more than ``limit`` of the passages appeared in a document
    kept before (vendored copies, other versions of one module, licence texts in copyright files): copies
    let a wide model lower its validation loss by memorising, which grows with width and data together."""
    seen: set[int] = set()
    kept = []
    for path, text in docs:
        passages = _passages(text)
        if len(passages & seen) > limit * len(passages):
            continue
        seen |= passages
        kept.append((path, text))
    return kept


def _covered(val: list[str], train: list[str]) -> float:
    """The fraction of the validation passages that also occur in the training documents."""
    train_passages = set().union(*map(_passages, train))
    val_passages = [p for text in val for p in _passages(text)]
    return sum(p in train_passages for p in val_passages) / max(1, len(val_passages))


def _training_sample(texts: list[str], budget: int = 40 << 20) -> list[str]:
    """Up to ``budget`` characters of 24-line ASCII pieces for SentencePiece's trainer: every character of its
    sample needs a piece of its own, so a few names in other scripts would not fit a small vocabulary;
    other characters are encoded through the byte fallback."""
    out, size = [], 0
    for text in texts:
        rows = text.splitlines(keepends=True)
        for i in range(0, len(rows), 24):
            piece = "".join(rows[i:i + 24])
            if piece.strip() and piece.isascii():
                out.append(piece)
                size += len(piece)
        if size > budget:
            break
    return out


def _up_to(texts: list[str], budget: float) -> tuple[list[str], int]:
    """The first of ``texts`` until their UTF-8 size reaches ``budget`` bytes, and that size."""
    kept, size = [], 0
    for text in texts:
        if size >= budget:
            break
        kept.append(text)
        size += len(text.encode())
    return kept, size


def _write_jsonl(path: Path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def _prepare(jsonl: Path, out: Path, tokenizer: Path, val: bool, workers: int) -> None:
    """``data.prepare`` of one split into ``out`` (validation: one shard)."""
    cmd = [sys.executable, "-m", "torchtitan_ext.data.prepare", "--input", str(jsonl), "--output-dir", str(out),
           "--tokenizer", str(tokenizer), "--workers", str(workers), "--shard-tokens",
           str(1 << 30 if val else 1 << 24), "--val-shards", "1" if val else "0"]
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--train-tokens", type=float, default=24e6, help="about this many training tokens")
    parser.add_argument("--val-tokens", type=float, default=1e6, help="about this many validation tokens")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--near-dup", type=float, default=1.0,
                        help="drop documents of which more than this fraction of 5-line passages came earlier "
                             "(1: exact duplicates only)")
    opts = parser.parse_args()
    if opts.vocab < 260 or opts.workers < 1 or not all(
            math.isfinite(t) and t > 0 for t in (opts.train_tokens, opts.val_tokens)) or not 0 <= opts.near_dup <= 1:
        parser.error("expected --vocab >= 260 (bytes and specials), positive --train-tokens / --val-tokens, "
                     "--workers >= 1 and --near-dup in [0, 1]")
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    docs = _documents()
    random.Random(opts.seed).shuffle(docs)  # code and prose mixed along the shards
    found = len(docs)
    if opts.near_dup < 1:
        docs = _drop_near_duplicates(docs, opts.near_dup)
    val = [t for p, t in docs if zlib.crc32(p.encode()) % 50 == 0]
    train = [t for p, t in docs if zlib.crc32(p.encode()) % 50 != 0]
    model = out / "tokenizer.model"
    if not model.is_file():
        train_bpe(_training_sample(train), opts.vocab, model)
    tok = SentencePieceTokenizer(model)
    sample = "".join(train[:200])
    bytes_per_token = len(sample.encode()) / max(1, len(tok.encode(sample)))
    kept, size = _up_to(train, opts.train_tokens * bytes_per_token)
    val, _ = _up_to(val, opts.val_tokens * bytes_per_token)
    work = out / "jsonl"
    work.mkdir(exist_ok=True)
    _write_jsonl(work / "train.jsonl", kept)
    _write_jsonl(work / "val.jsonl", val)
    tokens = {}
    for split, val_split in (("train", False), ("val", True)):
        _prepare(work / f"{split}.jsonl", out / split, model, val_split, opts.workers)
        tokens[split] = 0
        for shard in sorted((out / split).glob(f"{split}_*.bin")):  # beside the tokenizer: OUT/train_*.bin
            tokens[split] += len(read_shard(shard))
            shard.replace(out / shard.name)
    info = {"documents": {"found": found, "after_near_dup": len(docs), "train": len(kept), "val": len(val)},
            "near_dup": opts.near_dup, "val_passages_in_train": round(_covered(val, kept), 4),
            "train_text_bytes": size,
            "bytes_per_token": round(bytes_per_token, 3), "vocab": opts.vocab, "tokens": tokens,
            "sources": [str(r) for r in _python_roots()] + ["/usr/share/doc"]}
    (out / "corpus.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
