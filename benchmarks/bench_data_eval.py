"""Benchmarks of issue 15: data.prepare throughput by worker count, generation tokens/s with the KV cache,
and the summary of the domains jobs of bench_data_eval.sh. Prints one JSON line per measurement.

    python benchmarks/bench_data_eval.py prepare OUT_DIR [--smoke]  # stdlib sources, 1/2/4/8 workers
    python benchmarks/bench_data_eval.py generate [--smoke]         # 1b, random init, bf16, one GPU: eager, compiled
    python benchmarks/bench_data_eval.py domains DUMP...            # each job's last evaluation

``--smoke``: a small input and the debug flavor on CPU, to check the script itself.
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


def bench_prepare(out: Path, smoke: bool) -> None:
    from torchtitan_ext.data.prepare.__main__ import main as prepare

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
            if written > (2e6 if smoke else 64e6):
                break
    mb = corpus.stat().st_size / 1e6
    for workers in (1, 2) if smoke else (1, 2, 4, 8):
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


def bench_generate(smoke: bool) -> None:
    """Eager and compiled decoding (``generate(compile=...)``) at each batch size: a warm-up call of the same
    shapes first (it holds the compilation and the CUDA graph recording; untimed), then the timed call."""
    from torchtitan_ext.generate.decoding import generate
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.models.flavors import get_flavor

    device = torch.device("cpu" if smoke else "cuda")
    flavor = "debug" if smoke else "1b"
    args = dataclasses.replace(get_flavor(flavor), max_seq_len=1024, vocab_size=get_flavor(flavor).vocab_size or 512)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    new_tokens = 16 if smoke else 256
    with torch.device(device):
        model = Decoder(args)
    model.init_buffers(device)
    with torch.no_grad():
        for p in model.parameters():  # random init (the speed does not depend on the values)
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    dtype = torch.float32 if smoke else torch.bfloat16
    model = model.to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    batches = (1, 2) if smoke else (1, 8, 32)
    prompts = {b: [torch.randint(0, args.vocab_size, (128,), generator=gen).tolist() for _ in range(b)]
               for b in batches}
    eager: dict[int, list[list[int]]] = {}
    for compiled in (False, True):
        for batch in batches:
            start = time.perf_counter()
            generate(model, prompts[batch], new_tokens, compile=compiled)  # warm-up
            sync()
            warmup = time.perf_counter() - start
            start = time.perf_counter()
            new = generate(model, prompts[batch], new_tokens, compile=compiled)
            sync()
            secs = time.perf_counter() - start
            row = {"bench": "generate", "flavor": flavor, "dtype": str(dtype).removeprefix("torch."),
                   "compiled": compiled, "batch": batch, "prompt": 128, "new_tokens": new_tokens,
                   "warmup_seconds": round(warmup, 1), "seconds": round(secs, 2),
                   "tokens_per_sec": round(sum(map(len, new)) / secs, 1),
                   "ms_per_step": round(1000 * secs / new_tokens, 2)}
            if compiled:  # greedy: equal unless two logits tie within rounding (bf16)
                row["same_tokens_as_eager"] = new == eager[batch]
                row["mean_tokens_before_first_difference"] = sum(
                    _common_prefix(a, b) for a, b in zip(new, eager[batch], strict=True)) / batch
            else:
                eager[batch] = new
            print(json.dumps(row), flush=True)
    # The compiled (CUDA-graph) path against eager in float32, where near-ties of bf16 logits do not decide:
    # prompts of different lengths (left padding), a stop id met by some rows.
    model = model.float()
    lengths = (5, 40, 128, 77)
    check = [torch.randint(0, args.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    eager_f32 = generate(model, check, 64)
    stop = eager_f32[1][10]
    same = generate(model, check, 64, compile=True) == eager_f32 and \
        generate(model, check, 64, stop_id=stop, compile=True) == generate(model, check, 64, stop_id=stop)
    print(json.dumps({"bench": "generate_check", "dtype": "float32", "prompt_lengths": lengths, "new_tokens": 64,
                      "compiled_equals_eager": same}), flush=True)
    # Every block feature the cached forward walks, MoDE's grouped GEMM inside the CUDA graph included (it
    # multiplies in bf16 even in a float32 model, so tokens are compared, not required equal).
    small = dataclasses.replace(args, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=512, qk_norm=True,
                                rope_fraction=0.5, nope_every=2, logit_softcap=20.0, kv_share="interleaved",
                                residual_scalars=True, tie_embeddings=True, n_experts=8, top_k=2, moe_every=2,
                                moe_hidden=128)
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(small)
    model.init_buffers(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model = model.eval()
    eager_f32 = generate(model, check, 64)
    compiled = generate(model, check, 64, compile=True)
    print(json.dumps({"bench": "generate_check", "dtype": "float32", "features": "qk_norm, partial and no RoPE, "
                      "KV sharing, residual scalars, MoDE, tied head, soft-cap", "compiled_equals_eager":
                      compiled == eager_f32, "mean_tokens_before_first_difference": sum(
                          _common_prefix(a, b) for a, b in zip(compiled, eager_f32, strict=True)) / len(check)}),
          flush=True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def domains_summary(dumps: list[Path]) -> None:
    """Each domains job's last evaluation: tokens trained, validation loss / bpb overall and per domain, and
    the mixing weights after it (one JSON line per job)."""
    for dump in dumps:
        path = dump / "metrics.jsonl"
        if not path.is_file():
            print(json.dumps({"bench": "domains", "job": dump.name, "error": "no metrics.jsonl"}))
            continue
        records = [json.loads(line) for line in path.read_text().splitlines()]
        tokens = max((r["tokens"] for r in records if "tokens" in r), default=0)
        evals = [r for r in records if "val_loss" in r]
        last = evals[-1] if evals else {}
        keep = {k: round(v, 4) for k, v in last.items() if k in ("step", "val_loss", "val_bpb")
                or k.startswith(("val/", "data/weight/"))}
        print(json.dumps({"bench": "domains", "job": dump.name, "tokens": tokens, "evaluations": len(evals),
                          **keep}), flush=True)


if __name__ == "__main__":
    smoke = "--smoke" in sys.argv
    if sys.argv[1] == "prepare":
        bench_prepare(Path(sys.argv[2]), smoke)
    elif sys.argv[1] == "domains":
        domains_summary([Path(p) for p in sys.argv[2:]])
    else:
        bench_generate(smoke)
