"""MoDE layer throughput on one GPU against a dense SwiGLU FFN with the same active parameters.

Usage, from the repository root: ``python3 benchmarks/micro/mode.py [--json PATH] [--no-compile]``;
``--smoke`` runs tiny sizes on the CPU to check the script itself.

What is measured, in bf16 on one GPU, for each (tokens, moe_hidden) with d_model 2048, 16 experts, top-2:

* ``moe``: forward + backward of the whole MoDE layer in training mode (router, top-k, balancing losses,
  permutation to expert order, the three grouped GEMMs with SwiGLU, un-permutation and gate-weighted sum).
* ``experts``: forward + backward of ``GroupedExperts`` alone on input already in expert order, with the
  same per-expert counts: the grouped GEMMs and SwiGLU. ``moe - experts`` is router + permutation.
* ``dense``: forward + backward of a SwiGLU FFN of hidden ``top_k x moe_hidden``: the same active
  parameters (``3 x d_model x top_k x moe_hidden``) and GEMM FLOPs per token.

FLOPs counted for every row: ``6 x active expert parameters x tokens`` = 6 x (3 x d x k x H) x T (2 for the
forward, 4 for the backward's input and weight gradients); the router's GEMM (d x E per token, under 1% here)
and elementwise work are not counted. TFLOP/s = those FLOPs / median time; ``ratio`` = dense time / MoE
time = MoE TFLOP/s / dense TFLOP/s. Inputs require grad (as inside a network), the output gradient is random,
router weights are drawn like the model's init (std 0.02, so logits of std ~0.9 on unit-variance inputs:
an uneven, realistic routing; the table gives its max/mean expert load).

Before timing, correctness checks on the GPU: ``grouped_mm`` (``torch._grouped_mm``, int32 offsets) against
per-group float32 matmuls, with empty groups at the start, middle and end and a group count that is no
multiple of 16, forward and both gradients (an empty group's weight gradient must be exactly zero); a rank
that receives no rows at all; and the bf16 MoDE layer against the float64 CPU layer, eager and compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]  # the package from a checkout; steady.py

from steady import median_ms  # noqa: E402

from torchtitan_ext.models.args import ModelArgs  # noqa: E402
from torchtitan_ext.models.ffn import FeedForward  # noqa: E402
from torchtitan_ext.models.mode import MoDE, grouped_mm  # noqa: E402


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def bench(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after warm-up (benchmarks/steady.py)."""
    return median_ms(fn, iters=iters, device=device.type)


