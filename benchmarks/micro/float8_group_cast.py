"""The weight gradient's per-group, column-wise float8 casts at the Zen-shaped MoDE's sizes (issue 40): ours
(``quant/float8_group_cast.py``, one call per operand) against torchao 0.17's per-expert kernel (both operands in
one call), on one GPU.

    python benchmarks/micro/float8_group_cast.py [--rows 32768] [--groups 64] [--skew 10] [--iters 50]

The rows of one expert-parallel-free layer (8 x 2048 tokens x top-2) go to 64 experts with the hottest getting
``--skew`` times the mean (as the trainer's router logged, 7-11x), the rest shared evenly, every group padded to
16 rows; the two operand pairs of a SwiGLU expert's three weight gradients: (grad of h: 1408 columns, x: 2048)
for w1 and w3, (grad of the output: 2048, h: 1408) for w2. Prints one JSON line: milliseconds per call of each
kernel (CUDA events, median of --iters after 5 warm-up calls) and the speed-up, and whether the two agree bit
for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the package from a checkout; steady.py
from steady import median_ms  # noqa: E402


def group_ends(rows: int, groups: int, skew: float) -> torch.Tensor:
    """Group ends (int32, multiples of 16): group 0 holds ``skew`` x the mean, the others share the rest."""
    mean = rows / groups
    hot = int(mean * skew) // 16 * 16
    rest = (rows - hot) // (groups - 1) // 16 * 16
    sizes = [hot] + [rest] * (groups - 1)
    sizes[-1] += rows - sum(sizes)
    return torch.tensor(sizes, device="cuda").cumsum(0).int()




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--skew", type=float, default=10.0)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/micro/float8_group_cast.py needs a CUDA GPU")
    from torchao.prototype.moe_training.kernels import triton_fp8_per_group_colwise_scales_dual as torchao_dual

    from torchtitan_ext.quant.float8_group_cast import group_colwise_cast

    ends = group_ends(args.rows, args.groups, args.skew)
    out = {"rows": args.rows, "groups": args.groups, "skew": args.skew, "device": torch.cuda.get_device_name()}
    for name, (cols_a, cols_b) in {"w1_w3": (1408, 2048), "w2": (2048, 1408)}.items():
        a = torch.randn(args.rows, cols_a, device="cuda").bfloat16()
        b = torch.randn(args.rows, cols_b, device="cuda").bfloat16()
        ours_ms = median_ms(lambda a=a, b=b: (group_colwise_cast(a, ends), group_colwise_cast(b, ends)), args.iters, 5)
        theirs_ms = median_ms(lambda a=a, b=b: torchao_dual(a, b, ends, torch.float8_e4m3fn, True), args.iters, 5)
        (da, sa), (db, sb) = group_colwise_cast(a, ends), group_colwise_cast(b, ends)
        ta, tsa, tb, tsb = torchao_dual(a, b, ends, torch.float8_e4m3fn, True)
        same = all(torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                               y.view(torch.uint8) if y.dtype != torch.float32 else y)
                   for x, y in ((da, ta), (sa, tsa), (db, tb), (sb, tsb)))
        # against torch's own cast (round to nearest even) of x * scale: float8 bytes that differ
        group = torch.searchsorted(ends.long(), torch.arange(args.rows, device="cuda"), right=True)
        fmax = torch.finfo(torch.float8_e4m3fn).max
        ref = (a.float() * sa.view(-1, cols_a)[group]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        differ_ref = {"ours": int((da.view(torch.uint8) != ref.view(torch.uint8)).sum()),
                      "torchao": int((ta.view(torch.uint8) != ref.view(torch.uint8)).sum())}
        gbytes = args.rows * (cols_a + cols_b) * 5 / 1e9  # bf16 read twice, float8 written once
        out[name] = {"ours_ms": round(ours_ms, 3), "torchao_ms": round(theirs_ms, 3),
                     "speedup": round(theirs_ms / ours_ms, 2), "ours_tb_per_s": round(gbytes / ours_ms, 2),
                     "bit_equal": same, "bytes_differing_from_torch_cast": differ_ref}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
