"""AdamW's step alone on one GPU: torch's fused kernel against ``TritonAdamW`` (``train/triton_adamw.py``)
over the parameters of a bench model, with the trainer's device-side clip factor and skip flag.
``python benchmarks/micro/adamw.py [--experts 16] [--layers 8] [--steps 20]``

The default model is one EP 4 rank of benchmarks/scenarios.toml's ``mode_ep4`` (d 2048, 8 layers, 16 of
the 64 experts, vocabulary 32000): every parameter float32 with a float32 gradient, as FSDP leaves them.
Prints one JSON line per variant: ms per step (CUDA events over --steps steps after 3 warm-up steps), bytes
moved at 28 per parameter and the bandwidth that makes, and the largest difference from torch's first update
(same parameters and gradients) over the first COMPARED tensors.
The ``blockN`` variants run the kernel alone over the parameters at other block sizes. Speed claims for
training go through ``python -m torchtitan_ext.train``; this isolates the optimizer's share of them.
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

from torchtitan_ext.cli import positive_whole  # noqa: E402
from torchtitan_ext.models.args import ModelArgs  # noqa: E402
from torchtitan_ext.models.decoder import Decoder  # noqa: E402
from torchtitan_ext.train.triton_adamw import TritonAdamW, adamw_update_  # noqa: E402

COMPARED = 12  # tensors whose first update is compared with torch's (the embedding and the first blocks)


def parameters(opts: argparse.Namespace) -> list[torch.nn.Parameter]:
    args = ModelArgs(dim=2048, n_heads=16, n_kv_heads=8, n_layers=opts.layers, n_experts=opts.experts, top_k=2,
                     moe_hidden=1408, vocab_size=32000, max_seq_len=2048)
    with torch.device("meta"):
        shapes = [p.shape for p in Decoder(args).parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen) * 0.02) for shape in shapes]


def fill_grads(params: list[torch.nn.Parameter]) -> None:
    """The same gradients every time: torch's fused kernel divides them by the clip factor in place."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=positive_whole, default=16, help="MoDE experts per layer (default 16)")
    parser.add_argument("--layers", type=positive_whole, default=8, help="blocks (default 8)")
    parser.add_argument("--steps", type=positive_whole, default=20, help="timed steps per variant (default 20)")
    opts = parser.parse_args()
    if opts.experts < 2:
        parser.error(f"argument --experts: expected at least 2 (top-2 routing), got {opts.experts}")
    if not torch.cuda.is_available():
        sys.exit("error: benchmarks/micro/adamw.py needs a CUDA GPU (it times GPU kernels)")
    params = parameters(opts)
    numel = sum(p.numel() for p in params)
    scale, skip = torch.tensor(1.5, device="cuda"), torch.zeros((), device="cuda")
    compared = params[:COMPARED]
    start = [p.detach().clone() for p in compared]
    updates: dict[str, list[torch.Tensor]] = {}
    for name, cls in (("torch_fused", torch.optim.AdamW), ("triton", TritonAdamW)):
        with torch.no_grad():
            for p, p0 in zip(compared, start, strict=True):
                p.copy_(p0)
        fill_grads(params)
        state = []  # the previous variant's moments go before this one's are made
        groups = [{"params": params, "weight_decay": 0.1}]
        opt = cls(groups, lr=1e-4, betas=(0.9, 0.95), **({"fused": True} if cls is torch.optim.AdamW else {}))
        opt.grad_scale, opt.found_inf = scale, skip
        opt.step()
        updates[name] = [p.detach() - p0 for p, p0 in zip(compared, start, strict=True)]
        ms = median_ms(opt.step, iters=1, calls=opts.steps)
        diff = max(((a - b).abs().max() / b.abs().max()).item()
                   for a, b in zip(updates[name], updates["torch_fused"], strict=True))
        print(json.dumps({"variant": name, "params": numel, "tensors": len(params), "ms": round(ms, 3),
                          "gb": round(28 * numel / 1e9, 2), "tb_per_s": round(28 * numel / ms / 1e9, 2),
                          "first_step_max_rel_diff_vs_torch": diff}), flush=True)
        state = [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"]) for p in params]
        del opt
    for block in (1024, 2048, 4096, 8192):
        def kernel_only(block=block):
            for p, (m, v, step) in zip(params, state, strict=True):
                adamw_update_(p.data, p.grad, m, v, step, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, grad_scale=scale, found_inf=skip, block=block)
        ms = median_ms(kernel_only, iters=1, calls=opts.steps)
        print(json.dumps({"variant": f"block{block}", "ms": round(ms, 3),
                          "tb_per_s": round(28 * numel / ms / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
