"""Which block-scaled float8 GEMM runs on this torch + GPU, how fast, and how accurate (float8.recipe =
"blockwise"). Part 1: one 8192 x 4096 x 14336 GEMM (an 8B model's w1 on 2 x 4096 tokens): bf16, tensorwise
and rowwise torch._scaled_mm, and 1x128 x 128x128 block-scaled by cuBLAS (torch._scaled_mm, and
torch.nn.functional.scaled_mm where this torch has it) and by torchao's Triton GEMM, each with its error
against float64. Part 2: forward + backward of an 8B block's seven linears (8192 tokens), compiled: bf16,
torchao Float8Linear tensorwise / rowwise, and BlockwiseFloat8Linear (cuBLAS GEMMs).

Usage from the repository root, with torchao importable:  python benchmarks/probe_blockwise.py

Measured (torch 2.11.0+cu130, torchao 0.17.0, one H200; the run tool's machine): GEMM ms (relative error
against float64) bf16 1.245 (1.7e-3), tensorwise 0.711 (3.8e-2), rowwise 0.675, blockwise cuBLAS
torch._scaled_mm 0.778 (3.7e-2), F.scaled_mm BlockWise1x128 / BlockWise128x128 0.788 (the same kernel),
torchao Triton GEMM 1.751. Block fwd + bwd ms: bf16 16.06, tensorwise 10.51 (1.53x), rowwise 14.00 (1.15x),
blockwise 13.66 (1.18x); BlockwiseFloat8Linear over torchao's Triton GEMMs failed to compile (inductor
NameError on the kernel's ``out_dtype`` constant).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_ext.quant.float8_blockwise import BlockwiseFloat8Linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import timed  # noqa: E402  (this folder)

E4M3 = torch.float8_e4m3fn


def gemm_probe(m: int = 8192, k: int = 4096, n: int = 14336) -> dict:
    from torchao.prototype.blockwise_fp8_training.kernels import (
        triton_fp8_blockwise_act_quant_lhs,
        triton_fp8_blockwise_weight_quant_transposed_rhs,
        triton_fp8_gemm_1x128_128x128,
    )

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    tflop = 2 * m * k * n / 1e12
    xs, ws = x.float().abs().amax() / 448, w.float().abs().amax() / 448
    xt, wt = (x / xs).to(E4M3), (w / ws).to(E4M3)
    xr, wr = x.float().abs().amax(1, keepdim=True) / 448, w.float().abs().amax(1, keepdim=True) / 448
    xrq, wrq = (x / xr).to(E4M3), (w / wr).to(E4M3)
    xb, xb_s = triton_fp8_blockwise_act_quant_lhs(x, 128)
    wb, wb_s = triton_fp8_blockwise_weight_quant_transposed_rhs(w, block_size=128)
    cases = {
        "bf16": lambda: x @ w.T,
        "tensorwise_scaled_mm": lambda: torch._scaled_mm(xt, wt.T, xs, ws, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True),
        "rowwise_scaled_mm": lambda: torch._scaled_mm(xrq, wrq.T, xr, wr.T, out_dtype=torch.bfloat16,
                                                      use_fast_accum=True),
        "blockwise_scaled_mm": lambda: torch._scaled_mm(xb, wb, xb_s, wb_s, out_dtype=torch.bfloat16),
        "blockwise_triton": lambda: triton_fp8_gemm_1x128_128x128(xb, wb, xb_s, wb_s, out_dtype=torch.bfloat16),
    }
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    if scaled_mm is not None:
        st = torch.nn.functional.ScalingType
        cases["blockwise_F.scaled_mm"] = lambda: scaled_mm(xb, wb, xb_s, st.BlockWise1x128, wb_s,
                                                           st.BlockWise128x128, output_dtype=torch.bfloat16)
    out = {}
    for name, fn in cases.items():
        try:
            y = fn()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            ms = timed(fn)
            out[name] = {"ms": round(ms, 3), "tflops": round(tflop / ms * 1e3, 1), "rel_err": f"{err:.2e}"}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        print(f"  {name}: {out[name]}", flush=True)
    return out


class Block(nn.Module):
    """An 8B decoder block's linears: wq, wk, wv, wo, w1, w3 on x (4096), w2 on h (14336)."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {"wq": (4096, 4096), "wk": (4096, 1024), "wv": (4096, 1024), "wo": (4096, 4096),
                  "w1": (4096, 14336), "w3": (4096, 14336), "w2": (14336, 4096)}
        for name, (i, o) in shapes.items():
            setattr(self, name, nn.Linear(i, o, bias=False))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        return [getattr(self, n)(x) for n in ("wq", "wk", "wv", "wo", "w1", "w3")] + [self.w2(h)]


def _swap(block: Block, make: Callable[[nn.Linear], nn.Module]) -> Block:
    for name, child in list(block.named_children()):
        setattr(block, name, make(child))
    return block


def block_probe(tokens: int = 8192) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(tokens, 4096, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(tokens, 14336, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    flop = 6 * tokens * sum(p.numel() for p in Block().parameters())
    variants = {
        "bf16": lambda b: b,
        "tensorwise": lambda b: convert_to_float8_training(b, config=Float8LinearConfig()),
        "rowwise": lambda b: convert_to_float8_training(b, config=Float8LinearConfig.from_recipe_name("rowwise")),
        "blockwise": lambda b: _swap(b, BlockwiseFloat8Linear.from_linear),
    }
    out = {}
    for name, convert in variants.items():
        try:
            torch.manual_seed(0)
            block = convert(Block().to("cuda", torch.bfloat16))
            compiled = torch.compile(block)
            grads = None

            def step(compiled: nn.Module = compiled) -> None:
                nonlocal grads
                ys = compiled(x, h)
                grads = grads or [torch.randn_like(y) for y in ys]
                torch.autograd.backward(ys, grads)

            ms = timed(step, iters=10)
            out[name] = {"ms": round(ms, 2), "tflops": round(flop / ms / 1e9, 1)}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            traceback.print_exc(limit=3)
        print(f"  {name}: {out[name]}", flush=True)
    base = out["bf16"].get("ms")
    for row in out.values():
        if base and "ms" in row:
            row["speedup_vs_bf16"] = round(base / row["ms"], 3)
    return out


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "cublas_lt": getattr(torch._C, "_cuda_getCompiledVersion", lambda: None)()}
    print(json.dumps(env))
    print("gemm 8192x4096x14336:", json.dumps(gemm_probe(), indent=1))
    print("8B block linears, fwd+bwd, compiled:", json.dumps(block_probe(), indent=1))


if __name__ == "__main__":
    main()
