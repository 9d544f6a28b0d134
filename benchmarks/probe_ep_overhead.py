"""What expert parallelism's machinery costs on one GPU, with no peer to talk to:
``python benchmarks/probe_ep_overhead.py [--variants in_graph,eager,ep1] [--steps N] [--profile]``
(``--device cpu --eager --dim 64 --layers 2 --seq 32 --batch 2``: a smoke run with gloo).

Three builds of the same MoDE model (``bench_mode_scale.sh``'s shape by default: d 2048, 8 layers, 64
experts top-2, hidden 1408, 8 x 2048 tokens, bf16 autocast, compiled), timed step by step with CUDA events:
- ``in_graph``: each block one compiled graph, experts inside (the trainer's EP 1 on GPU);
- ``eager``: the experts eager between compiled graphs (``apply_compile(experts_in_graph=False)``, the
  structure every EP run has), no expert parallelism;
- ``ep1``: ``apply_ep`` over a one-rank NCCL group on top of ``eager``: the count exchange, the host read of
  the splits, the row all-to-alls (to itself), the re-sorting gathers, DTensor weights.
``eager - in_graph`` is what the graph break costs, ``ep1 - eager`` what the dispatch machinery costs beyond
the network; at EP 4 both are paid on every rank besides the all-to-all time. Not the trainer's loop (no
data loader, no metrics, plain cross-entropy): speed claims go through ``python -m torchtitan_ext.train``.
``--profile``: the 20 kernels with the most GPU time per variant, and the GPU's busy time over the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.parallel.compile import apply_compile
from torchtitan_ext.parallel.ep import apply_ep
from torchtitan_ext.parallel.init import materialize_and_init

SHAPE = dict(dim=2048, n_heads=16, n_kv_heads=8, n_layers=8, n_experts=64, top_k=2, moe_hidden=1408,
             vocab_size=32000, max_seq_len=2048, aux_loss_coef=0.01, router_z_loss_coef=0.001)


def build(variant: str, args: ModelArgs, mesh, device: torch.device, compiled: bool) -> Decoder:
    with torch.device("meta"):
        model = Decoder(args)
    plan = model.init_plan()  # by the plain model's names
    if variant == "ep1":
        apply_ep(model, mesh, data_parallel_share=1)
    if compiled:
        apply_compile(model, experts_in_graph=variant == "in_graph", tensor_parallel=False)
    materialize_and_init(model, device, seed=0, plan=plan)
    model.init_buffers(device)
    return model


def gpu_busy_ms(prof) -> tuple[float, float, list[tuple[str, float]]]:
    """(GPU span, GPU busy time: the union of kernel intervals, top kernels by total time), in ms."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    totals: dict[str, float] = {}
    for e in kernels:
        totals[e.name] = totals.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:20]
    return (spans[-1][1] - spans[0][0]) / 1e3, busy / 1e3, [(n[:90], t / 1e3) for n, t in top]


def run(variant: str, args: ModelArgs, mesh, opts: argparse.Namespace) -> dict:
    device, batch, seq, steps = torch.device(opts.device), opts.batch, opts.seq, opts.steps
    torch.manual_seed(0)
    model = build(variant, args, mesh, device, compiled=not opts.eager)
    # fused AdamW takes DTensors (ep1's experts) or plain tensors, not both in one call
    params = list(model.parameters())
    optimizers = [torch.optim.AdamW(group, lr=1e-4, fused=device.type == "cuda") for group in
             ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
             if group]
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (steps + 3, batch, seq + 1), device=device, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(i: int) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[i, :, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[i, :, 1:].flatten())
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(3):  # compile and warm up
        step(i)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    losses = [step(3 + i) for i in range(steps - 3)]
    sync()
    ms = (time.perf_counter() - begin) * 1e3 / (steps - 3)
    out = {"variant": variant, "step_ms": round(ms, 2), "tokens_per_s": round(batch * seq / ms * 1e3),
           "losses": [round(x.item(), 4) for x in losses]}
    if device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if opts.trace_dir and device.type == "cuda":  # where the GPU waits for the host: benchmarks/trace_gaps.py
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=True) as prof:
            for i in range(2):
                step(i)
            sync()
        prof.export_chrome_trace(os.path.join(opts.trace_dir, f"{variant}.json"))
    if opts.profile and device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for i in range(2):
                step(i)
            sync()
        span, busy, top = gpu_busy_ms(prof)
        out.update(profile_span_ms=round(span / 2, 2), profile_busy_ms=round(busy / 2, 2),
                   top_kernels_ms_per_step=[(n, round(t / 2, 3)) for n, t in top])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="in_graph,eager,ep1")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=SHAPE["n_layers"])
    parser.add_argument("--dim", type=int, default=SHAPE["dim"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (gloo)")
    parser.add_argument("--trace-dir", default="", help="save a Chrome trace with Python stacks per variant here")
    parser.add_argument("--out", default="", help="also append each variant's JSON line to this file")
    parser.add_argument("--eager", action="store_true", help="nothing compiled (then in_graph = eager)")
    opts = parser.parse_args()
    variants = opts.variants.split(",")
    unknown = set(variants) - {"in_graph", "eager", "ep1"}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; expected in_graph, eager, ep1")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (--device cpu --eager runs a smoke test)")
    if opts.steps < 5:
        parser.error(f"--steps {opts.steps}: expected at least 5 (3 are warm-up)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if opts.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(opts.device, (1,), mesh_dim_names=("ep",))
    heads = max(opts.dim // 128, 2)
    args = dataclasses.replace(ModelArgs(), **{**SHAPE, "n_layers": opts.layers, "max_seq_len": opts.seq,
                                               "dim": opts.dim, "n_heads": heads, "n_kv_heads": heads // 2})
    for v in variants:
        line = json.dumps(run(v, args, mesh, opts))
        print(line, flush=True)
        if opts.out:
            with open(opts.out, "a") as f:
                f.write(line + "\n")
        gc.collect()  # the last variant's model and optimizer states
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
