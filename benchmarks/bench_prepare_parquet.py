"""data.prepare throughput on a FineWeb-like parquet file:
``python benchmarks/bench_prepare_parquet.py [OUT_DIR] [MB] [WORKERS, e.g. 1,4,8]``.

Writes OUT_DIR/fineweb_like.parquet (documents of English-like text, lengths drawn like web pages, in row
groups of 1,000 as FineWeb ships them), trains a 32k byte-level BPE with the tokenizers library on its first
documents, then runs ``python -m torchtitan_ext.data.prepare`` over it with each worker count and prints
each run's report (``mb_per_s``: MB of text per second, all workers together). The tokenizers library's own
threads are turned off (TOKENIZERS_PARALLELISM=false), so a worker is one core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_parquet(path: Path, megabytes: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    vocab = [w for w in Path(np.__file__).with_name("__init__.py").read_text().split() if w.isalpha()] or ["word"]
    vocab = sorted(set(vocab + "the of and to in a is that for it as was with be by on not he this are or".split()))
    writer, written, first = None, 0, []
    while written < megabytes * 1e6:
        lengths = rng.lognormal(6.2, 0.9, 1000).astype(int) + 20  # words per page, median ~500
        words = rng.choice(vocab, size=int(lengths.sum()))
        docs, at = [], 0
        for n in lengths:
            docs.append(" ".join(words[at:at + n]) + ".")
            at += n
        table = pa.table({"id": [f"doc-{written}-{i}" for i in range(len(docs))], "text": docs})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=1000)
        written += sum(len(d) for d in docs)
        if len(first) < 2000:
            first.extend(docs)
    writer.close()
    return first


def train_tokenizer(folder: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_prepare")
    megabytes = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    counts = [int(w) for w in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]
    out.mkdir(parents=True, exist_ok=True)
    parquet = out / "fineweb_like.parquet"
    t0 = time.time()
    first = make_parquet(parquet, megabytes)
    print(f"wrote {parquet} ({parquet.stat().st_size / 1e6:.0f} MB on disk) in {time.time() - t0:.0f} s")
    train_tokenizer(out / "tok", [d for d in first if d][: max(1, int(4e6 // 3000))])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for workers in counts:
        shards = out / f"shards_w{workers}"
        subprocess.run(["rm", "-rf", str(shards)], check=True)
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.data.prepare", "--input", str(parquet),
                               "--tokenizer", str(out / "tok"), "--output-dir", str(shards), "--workers", str(workers),
                               "--chunk-docs", "256"], env=env, capture_output=True, text=True)
        report = next((line for line in proc.stderr.splitlines() if line.startswith("{")), proc.stderr[-500:])
        print(f"workers {workers}: exit {proc.returncode} after {time.time() - t0:.0f} s: {report}", flush=True)


if __name__ == "__main__":
    main()
