"""GPU check of the fused ops at the ``1b`` step's shapes (16 x 2048 tokens, d 2048, FFN 5632, vocab 32000):
error against float32 references and forward+backward time against torch.compile of the unfused code.
``python benchmarks/micro/kernels.py`` prints one JSON line per op."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from torchtitan_ext.ops.activations import swiglu_fwd, swiglu_reference
from torchtitan_ext.ops.fused_norm import add_rms_norm, add_rms_norm_reference
from torchtitan_ext.ops.linear_cross_entropy import linear_cross_entropy


def fwd_bwd_ms(fn, inputs) -> float:
    def run():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    for _ in range(3):
        run()
    return Timer("run()", globals={"run": run}).blocked_autorange(min_run_time=1.0).median * 1e3


def leaf(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=dtype) * scale).requires_grad_(True)


def main() -> None:
    n, d, f, v = 16 * 2048, 2048, 5632, 32000
    x, y, w = leaf(n, d), leaf(n, d), leaf(d)
    h, nn_ = add_rms_norm(x, y, w, 1e-5)
    h_ref, n_ref = add_rms_norm_reference(x.float(), y.float(), w.float(), 1e-5)
    ref = torch.compile(lambda x, y, w: add_rms_norm_reference(x, y, w, 1e-5))
    print(json.dumps({"op": "add_rms_norm", "max_err": (nn_.float() - n_ref).abs().max().item(),
                      "triton_ms": fwd_bwd_ms(lambda *a: add_rms_norm(*a, 1e-5), (x, y, w)),
                      "compiled_torch_ms": fwd_bwd_ms(ref, (x, y, w))}), flush=True)
    a, b = leaf(n, f), leaf(n, f)
    print(json.dumps({"op": "swiglu", "max_err": (swiglu_fwd(a, b).float() - swiglu_reference(a.float(), b.float()))
                      .abs().max().item(), "triton_ms": fwd_bwd_ms(swiglu_fwd, (a, b)),
                      "compiled_torch_ms": fwd_bwd_ms(torch.compile(swiglu_reference), (a, b))}), flush=True)
    hid, head = leaf(n, d), leaf(v, d, scale=0.02)
    labels = torch.randint(0, v, (n,), device="cuda")

    def unfused(hid, head):
        return F.cross_entropy((hid @ head.t()).float(), labels)

    torch.cuda.reset_peak_memory_stats()
    fused_ms = fwd_bwd_ms(lambda hh, ww: linear_cross_entropy(hh, ww, labels), (hid, head))
    fused_peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    plain_ms = fwd_bwd_ms(torch.compile(unfused), (hid, head))
    plain_peak = torch.cuda.max_memory_allocated() / 2**30
    err = (linear_cross_entropy(hid, head, labels) - unfused(hid, head)).abs().item()
    print(json.dumps({"op": "linear_cross_entropy", "loss_err": err, "fused_ms": fused_ms,
                      "compiled_torch_ms": plain_ms, "fused_peak_gib": fused_peak,
                      "compiled_peak_gib": plain_peak}), flush=True)


if __name__ == "__main__":
    main()
