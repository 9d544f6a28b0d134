"""Steady-state figures of a training run, one rule for every trainer the benchmarks run.

A run logs *windows*: the steps since its previous log line, their wall time and the tokens they processed.
The warm-up rule: a window counts as steady when it starts after the first ``warmup`` steps (compilation,
autotuning and the allocator's growth happen there). Throughput is the median over the steady windows, each
window one sample. The first step's time is the first window's less its other steps at the steady step time
(exact when the first window is one step long).

Readers turn each trainer's output into windows: :func:`ours` (metrics.jsonl of ``torchtitan_ext.train``; its
rows: :func:`windows`),
:func:`torchtitan` (torchtitan 0.2.0's console log). :func:`median_ms` times a callable for the
microbenchmarks (benchmarks/micro/).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Window:
    """The steps ``end_step - steps + 1 .. end_step``: ``seconds`` of wall time, ``tokens`` processed per
    device, and what the trainer logged at ``end_step`` (``values``: loss, mfu, memory)."""

    end_step: int
    steps: int
    seconds: float
    tokens: float
    values: dict[str, float] = field(default_factory=dict)

    @property
    def first_step(self) -> int:
        return self.end_step - self.steps + 1


# logged figures whose median over the steady windows is kept: MFU, gradient bytes a rank sends per step
MEDIANS = ("mfu", "comm/bytes_sent", "comm/bytes_uncompressed")
TAIL_STEPS = 50  # tail_loss: the mean of the losses logged at steps last - TAIL_STEPS .. last


class NoSteadyWindows(ValueError):
    """The run logged no window after its warm-up steps."""


def figures(windows: Sequence[Window], warmup: int) -> dict[str, float]:
    """``tokens_per_sec_per_device`` and ``step_s`` (medians over the steady windows), ``first_step_s``,
    the medians of MEDIANS where logged, ``peak_memory_gib`` / ``peak_reserved_gib`` (the largest logged),
    ``final_loss``, ``tail_loss`` (the mean loss logged at steps ``last - TAIL_STEPS .. last``: one logged
    loss is too noisy to compare two precisions by) and ``steps``, ``steady_windows``."""
    if not windows:
        raise NoSteadyWindows("the run logged no training step")
    steady = [w for w in windows if w.first_step > warmup]
    if not steady:
        raise NoSteadyWindows(f"no logged window starts after the {warmup} warm-up steps "
                              f"(the last ends at step {windows[-1].end_step})")
    step_s = statistics.median(w.seconds / w.steps for w in steady)
    first = windows[0]
    out = {"tokens_per_sec_per_device": statistics.median(w.tokens / w.seconds for w in steady),
           "step_s": step_s,
           "first_step_s": max(first.seconds - (first.steps - 1) * step_s, 0.0) if first.first_step == 1 else None,
           "steady_windows": len(steady), "steps": windows[-1].end_step}
    for key in MEDIANS:
        logged = [w.values[key] for w in steady if key in w.values]
        if logged:
            out[key] = statistics.median(logged)
    for key, name in (("memory_gib", "peak_memory_gib"), ("memory_reserved_gib", "peak_reserved_gib")):
        logged = [w.values[key] for w in windows if key in w.values]
        if logged:
            out[name] = max(logged)
    if "loss" in windows[-1].values:
        out["final_loss"] = windows[-1].values["loss"]
        tail = [w.values["loss"] for w in windows if w.end_step >= windows[-1].end_step - TAIL_STEPS
                and "loss" in w.values]
        out["tail_loss"] = statistics.fmean(tail)
    return {k: v for k, v in out.items() if v is not None}


def metrics_rows(metrics_jsonl: Path) -> list[dict]:
    """The rows of a ``torchtitan_ext.train`` run's metrics.jsonl; a line that is not a JSON object is a
    ValueError naming its number."""
    rows = []
    for number, line in enumerate(metrics_jsonl.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number} is not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number} is not a JSON object")
        rows.append(row)
    return rows


def ours(metrics_jsonl: Path, world_size: int = 1) -> list[Window]:
    """The training windows of a ``torchtitan_ext.train`` run of a fresh dump folder (:func:`windows`)."""
    return windows(metrics_rows(metrics_jsonl), world_size)


def validation(rows: list[dict]) -> dict[str, float]:
    """``val_loss`` of the last evaluation among metrics.jsonl's ``rows``, or nothing."""
    evaluated = [row["val_loss"] for row in rows if "val_loss" in row]
    return {"val_loss": evaluated[-1]} if evaluated else {}


def windows(rows: list[dict], world_size: int = 1) -> list[Window]:
    """The windows of metrics.jsonl's rows: each training row's ``tokens`` (cumulative, the whole job's) and
    ``tokens_per_sec`` give its window's tokens and seconds; rows without them (evaluations) are skipped."""
    out, step, tokens = [], 0, 0.0
    for row in (r for r in rows if "tokens_per_sec" in r and "tokens" in r):
        job_tokens = row["tokens"] - tokens
        if job_tokens > 0 and row["tokens_per_sec"] > 0:
            out.append(Window(row["step"], row["step"] - step, job_tokens / row["tokens_per_sec"],
                              job_tokens / world_size, _numbers(row)))
        step, tokens = row["step"], row["tokens"]
    return out


# rank 0's step line of torchtitan 0.2.0: "step: 10  loss: 7.1  grad_norm: 1.2  memory: 30.1GiB(22%)  tps: 9,001
# tflops: 400.2  mfu: 40.5%"
TORCHTITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*\S+\s+memory:\s*([\d.]+)GiB\([\d.]+%\)"
                             r"\s+tps:\s*([\d,]+)\s+tflops:\s*[\d,.]+\s+mfu:\s*([\d.]+)%")


def torchtitan(log_text: str, tokens_per_step: int) -> list[Window]:
    """The windows of a torchtitan 0.2.0 run from its console log (rank 0's lines): ``tps`` is tokens per
    second per device, ``tokens_per_step`` each device's tokens a step (local batch x sequence length over the
    tensor, pipeline and context parallel degrees)."""
    windows: list[Window] = []
    for line in log_text.splitlines():
        m = TORCHTITAN_STEP.search(line)
        if m is None or ("[rank" in line and "[rank0]" not in line):
            continue
        step, tps = int(m[1]), float(m[4].replace(",", ""))
        previous = windows[-1].end_step if windows else 0
        if step <= previous or tps <= 0:
            continue
        tokens = (step - previous) * tokens_per_step
        windows.append(Window(step, step - previous, tokens / tps, tokens,
                              {"loss": float(m[2]), "memory_reserved_gib": float(m[3]), "mfu": float(m[5]) / 100}))
    return windows


def _numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, int | float) and math.isfinite(v)}


def median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3, calls: int = 1,
              device: str = "cuda") -> float:
    """Median milliseconds of one call of ``fn`` over ``iters`` samples of ``calls`` back-to-back calls each,
    after ``warmup`` untimed calls: CUDA events around each sample on ``device`` "cuda", the host clock on any
    other."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            began = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - began) * 1e3 / calls)
    return statistics.median(times)
