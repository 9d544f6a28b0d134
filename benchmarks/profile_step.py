"""Time the trainer's step and list its top GPU kernels: ``python benchmarks/profile_step.py NAME [trainer args]``.

Builds the real Trainer from the same arguments as ``python -m torchtitan_ext.train``, runs
``training.steps`` steps (the first 5 are warm-up/compilation and not timed), then profiles 2 more steps
with torch.profiler. Prints one JSON line (tokens/s, peak memory, per-step losses) and the 15 kernels with
the most GPU time; both go to stdout for benchmarks/bench_vs_plain.sh to record.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.train.trainer import Trainer

WARMUP = 5


def main() -> None:
    name, argv = sys.argv[1], sys.argv[2:]
    trainer = Trainer(parse_args(argv))
    t = trainer.cfg.training
    tokens = trainer.global_batch_size * t.seq_len
    losses = []

    def step() -> None:
        trainer.step += 1
        losses.append(round(trainer.train_step()[0], 4))

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(t.steps - WARMUP):
        step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / (t.steps - WARMUP)
    peak = torch.cuda.max_memory_allocated() / 2**30
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(json.dumps({"run": name, "tokens_per_sec": round(tokens / per_step), "step_ms": round(per_step * 1e3, 1),
                      "peak_memory_gib": round(peak, 2), "losses": losses}), flush=True)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    print(f"top kernels of {name} (2 steps, GPU time {total / 2e3:.1f} ms per step):")
    for e in events[:15]:
        print(f"  {e.device_time_total / 2e3:8.2f} ms/step {100 * e.device_time_total / total:5.1f}%  "
              f"x{e.count // 2:<5d} {e.key[:90]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
