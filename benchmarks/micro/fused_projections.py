"""One block's input projections as separate linears against one linear over their concatenated weights, on one
GPU: q / k / v (``qkv``) and the SwiGLU's w1 / w3 (``w13``), forward and backward (input and weight
gradients), compiled, in bf16 and in torchao float8 tensorwise (one cast of the shared input instead of one
per linear).

    python benchmarks/micro/fused_projections.py [--shapes 1b,8b] [--iters 30]

Shapes: ``1b`` (32,768 tokens, d 2048, q 2048, k / v 1024 each, FFN 5632), ``8b`` (8,192 tokens, d 4096, q
4096, k / v 1024 each, FFN 14336). Prints one JSON line per (shape, precision, group): milliseconds of the
separate and the fused forms (CUDA events, median of --iters after 5 warm-up calls), the speed-up and the
TFLOP/s of each (6 x tokens x d x outputs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the package from a checkout; steady.py
from steady import median_ms  # noqa: E402

SHAPES = {"1b": (32768, 2048, {"qkv": [2048, 1024, 1024], "w13": [5632, 5632]}),
          "8b": (8192, 4096, {"qkv": [4096, 1024, 1024], "w13": [14336, 14336]})}


def projections(dim: int, outs: list[int], fused: bool, float8: bool) -> nn.ModuleList:
    mods = nn.ModuleList([nn.Linear(dim, sum(outs), bias=False)] if fused else
                         [nn.Linear(dim, o, bias=False) for o in outs]).cuda().bfloat16()
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(mods, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return mods


def timed(tokens: int, dim: int, outs: list[int], fused: bool, float8: bool, iters: int) -> float:
    mods = projections(dim, outs, fused, float8)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16) for o in outs]

    @torch.compile(fullgraph=True)
    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        if fused:
            return list(mods[0](x).split(outs, dim=-1))
        return [m(x) for m in mods]

    def step() -> None:
        torch.autograd.backward(forward(x), grads)

    return median_ms(step, iters=iters, warmup=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b,8b", help="comma-separated: 1b, 8b (default both)")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per form (default 30)")
    opts = parser.parse_args()
    unknown = set(opts.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"argument --shapes: unknown {sorted(unknown)}; expected some of {sorted(SHAPES)}")
    if not torch.cuda.is_available():
        sys.exit("fused_projections: needs a CUDA GPU")
    for shape in opts.shapes.split(","):
        tokens, dim, groups = SHAPES[shape]
        for float8 in (False, True):
            for group, outs in groups.items():
                flop = 6 * tokens * dim * sum(outs)
                ms = {form: timed(tokens, dim, outs, form == "fused", float8, opts.iters)
                      for form in ("separate", "fused")}
                print(json.dumps({"shape": shape, "precision": "float8" if float8 else "bf16", "group": group,
                                  "separate_ms": round(ms["separate"], 3), "fused_ms": round(ms["fused"], 3),
                                  "speedup": round(ms["separate"] / ms["fused"], 3),
                                  **{f"{form}_tflops": round(flop / t / 1e9, 1) for form, t in ms.items()}}),
                      flush=True)
                torch._dynamo.reset()


if __name__ == "__main__":
    main()
