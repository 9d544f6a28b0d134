"""The MoDE experts' grouped GEMMs one at a time on one GPU, each beside a dense GEMM of the same FLOPs: where
the experts' efficiency is lost (forward, input gradient, weight gradient; w1 and w3 apart or as one).

    python benchmarks/micro/grouped_gemm.py [--tokens 16384] [--dim 2048] [--hidden 1408] [--experts 16]
                                            [--top-k 2] [--iters 30] [--autotune]

Rows sorted by expert, ``tokens x top_k`` of them, split by the routing of a router drawn as the model's init
(``balanced`` splits them evenly). The GEMMs, in bf16 through ``torch._grouped_mm`` as ``models/mode.py``
calls it (weights stored (experts, out, in)):

* ``fwd``: rows (M, in) times each expert's weight transposed: (M, out).
* ``dgrad``: the output gradient (M, out) times the weights: (M, in).
* ``wgrad``: the output gradient transposed (out, M) times the rows (M, in), groups along M: (experts, out, in).

for ``w1`` (in = dim, out = hidden), ``w13`` (w1 and w3 stacked: out = 2 x hidden) and ``w2`` (in = hidden,
out = dim). Each row's ``dense_ms`` is one ``torch.mm`` of the same FLOPs (the groups joined). ``--autotune``
adds inductor's Triton grouped-GEMM template (max-autotune) for each ``fwd``. Last, the experts' forward and
backward, compiled, with the two layouts (``experts_split``, ``experts_fused``). One JSON line per row:
milliseconds (CUDA events, median of --iters after 5 warm-up calls) and TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the package from a checkout; steady.py
from steady import median_ms  # noqa: E402


def routed_counts(tokens: int, dim: int, experts: int, top_k: int, balanced: bool) -> torch.Tensor:
    if balanced:
        return torch.full((experts,), tokens * top_k // experts, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    x, router = torch.randn(tokens, dim, generator=gen), torch.randn(experts, dim, generator=gen) * 0.02
    return torch.bincount((x @ router.t()).topk(top_k, dim=-1).indices.flatten(), minlength=experts)


def gemm_cases(a: torch.Tensor, w: torch.Tensor, g: torch.Tensor, dense_w: torch.Tensor, ends: torch.Tensor) -> dict:
    """op -> (the grouped GEMM, its dense twin), as zero-argument calls."""
    return {"fwd": (lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=ends), lambda: a @ dense_w),
            "dgrad": (lambda: torch._grouped_mm(g, w, offs=ends), lambda: g @ dense_w.t()),
            "wgrad": (lambda: torch._grouped_mm(g.t(), a, offs=ends), lambda: g.t() @ a)}


def gemm_rows(counts: torch.Tensor, dim: int, hidden: int, iters: int, autotune: bool) -> list[dict]:
    dev, bf16 = "cuda", torch.bfloat16
    ends = counts.cumsum(0).to(dev, torch.int32)
    rows, experts = int(counts.sum()), counts.numel()
    out = []
    for weight, fan_in, fan_out in (("w1", dim, hidden), ("w13", dim, 2 * hidden), ("w2", hidden, dim)):
        a = torch.randn(rows, fan_in, device=dev, dtype=bf16)
        w = torch.randn(experts, fan_out, fan_in, device=dev, dtype=bf16) * fan_in ** -0.5
        g = torch.randn(rows, fan_out, device=dev, dtype=bf16)
        dense_w = torch.randn(fan_in, fan_out, device=dev, dtype=bf16)
        flops = 2 * rows * fan_in * fan_out
        for op, (grouped, dense) in gemm_cases(a, w, g, dense_w, ends).items():
            ms, dense_ms = median_ms(grouped, iters=iters, warmup=5), median_ms(dense, iters=iters, warmup=5)
            out.append({"op": op, "weight": weight, "ms": ms, "tflops": flops / ms / 1e9, "dense_ms": dense_ms,
                        "dense_tflops": flops / dense_ms / 1e9})
        if autotune:
            try:
                tuned = torch.compile(lambda x, v, e: torch._grouped_mm(x, v.transpose(-2, -1), offs=e),
                                      mode="max-autotune-no-cudagraphs", dynamic=False)
                ms = median_ms(functools.partial(tuned, a, w, ends), iters=iters, warmup=5)
                out.append({"op": "fwd_autotuned", "weight": weight, "ms": ms, "tflops": flops / ms / 1e9})
            except Exception as e:  # the template may not apply to this torch / shape
                out.append({"op": "fwd_autotuned", "weight": weight, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


def train_step(fn, x: torch.Tensor, grad: torch.Tensor, params: list[torch.Tensor]) -> None:
    for p in (*params, x):
        p.grad = None
    fn(x).backward(grad)


def experts_rows(counts: torch.Tensor, dim: int, hidden: int, iters: int) -> list[dict]:
    dev, bf16 = "cuda", torch.bfloat16
    ends = counts.cumsum(0).to(dev)
    rows, experts = int(counts.sum()), counts.numel()
    w1, w3 = (torch.randn(experts, hidden, dim, device=dev) * dim ** -0.5 for _ in range(2))
    w2 = torch.randn(experts, dim, hidden, device=dev) * hidden ** -0.5
    params = [p.requires_grad_() for p in (w1, w2, w3)]
    x = torch.randn(rows, dim, device=dev, dtype=bf16, requires_grad=True)
    g = torch.randn(rows, dim, device=dev, dtype=bf16)

    def gmm(a, w):
        return torch._grouped_mm(a, w.bfloat16().transpose(-2, -1), offs=ends.int())

    def split(a):
        return gmm(F.silu(gmm(a, w1)) * gmm(a, w3), w2)

    def fused(a):
        h1, h3 = gmm(a, torch.cat([w1, w3], dim=1)).chunk(2, dim=-1)
        return gmm(F.silu(h1) * h3, w2)

    out, flops = [], 6 * rows * 3 * dim * hidden
    for name, fn in (("experts_split", split), ("experts_fused", fused)):
        ms = median_ms(functools.partial(train_step, torch.compile(fn, dynamic=False), x, g, params),
                       iters=iters, warmup=5)
        out.append({"op": name, "ms": ms, "tflops": flops / ms / 1e9})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--autotune", action="store_true")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        print("grouped_gemm.py: needs a CUDA GPU", file=sys.stderr)
        return 1
    for routing in ("balanced", "router"):
        counts = routed_counts(opts.tokens, opts.dim, opts.experts, opts.top_k, routing == "balanced")
        base = {"routing": routing, "imbalance": round((counts.max() / counts.float().mean()).item(), 3)}
        for row in (gemm_rows(counts, opts.dim, opts.hidden, opts.iters, opts.autotune and routing == "router")
                    + experts_rows(counts, opts.dim, opts.hidden, opts.iters)):
            print(json.dumps({**base, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
