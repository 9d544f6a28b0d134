"""Time the trainer's step and list its top GPU kernels: ``python benchmarks/profile_step.py NAME [trainer args]``.

Builds the real Trainer from the same arguments as ``python -m torchtitan_ext.train``, runs
``training.steps`` steps (the first 5 are warm-up/compilation and not timed), then profiles 2 more steps
with torch.profiler. Prints one JSON line (tokens/s, peak memory, per-step losses) and the 15 kernels with
the most GPU time; both go to stdout for benchmarks/bench_vs_plain.sh to record. ``SYNC_DEBUG=1``: also
warn (stderr) at every operation that makes the host wait for the GPU while a timed step is being queued.
``TRACE_GAPS=1``: then trace 2 more steps with host activity and Python stacks and print where the GPU sat
idle (benchmarks/trace_gaps.py). ``TOP_KERNELS=N``: list N kernels instead of 15.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from torchtitan_ext.cli import setup_logging
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.train.trainer import Trainer

WARMUP = 5


def main() -> None:
    name, argv = sys.argv[1], sys.argv[2:]
    setup_logging()
    trainer = Trainer(parse_args(argv))
    t = trainer.cfg.training
    tokens = trainer.global_batch_size * t.seq_len
    losses = []
    unread = []

    sync_debug = {"on": False}

    def step() -> None:  # as the trainer's loop: each step's loss is read after the next one is queued
        trainer.step += 1
        torch.cuda.set_sync_debug_mode("warn" if sync_debug["on"] else 0)
        unread.append(trainer.queue_step())
        torch.cuda.set_sync_debug_mode(0)
        if len(unread) > 1:
            losses.append(round(trainer.settle(unread.pop(0))[0], 4))

    def read_all() -> None:
        while unread:
            losses.append(round(trainer.settle(unread.pop(0))[0], 4))

    for _ in range(WARMUP):
        step()
    read_all()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if os.environ.get("SYNC_DEBUG") == "1":
        warnings.simplefilter("always")
        sync_debug["on"] = True
    start = time.perf_counter()
    for _ in range(t.steps - WARMUP):
        step()
    read_all()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / (t.steps - WARMUP)
    peak = torch.cuda.max_memory_allocated() / 2**30
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        read_all()
        torch.cuda.synchronize()
    print(json.dumps({"run": name, "tokens_per_sec": round(tokens / per_step), "step_ms": round(per_step * 1e3, 1),
                      "peak_memory_gib": round(peak, 2), "losses": losses}), flush=True)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    print(f"top kernels of {name} (2 steps, GPU time {total / 2e3:.1f} ms per step):")
    for e in events[:int(os.environ.get("TOP_KERNELS", "15"))]:
        print(f"  {e.device_time_total / 2e3:8.2f} ms/step {100 * e.device_time_total / total:5.1f}%  "
              f"x{e.count // 2:<5d} {e.key[:90]}")
    sys.stdout.flush()
    if os.environ.get("TRACE_GAPS") == "1":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from trace_gaps import main as report_gaps

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(2):
                step()
            read_all()
            torch.cuda.synchronize()
        trace = f"/tmp/{name}_trace.json"
        prof.export_chrome_trace(trace)
        sys.argv = ["trace_gaps.py", trace]
        report_gaps()


if __name__ == "__main__":
    main()
