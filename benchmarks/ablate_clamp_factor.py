"""Ablation of QAT's dynamic clamp factor (quant/qat.py), on CPU in about a minute.

1. FFN output error: a squared-ReLU FFN (dim 256, hidden 1024, init std 0.02, the weights of w1 also scaled
   by 0.1 and 10) on RMS-normalised Gaussian inputs; relative RMS error of the QAT forward against float32,
   per clamp factor, and the static clamp for comparison.
2. Training: 300 steps of the 2-layer dim-64 model of tests/test_quant_qat.py per factor; mean loss of the
   last 5 logged steps.
Usage: .venv/bin/python benchmarks/ablate_clamp_factor.py [--no-train]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_ext.models.ffn import FeedForward
from torchtitan_ext.quant.qat import QATFeedForward

FACTORS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)


def output_error(clamp: str, factor: float, w_scale: float) -> float:
    torch.manual_seed(0)
    ffn = FeedForward(256, 1024, "relu2")
    with torch.no_grad():
        ffn.w1.weight.normal_(0, 0.02).mul_(w_scale)
        ffn.w2.weight.normal_(0, 0.02)
    x = F.rms_norm(torch.randn(4096, 256), (256,))
    ref = ffn(x)
    out = QATFeedForward(ffn, clamp, factor)(x)
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def main() -> None:
    print("relative RMS error of the FFN output (QAT vs float32)")
    print(f"{'clamp':>10s} " + " ".join(f"w1 x {s:<5}" for s in (0.1, 1.0, 10.0)))
    for f in FACTORS:
        print(f"{'dyn ' + str(f):>10s} " + " ".join(f"{output_error('dynamic', f, s):9.4f}" for s in (0.1, 1.0, 10.0)))
    print(f"{'static':>10s} " + " ".join(f"{output_error('static', 4.0, s):9.4f}" for s in (0.1, 1.0, 10.0)))
    if "--no-train" in sys.argv:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_quant_qat import SMALL
    from trainer_utils import TINY
    print("mean loss over the last 5 logged steps of 300 (2 layers, dim 64)")
    variants = [("fp32", [])] + [(f"dynamic {f}", ["--quant.qat", "int8", "--quant.clamp_factor", str(f)])
                                 for f in FACTORS] + [("static", ["--quant.qat", "int8", "--quant.clamp", "static"])]
    for name, extra in variants:
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([sys.executable, "-m", "torchtitan_ext.train", *TINY, *SMALL, *extra,
                            "--job.dump_folder", d], check=True, capture_output=True)
            rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
            print(f"{name:>12s} {sum(r['loss'] for r in rows[-5:]) / 5:.4f}")


if __name__ == "__main__":
    main()
