"""Which linear shapes the block-scaled float8 GEMMs (``float8.recipe = "blockwise"``, torchao's prototype over
cuBLAS) compute correctly on this GPU: for each (in, out) a ``BlockwiseFloat8Linear`` against its plain-torch
emulation and the bf16 linear, forward, input gradient and weight gradient on 2,048 tokens, eager and compiled.
Prints one JSON line per case (non-finite counts, errors relative to the emulation and to bf16).

    python benchmarks/probe_blockwise_shapes.py [--shapes 256x256,768x256] [--eager-only]
    # on the GPU machine, torchao importable
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtitan_ext.quant.float8_blockwise import BlockwiseFloat8Linear  # noqa: E402

SHAPES = [(1024, 2048), (256, 128), (128, 256), (256, 256), (256, 768), (768, 256), (512, 128), (128, 128)]


def run(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mod(x)
    y.backward(dy)
    return [t.float() for t in (y.detach(), x.grad, weight.grad)]


def _shapes(raw: str) -> list[tuple[int, int]]:
    """argparse type: ``IN1xOUT1,IN2xOUT2``."""
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in raw.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected INxOUT[,INxOUT...] of whole numbers, got {raw!r}")
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=_shapes, default=SHAPES, help="INxOUT,... (default: %(default)s)")
    parser.add_argument("--eager-only", action="store_true", help="skip the compiled runs (compiling is slow)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: probe_blockwise_shapes.py needs a CUDA GPU (compute capability 9.0) and torchao")
    for fan_in, fan_out in opts.shapes:
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(8, 256, fan_in, device="cuda", generator=g).to(torch.bfloat16)
        dy = torch.randn(8, 256, fan_out, device="cuda", generator=g).to(torch.bfloat16) * 1e-3
        plain = nn.Linear(fan_in, fan_out, bias=False, device="cuda")  # float32 weights under autocast
        nn.init.normal_(plain.weight, std=0.02)
        mods = {"bf16": plain, "emulated": BlockwiseFloat8Linear.from_linear(plain, emulate=True)}
        real = BlockwiseFloat8Linear.from_linear(plain, unchecked_shapes=True)  # measure refused shapes too
        mods["eager"] = real
        if not opts.eager_only:
            mods["compiled"] = torch.compile(real)
        out = {}
        for name, mod in mods.items():
            try:
                out[name] = run(mod, x, dy, plain.weight)
            except Exception as e:  # a shape a kernel refuses: report it, go on
                out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        row = {"in": fan_in, "out": fan_out}
        for name in ("eager", "compiled")[:1 if opts.eager_only else 2]:
            if isinstance(out[name], str):
                row[name] = out[name]
                continue
            row[name] = {part: {"nonfinite": int((~t.isfinite()).sum()),
                                "vs_emulated": round(((t - e).norm() / e.norm()).item(), 4),
                                "vs_bf16": round(((t - b).norm() / b.norm()).item(), 4)}
                         for part, t, e, b in zip(("y", "dx", "dw"), out[name], out["emulated"], out["bf16"],
                                                  strict=True)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
