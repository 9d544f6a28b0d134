"""Squinch codec throughput against the device's copy bandwidth, printed as JSON.

GPU (the Triton kernels), from the repository root:  python3 benchmarks/micro/squinch.py [--json PATH]
CPU check of the script itself (the torch reference, tiny sizes):  python3 benchmarks/micro/squinch.py --smoke

For each input dtype (bf16, fp32) and size the script times encode and decode and reports:
- ``encode_gb_s``: GB/s of encoder input (n * element size / time);
- ``decode_gb_s``: GB/s of the gradient the decoder rebuilds, counted at the input dtype (same unit as encode,
  so the two are comparable);
- ``*_rw_gb_s``: bytes read plus written by the kernel (encode: n * element size + 0.75 n; decode: 0.75 n + 4 n)
  per second, and ``*_of_copy``: that figure over the copy bandwidth measured in the same run (a large
  device-to-device copy, bytes read plus written).
Before timing, the run checks that the dispatched kernels give the reference's bytes and values on random inputs.
Inputs rotate over enough buffers (>= 256 MiB in all) that small sizes are not served from L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the package from a checkout; steady.py

from steady import median_ms  # noqa: E402

from torchtitan_ext.comm import squinch  # noqa: E402

_ROTATE_BYTES = 256 * 2**20


def _time_ms(fn: Callable[[int], object], device: torch.device, iters: int, repeats: int) -> float:
    """Median over ``repeats`` samples of the mean time of ``iters`` calls ``fn(i)``, i = 0, 1, ..."""
    calls = itertools.count()
    return median_ms(lambda: fn(next(calls)), iters=repeats, calls=iters, device=device.type)


def copy_bandwidth_gb_s(device: torch.device, nbytes: int, iters: int, repeats: int) -> float:
    """Device-to-device copy, counting bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda i: dst.copy_(src), device, iters, repeats)
    return 2 * nbytes / ms / 1e6


def _random_gradient(n: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Normal values with a log-normal spread of block scales, some exact zeros: like a real gradient."""
    x = torch.randn(n, generator=generator, device=device)
    x *= torch.exp(2 * torch.randn(n, generator=generator, device=device))
    x[::7] = 0
    return x.to(dtype)


def check_against_reference(device: torch.device, sizes: list[int]) -> bool:
    """Dispatched encode/decode give the reference's bytes and values (NaN where the reference has NaN)."""
    generator = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        for dtype in (torch.bfloat16, torch.float32):
            x = _random_gradient(n, dtype, device, generator)
            x[n // 3] = float("nan")
            encoded = squinch.encode(x)
            if not torch.equal(encoded, squinch.encode_reference(x)):
                return False
            got, want = squinch.decode(encoded, n), squinch.decode_reference(encoded, n)
            nan = want.isnan()
            if not (torch.equal(nan, got.isnan()) and torch.equal(got[~nan].view(torch.int32),
                                                                  want[~nan].view(torch.int32))):
                return False
    return True


def bench_one(n: int, dtype: torch.dtype, device: torch.device, copy_gb_s: float, iters: int,
              repeats: int) -> dict[str, float | int | str]:
    generator = torch.Generator(device=device).manual_seed(n)
    element = torch.finfo(dtype).bits // 8
    count = max(1, min(64, _ROTATE_BYTES // (n * element)))
    inputs = [_random_gradient(n, dtype, device, generator) for _ in range(count)]
    encoded = [squinch.encode(x) for x in inputs]
    encode_ms = _time_ms(lambda i: squinch.encode(inputs[i % count]), device, iters, repeats)
    decode_ms = _time_ms(lambda i: squinch.decode(encoded[i % count], n), device, iters, repeats)
    enc_bytes = squinch.encoded_numel(n)
    encode_rw = (n * element + enc_bytes) / encode_ms / 1e6
    decode_rw = (enc_bytes + 4 * n) / decode_ms / 1e6
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "numel": n,
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
        "encode_gb_s": n * element / encode_ms / 1e6,
        "decode_gb_s": n * element / decode_ms / 1e6,
        "encode_rw_gb_s": encode_rw,
        "decode_rw_gb_s": decode_rw,
        "encode_of_copy": encode_rw / copy_gb_s,
        "decode_of_copy": decode_rw / copy_gb_s,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU with the torch reference")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)

    if args.smoke:
        device, sizes, iters, repeats, copy_bytes = torch.device("cpu"), [1000, 4099], 3, 3, 2**20
    else:
        if not torch.cuda.is_available():
            parser.error("needs CUDA; use --smoke to check the script on CPU")
        device, iters, repeats, copy_bytes = torch.device("cuda"), 50, 5, 2**30
        sizes = [2**20, 2**22, 2**24, 2**26, 2**28]

    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": "reference" if device.type == "cpu" else "triton",
    }
    if device.type == "cuda":
        import triton

        results["triton"] = triton.__version__
    results["matches_reference"] = check_against_reference(device, [1, 13, 4099, 1_000_003])
    copy_gb_s = copy_bandwidth_gb_s(device, copy_bytes, iters, repeats)
    results["copy_rw_gb_s"] = copy_gb_s
    results["runs"] = [bench_one(n, dtype, device, copy_gb_s, iters, repeats)
                       for dtype in (torch.bfloat16, torch.float32) for n in sizes]
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