def make_args(dim: int, experts: int, top_k: int, hidden: int) -> ModelArgs:
    return ModelArgs(vocab_size=8, dim=dim, n_heads=max(1, dim // 128), n_experts=experts, top_k=top_k,
                     moe_hidden=hidden)


def init_layer(layer: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            std = 0.02 if "router" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)


# ----------------------------------------------------------------------------------------------------------
# Correctness


def check_grouped_mm(device: torch.device) -> dict:
    """torch._grouped_mm (through ``grouped_mm``) against float32 per-group matmuls."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    counts_cases = {
        "uneven_with_empty_groups": [0, 37, 0, 300, 5, 0, 129, 1, 77, 0, 250, 3, 0, 64, 17, 0],
        "single_group": [0] * 7 + [513] + [0] * 8,
        "all_empty": [0] * 16,
    }
    for name, counts in counts_cases.items():
        rows, dim, hidden, groups = sum(counts), 256, 192, len(counts)
        x = torch.randn(rows, dim, generator=gen).to(device, torch.bfloat16).requires_grad_()
        w = (torch.randn(groups, hidden, dim, generator=gen) * dim ** -0.5).to(device, torch.bfloat16)
        w.requires_grad_()
        ends = torch.tensor(counts, device=device).cumsum(0)
        g = torch.randn(rows, hidden, generator=gen).to(device, torch.bfloat16)
        try:
            y = grouped_mm(x, w, ends)
            y.backward(g)
        except Exception as e:
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        start, refs = 0, []
        for gi, c in enumerate(counts):
            refs.append(xr[start:start + c] @ wr[gi].t())
            start += c
        ref = torch.cat(refs)
        ref.backward(g.float())
        empty = [gi for gi, c in enumerate(counts) if c == 0]
        res = {
            "fwd_rel_err": rel_err(y, ref) if rows else 0.0,
            "dx_rel_err": rel_err(x.grad, xr.grad) if rows else 0.0,
            "dw_rel_err": rel_err(w.grad, wr.grad) if rows else 0.0,
            "empty_group_dw_zero": bool(torch.all(w.grad[empty] == 0).item()) if empty else True,
            "dw_finite": bool(torch.isfinite(w.grad).all().item()),
        }
        res["ok"] = (max(res["fwd_rel_err"], res["dx_rel_err"], res["dw_rel_err"]) < 1e-2
                     and res["empty_group_dw_zero"] and res["dw_finite"])
        out[name] = res
    return out


def check_layer(device: torch.device, try_compile: bool) -> dict:
    """The bf16 MoDE layer (eager and compiled) against the float64 CPU layer, output and gradients.

    Tokens whose k-th and (k+1)-th router logits lie within 0.1 of each other are left out of the input:
    bf16 rounding may route those differently, which is not an error but moves whole rows."""
    dim, experts, top_k = 256, 8, 2
    args = dataclasses.replace(make_args(dim, experts, top_k, 192), aux_loss_coef=0.01, router_z_loss_coef=0.001)
    ref_layer = MoDE(args).double()
    init_layer(ref_layer, seed=2)
    with torch.no_grad():
        ref_layer.router.weight.mul_(5.0)  # logits of std ~1.6: clear choices for most tokens
    ref_layer.train()
    gen = torch.Generator().manual_seed(3)
    cand = torch.randn(4000, dim, generator=gen, dtype=torch.float64)
    top = (cand @ ref_layer.router.weight.t()).topk(top_k + 1, dim=-1).values
    x = cand[top[:, top_k - 1] - top[:, top_k] > 0.1][:1200].reshape(4, 300, dim)
    g = torch.randn(4, 300, dim, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref_out = ref_layer(xr)
    ref_out.backward(g)

    results = {}
    variants = [("eager", False)] + ([("compiled", True)] if try_compile else [])
    for name, comp in variants:
        layer = MoDE(args).to(device, torch.bfloat16)
        layer.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref_layer.state_dict().items()})
        layer.train()
        fn = torch.compile(layer, fullgraph=True) if comp else layer
        xb = x.to(device, torch.bfloat16).requires_grad_()
        try:
            out = fn(xb)
            out.backward(g.to(device, torch.bfloat16))
        except Exception as e:
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        res = {"out_rel_err": rel_err(out.cpu(), ref_out.detach()), "dx_rel_err": rel_err(xb.grad.cpu(), xr.grad),
               "same_load": bool(torch.equal(layer.load.cpu(), ref_layer.load)),
               **{f"d{w}_rel_err": rel_err(getattr(layer.experts, w).grad.cpu(), getattr(ref_layer.experts, w).grad)
                  for w in ("w1", "w2", "w3")},
               "router_grad_rel_err": rel_err(layer.router.weight.grad.cpu(), ref_layer.router.weight.grad)}
        worst = max(v for k, v in res.items() if k.endswith("rel_err"))
        res["ok"] = res["same_load"] and worst < 3e-2
        results[name] = res
    return results


# ----------------------------------------------------------------------------------------------------------
# Timing


def time_config(device: torch.device, dtype: torch.dtype, dim: int, experts: int, top_k: int, hidden: int,
                tokens: int, do_compile: bool, iters: int) -> dict:
    args = make_args(dim, experts, top_k, hidden)
    moe = MoDE(args)
    init_layer(moe, seed=0)
    moe = moe.to(device, dtype).train()
    dense = FeedForward(dim, top_k * hidden)
    init_layer(dense, seed=1)
    dense = dense.to(device, dtype).train()

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, dim, generator=gen).to(device, dtype).requires_grad_()
    g = torch.randn(tokens, dim, generator=gen).to(device, dtype)

    with torch.no_grad():
        idx = moe.route(x)[0].flatten()
        counts = torch.bincount(idx, minlength=experts)
    xs = torch.randn(tokens * top_k, dim, generator=gen).to(device, dtype).requires_grad_()
    gs = torch.randn(tokens * top_k, dim, generator=gen).to(device, dtype)

    def fwd_bwd(module, inp, grad, *extra):
        def run():
            for p in module.parameters():
                p.grad = None
            inp.grad = None
            module(inp, *extra).backward(grad)
        return run

    flops = 6 * 3 * dim * top_k * hidden * tokens
    row = {"dim": dim, "experts": experts, "top_k": top_k, "moe_hidden": hidden, "tokens": tokens,
           "gemm_flops": flops, "imbalance": (counts.max() / counts.float().mean()).item(),
           "empty_experts": int((counts == 0).sum())}
    row["moe_ms"] = bench(fwd_bwd(moe, x, g), device, iters)
    row["experts_ms"] = bench(fwd_bwd(moe.experts, xs, gs, counts), device, iters)
    row["dense_ms"] = bench(fwd_bwd(dense, x, g), device, iters)
    with torch.no_grad():
        row["moe_fwd_ms"] = bench(lambda: moe(x), device, iters)
        row["dense_fwd_ms"] = bench(lambda: dense(x), device, iters)
    if do_compile:
        for name, module in (("moe", moe), ("dense", dense)):
            try:
                compiled = torch.compile(module, fullgraph=True, dynamic=False)
                t0 = time.perf_counter()
                compiled(x).backward(g)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                row[f"{name}_compile_s"] = round(time.perf_counter() - t0, 1)
                row[f"{name}_compiled_ms"] = bench(fwd_bwd(compiled, x, g), device, iters)
            except Exception as e:
                row[f"{name}_compiled_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    for key in [k for k in row if k.endswith("_ms") and "fwd" not in k]:
        row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    row["router_perm_ms"] = row["moe_ms"] - row["experts_ms"]
    row["ratio"] = row["dense_ms"] / row["moe_ms"]
    if "moe_compiled_ms" in row and "dense_compiled_ms" in row:
        row["ratio_compiled"] = row["dense_compiled_ms"] / row["moe_compiled_ms"]
    if "moe_compiled_ms" in row:
        row["ratio_compiled_vs_eager_dense"] = row["dense_ms"] / row["moe_compiled_ms"]
    if device.type == "cuda":
        torch.cuda.synchronize()
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return row


def print_table(rows: list[dict]) -> None:
    cols = [("tokens", "tokens", "{:d}"), ("moe_hidden", "H", "{:d}"), ("imbalance", "imbal", "{:.2f}"),
            ("moe_ms", "moe ms", "{:.3f}"), ("experts_ms", "exp ms", "{:.3f}"),
            ("router_perm_ms", "rt+perm", "{:.3f}"), ("dense_ms", "dense ms", "{:.3f}"),
            ("moe_tflops", "moe TF/s", "{:.0f}"), ("experts_tflops", "exp TF/s", "{:.0f}"),
            ("dense_tflops", "dns TF/s", "{:.0f}"), ("ratio", "ratio", "{:.0%}"),
            ("moe_compiled_tflops", "moeC TF/s", "{:.0f}"), ("dense_compiled_tflops", "dnsC TF/s", "{:.0f}"),
            ("ratio_compiled", "ratioC", "{:.0%}")]
    header = " ".join(f"{h:>9}" for _, h, _ in cols)
    print(header)
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            cells.append(f"{fmt.format(v) if v is not None else '-':>9}")
        print(" ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script runs")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--tokens", default="16384,32768")
    ap.add_argument("--moe-hidden", default="1408,2048")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--skip-checks", action="store_true")
    opts = ap.parse_args()

    if opts.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        dim, experts, top_k, tokens, hiddens = 64, 4, 2, [256], [32]
        do_compile, iters = False, 5  # CPU: the grouped GEMM loop breaks a full graph
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke for a CPU check of the script", file=sys.stderr)
            return 1
        device, dtype = torch.device("cuda"), torch.bfloat16
        dim, experts, top_k = opts.dim, opts.experts, opts.top_k
        tokens = [int(t) for t in opts.tokens.split(",")]
        hiddens = [int(h) for h in opts.moe_hidden.split(",")]
        do_compile, iters = not opts.no_compile, 50

    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
                    "flops_counted": "6 x (3 x dim x top_k x moe_hidden) x tokens: expert GEMMs fwd+bwd; "
                                     "router GEMM and elementwise ops not counted"}
    all_ok = True
    if not opts.skip_checks and device.type == "cuda":
        report["check_grouped_mm"] = check_grouped_mm(device)
        report["check_layer"] = check_layer(device, try_compile=do_compile)
        for section in ("check_grouped_mm", "check_layer"):
            for name, res in report[section].items():
                print(f"{section} {name}: {json.dumps(res)}", flush=True)
                all_ok &= bool(res.get("ok"))
    elif opts.smoke:
        report["check_layer"] = check_layer(device, try_compile=False)
        print(f"check_layer: {json.dumps(report['check_layer'])}", flush=True)
        all_ok &= all(r["ok"] for r in report["check_layer"].values())

    rows = []
    for hidden in hiddens:
        for t in tokens:
            try:
                row = time_config(device, dtype, dim, experts, top_k, hidden, t, do_compile, iters)
            except Exception:
                traceback.print_exc()
                row = {"tokens": t, "moe_hidden": hidden, "error": traceback.format_exc(limit=1)[-300:]}
                all_ok = False
            rows.append(row)
            print(json.dumps(row), flush=True)
    report["rows"] = rows
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=1))
    print(f"\nMoDE vs dense SwiGLU, {report['device']}, {report['dtype']}, d_model {dim}, {experts} experts, "
          f"top-{top_k}; TF/s on active expert GEMM FLOPs (fwd+bwd); ratio = MoE / dense; C = compiled")
    print_table(rows)
    if not all_ok:
        print("SOME CHECKS FAILED (see above)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
