"""Attention paths on one GPU: correctness of FlexAttention (masks, LSE gradient) against the dense path,
then forward+backward tokens/s of the compiled 1b shape with causal SDPA, FlexAttention with a causal mask,
and document masking (mean document length 512).

    python benchmarks/micro/attention.py check            # FlexAttention compiles and matches (seconds)
    python benchmarks/micro/attention.py speed SEQ LAYERS # tokens/s and peak memory per attention mode
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

from torchtitan_ext.models.args import ComputeOptions
from torchtitan_ext.models.decoder import PLAIN, Decoder
from torchtitan_ext.models.flavors import get_flavor
from torchtitan_ext.ops.attention import attention, build_mask
from torchtitan_ext.ops.visibility import causal_visibility, document_visibility, tree_visibility


def build(args, dev: torch.device, dtype: torch.dtype, options: ComputeOptions = PLAIN) -> Decoder:
    """The model on ``dev`` with random weights (norms one), built on the meta device as the trainer does."""
    with torch.device("meta"):
        model = Decoder(args, options)
    model.to_empty(device=dev)
    model.init_buffers(dev)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0.0, 0.02)
    return model.to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, h, hk, t, d = 2, 8, 2, 1024, 64
    start, limit = tree_visibility([-1, 0, 1, 0, -1, 4], [100, 200, 124, 300, 200, 100])
    start, limit = start.expand(b, t).to(dev).contiguous(), limit.expand(b, t).to(dev).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(b, n, t, d, device=dev, dtype=dtype, requires_grad=True) for n in (h, hk, hk))
        flex_out, flex_lse = attention(q, k, v, build_mask(start, limit), need_lse=True)
        (flex_out.float().square().sum() + flex_lse.float().square().sum()).backward()
        g_flex = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        mask = (start[:, None, :] <= torch.arange(t, device=dev)[None, :, None]) & \
            (torch.arange(t, device=dev)[None, :, None] < limit[:, None, :])
        qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref_out, ref_lse = attention(qd, kd, vd, mask, need_lse=True)
        (ref_out.square().sum() + ref_lse.square().sum()).backward()
        print(f"check {dtype}: out {rel(flex_out, ref_out):.2e} lse {rel(flex_lse, ref_lse):.2e} "
              + " ".join(f"d{n} {rel(g, r.grad):.2e}" for n, g, r in zip("qkv", g_flex, (qd, kd, vd), strict=True)))
    # A compiled block with a BlockMask argument and Z-reg on.
    args = dataclasses.replace(get_flavor("debug"), vocab_size=256, max_seq_len=t)
    model = build(args, dev, torch.float32, ComputeOptions(attention_z_reg=1e-2))
    model.set_loss_scales(aux=1.0, virtual=1.0)
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
    tokens = torch.randint(0, 256, (b, t), device=dev)
    vis = tuple(x.to(dev) for x in document_visibility([300, 400, 324]))
    vis = (vis[0].expand(b, t).contiguous(), vis[1].expand(b, t).contiguous())
    loss = F.cross_entropy(model(tokens, visibility=vis).flatten(0, 1), tokens.flatten())
    loss.backward()
    print(f"check compiled model with document mask + Z-reg: loss {loss.item():.4f}, "
          f"grad norm {torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item():.4f}")


def doc_lengths(total: int, mean: int, gen: torch.Generator) -> list[int]:
    out = []
    while sum(out) < total:
        out.append(max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=gen).item())))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def speed(seq: int, layers: int, batch: int, steps: int = 12) -> None:
    dev = torch.device("cuda")
    args = dataclasses.replace(get_flavor("1b"), max_seq_len=max(seq, 4096), n_layers=layers)
    torch.manual_seed(0)
    model = build(args, dev, torch.bfloat16)
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), device=dev)
    pairs = [document_visibility(doc_lengths(seq, 512, gen)) for _ in range(batch)]
    docs = (torch.cat([s for s, _ in pairs]).to(dev), torch.cat([lim for _, lim in pairs]).to(dev))
    modes = {"causal SDPA": None, "flex causal": causal_visibility(batch, seq, dev),
             "flex documents (mean 512)": docs}
    print(f"seq {seq}, {layers} layers of the 1b shape, batch {batch}, bf16, compiled blocks")
    for name, vis in modes.items():
        if vis is not None:
            vis = (vis[0].contiguous(), vis[1].contiguous())
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            logits = model(tokens, visibility=vis)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        tps = batch * seq * (steps - 3) / (time.perf_counter() - t0)
        print(f"  {name:28s} {tps:12,.0f} tokens/s  peak {torch.cuda.max_memory_allocated() / 2**30:6.1f} GiB")


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check()
    else:
        speed(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 4)
