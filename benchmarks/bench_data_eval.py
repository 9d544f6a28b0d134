"""Benchmarks of issue 15 that need no trainer run: data.prepare throughput by worker count, and
generation tokens/s with the KV cache. Prints one JSON line per measurement.

    python benchmarks/bench_data_eval.py prepare OUT_DIR   # corpus of stdlib sources, 1/2/4/8 workers
    python benchmarks/bench_data_eval.py generate          # 1b flavor, random init, bf16, one GPU
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import sysconfig
import time
from contextlib import redirect_stderr
from pathlib import Path

import torch


def bench_prepare(out: Path) -> None:
    from torchtitan_ext.data.prepare import main as prepare

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    written = 0
    with open(corpus, "w") as f:  # ~4 KB documents of Python sources, 64 MB
        for p in files:
            text = p.read_text(errors="replace")
            for s in range(0, len(text), 4000):
                line = json.dumps({"text": text[s:s + 4000]}) + "\n"
                f.write(line)
                written += len(line)
            if written > 64e6:
                break
    mb = corpus.stat().st_size / 1e6
    for workers in (1, 2, 4, 8):
        dest = out / f"w{workers}"
        err = io.StringIO()
        start = time.perf_counter()
        with redirect_stderr(err):
            code = prepare(["--input", str(corpus), "--output-dir", str(dest), "--workers", str(workers),
                            "--filters", "heuristics,minhash", "--tokenizer", "byte", "--chunk-docs", "256"])
        secs = time.perf_counter() - start
        report = json.loads(next(x for x in err.getvalue().splitlines() if x.startswith("{")))
        print(json.dumps({"bench": "prepare", "workers": workers, "exit": code, "input_mb": round(mb, 1),
                          "seconds": round(secs, 2), "mb_per_s": round(mb / secs, 2),
                          "mb_per_s_per_worker": round(mb / secs / workers, 2),
                          "removed": report["removed"], "tokens": report["tokens"]}), flush=True)


def bench_generate() -> None:
    from torchtitan_ext.generate import generate
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.models.flavors import get_flavor

    device = torch.device("cuda")
    args = dataclasses.replace(get_flavor("1b"), max_seq_len=1024)
    with torch.device(device):
        model = Decoder(args)
    model.init_buffers(device)
    with torch.no_grad():
        for p in model.parameters():  # random init (the speed does not depend on the values)
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    model = model.to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 8, 32):
        prompts = [torch.randint(0, args.vocab_size, (128,), generator=gen).tolist() for _ in range(batch)]
        generate(model, prompts, 8)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        new = generate(model, prompts, 256)
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        print(json.dumps({"bench": "generate", "flavor": "1b", "dtype": "bfloat16", "batch": batch,
                          "prompt": 128, "new_tokens": 256, "seconds": round(secs, 2),
                          "tokens_per_sec": round(sum(map(len, new)) / secs, 1),
                          "ms_per_step": round(1000 * secs / 256, 2)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        bench_prepare(Path(sys.argv[2]))
    else:
        bench_generate()
