"""Peak live memory of a pipeline step on CPU, per rank and step: zero-bubble against Interleaved1F1B, full
activation checkpointing or none, with our pipeline stage (``parallel/pp.py Stage``: the weight-gradient pass
under one ``GraphExecGroup``) or torch's own ``PipelineStage``.

Live bytes are glibc's allocated heap (``mallinfo2``), sampled after every aten op by a dispatch mode; the
model is our Decoder (float32) cut into 2 x PP stages. A CPU stand-in for what the GPUs showed: ``llama3_8b``
PP 2 x FSDP 2 with ZBV ran out of a 141 GB card in step 2 in both our trainer and torchtitan.

Usage (repository root):
  python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/probe_zero_bubble_memory.py \\
      --schedule ZBVZeroBubble --ac full [--torch-stage] [--steps 3] [--layers 8] [--dim 256] [--seq 1024]
Prints one line per rank and step: the peak over the step (schedule and optimizer) in MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtitan_ext.models.args import ModelArgs  # noqa: E402
from torchtitan_ext.models.decoder import Decoder, fill_param_  # noqa: E402
from torchtitan_ext.parallel import pp  # noqa: E402
from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from torchtitan_ext.train.losses import cross_entropy_loss  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def live_bytes() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakMeter(TorchDispatchMode):
    """The largest ``live_bytes`` seen after any aten op while active."""

    def __init__(self):
        super().__init__()
        self.peak = live_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, live_bytes())
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="ZBVZeroBubble", choices=["ZBVZeroBubble", "InterleavedZeroBubble",
                                                                      "Interleaved1F1B"])
    ap.add_argument("--ac", default="full", choices=["full", "none"])
    ap.add_argument("--torch-stage", action="store_true", help="torch's PipelineStage instead of ours")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    args = ModelArgs(vocab_size=512, dim=a.dim, n_layers=a.layers, n_heads=4, n_kv_heads=4, ffn_hidden=4 * a.dim,
                     max_seq_len=a.seq, tie_embeddings=False)
    model = Decoder(args)
    for name, p in model.named_parameters():
        kind, std = model.init_plan()[name]
        fill_param_(name, p.data, kind, std, 0)
    model.init_buffers(torch.device("cpu"))
    if a.ac == "full":
        apply_activation_checkpointing(model, "full", 0)
    stages = pp.split_stages(model, rank, world, 2, a.schedule, [])
    if a.torch_stage:
        pp.Stage = pp.PipelineStage  # the stage build_schedule builds
    pipe = pp.build_schedule(stages, 2 * world, torch.device("cpu"), dist.group.WORLD, a.schedule, a.microbatches,
                             cross_entropy_loss)
    params = [p for _, stage in stages for p in stage.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, args.vocab_size, (a.microbatches, a.seq + 1), generator=torch.Generator().manual_seed(0))
    sids = [sid for sid, _ in stages]
    last = 2 * world - 1 in sids
    for step in range(1, a.steps + 1):
        start = live_bytes()
        with PeakMeter() as meter:
            pipe.step(*((tokens[:, :-1],) if 0 in sids else ()), target=tokens[:, 1:] if last else None,
                      losses=[] if last else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        for r in range(world):
            dist.barrier()
            if r == rank:
                stage = "torch stage" if a.torch_stage else "our stage"
                print(f"{a.schedule} ac={a.ac} {stage} rank {rank} step {step}: peak {meter.peak / 2**20:.1f} MiB "
                      f"(step start {start / 2**20:.1f} MiB)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
