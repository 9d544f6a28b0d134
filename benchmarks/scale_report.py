"""Reports for benchmarks/bench_mode_scale.sh, one JSON line each.

  python benchmarks/scale_report.py ours RUN_FOLDER [--wall S]   our trainer's run (metrics.jsonl + RUN_FOLDER.log)
  python benchmarks/scale_report.py tt NAME LOG [--wall S]        a torchtitan 0.2.0 run, from its console log
  python benchmarks/scale_report.py profile TRACE_DIR OUT_PREFIX   per-kernel table of a [profiling] trace
                                                                   (writes OUT_PREFIX.json and OUT_PREFIX.txt)
  python benchmarks/scale_report.py resume SAVED RESUMED           the losses of a run resumed from SAVED's checkpoint
                                                                   against SAVED's own, at the steps both logged

Throughput is the median over the logged windows ending after step 10 (our log every 5 steps: windows 15, 20, 25;
torchtitan logs step 1 as well, the same cut keeps its 15, 20, 25), per GPU. MFU: both trainers count
6 x (active non-embedding parameters incl. the output head and the router: top_k of n_experts experts) + 12 x
layers x heads x head_dim x seq per token against 989 TFLOP/s (H100/H200 dense bf16). Memory: ours max allocated
(peak_memory_gib) and max reserved (peak_reserved_gib) on rank 0, and max allocated over all ranks
(peak_memory_max_gib); torchtitan logs max reserved only.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
STEADY_AFTER = 10  # windows ending after this step count as steady


def _wall(argv: list[str]) -> dict:
    return {"wall_s": int(argv[argv.index("--wall") + 1])} if "--wall" in argv else {}


def _metrics(folder: Path) -> list[dict] | None:
    """The rows of a run folder's metrics.jsonl, or None when it has none (the run failed)."""
    try:
        return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return None


def ours(folder: Path, argv: list[str]) -> dict:
    out = {"run": folder.name, **_wall(argv)}
    log = folder.with_name(folder.name + ".log")
    text = log.read_text(errors="replace") if log.exists() else ""
    m = re.search(r"model \S+: ([\d,]+) parameters \(([\d,]+) active", text)
    if m:
        out["params"], out["active_params"] = (int(g.replace(",", "")) for g in m.groups())
    if (rows := _metrics(folder)) is None:
        out["error"] = "no metrics.jsonl (run failed)"
        return out
    train = [r for r in rows if "loss" in r and "tokens_per_sec" in r]
    if not train:
        out["error"] = "no training rows"
        return out
    steady = [r for r in train if r["step"] > STEADY_AFTER] or train
    out["steps"] = train[-1]["step"]
    out["windows"] = [r["step"] for r in steady]
    for key in ("tokens_per_sec_per_device", "tokens_per_sec", "mfu"):
        if key in steady[0]:
            out[key] = round(statistics.median(r[key] for r in steady), 4 if key == "mfu" else 0)
    if "memory_gib" in train[-1]:
        out["peak_memory_gib"] = round(max(r["memory_gib"] for r in train), 2)
        out["peak_reserved_gib"] = round(max(r.get("memory_reserved_gib", 0) for r in train), 2)
    if "memory_max_gib" in train[-1]:  # the largest over the ranks (trainers from 2026-11-28 on)
        out["peak_memory_max_gib"] = round(max(r["memory_max_gib"] for r in train), 2)
    out["first_loss"], out["last_loss"] = round(train[0]["loss"], 4), round(train[-1]["loss"], 4)
    last = train[-1]
    imb = [v for k, v in last.items() if k.startswith("moe/") and k.endswith("/imbalance")]
    if imb:  # max / mean routed tokens per expert at the last logged step, over layers
        out["imbalance_mean"] = round(statistics.mean(imb), 3)
        out["imbalance_max"] = round(max(imb), 3)
    for key in ("moe/aux_loss", "moe/router_z_loss"):
        if key in last:
            out[key] = round(last[key], 4)
    return out


TT_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+)\s+grad_norm:\s*\S+\s+memory:\s*([\d.]+)GiB\(([\d.]+)%\)"
                     r"\s+tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+)%")


def tt(name: str, log: Path, argv: list[str]) -> dict:
    out = {"run": name, "trainer": "torchtitan 0.2.0", **_wall(argv)}
    text = log.read_text(errors="replace") if log.exists() else ""
    m = re.search(r"Total parameter count: dense ([\d,]+), sparse ([\d,]+), active ([\d,]+)", text)
    if m:
        dense, sparse, active = (int(g.replace(",", "")) for g in m.groups())
        out["params"], out["active_params"] = dense + sparse, active
    rows = {}
    for line in text.splitlines():
        s = TT_STEP.search(line)
        if s:  # every rank may log; rank 0's line comes first per step in a torchrun log ("[rank0]:" prefix)
            if "[rank" in line and "[rank0]" not in line:
                continue
            step = int(s.group(1))
            rows.setdefault(step, dict(step=step, loss=float(s.group(2)), reserved=float(s.group(3)),
                                       tps=float(s.group(5).replace(",", "")),
                                       tflops=float(s.group(6).replace(",", "")), mfu=float(s.group(7)) / 100))
    if not rows:
        out["error"] = "no step lines in the log (run failed)"
        return out
    train = [rows[k] for k in sorted(rows)]
    steady = [r for r in train if r["step"] > STEADY_AFTER] or train
    out["steps"] = train[-1]["step"]
    out["windows"] = [r["step"] for r in steady]
    out["tokens_per_sec_per_device"] = round(statistics.median(r["tps"] for r in steady))
    out["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
    out["tflops_per_device"] = round(statistics.median(r["tflops"] for r in steady), 1)
    out["peak_reserved_gib"] = round(max(r["reserved"] for r in train), 2)
    out["first_loss"], out["last_loss"] = round(train[0]["loss"], 4), round(train[-1]["loss"], 4)
    return out


def _losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _metrics(folder) or [] if "loss" in r}


def resume(saved: Path, resumed: Path) -> dict:
    """The resumed run's losses against the saved run's at the steps both logged (largest relative difference)."""
    a, b = _losses(saved), _losses(resumed)
    out = {"run": f"{resumed.name} from {saved.name}"}
    steps = sorted(set(a) & set(b))
    if not steps:
        out["error"] = f"no common logged steps ({saved.name}: {len(a)} logged, {resumed.name}: {len(b)})"
        return out
    diffs = {s: abs(b[s] - a[s]) / abs(a[s]) for s in steps}
    out.update(steps=steps, saved_losses=[round(a[s], 5) for s in steps],
               resumed_losses=[round(b[s], 5) for s in steps], max_rel_diff=float(f"{max(diffs.values()):.3g}"),
               first_resumed_step=min(b))
    return out


# ---- profile ----
def category(name: str, cat: str) -> str:
    low = name.lower()
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    if "nccl" in low:
        if "sendrecv" in low or "alltoall" in low:
            return "all_to_all (EP dispatch/combine)"
        if "allgather" in low:
            return "fsdp_all_gather"
        if "reducescatter" in low:
            return "fsdp_reduce_scatter"
        if "allreduce" in low:
            return "all_reduce"
        return "nccl_other"
    if any(k in low for k in ("groupproblemshape", "grouped", "group_gemm", "ptrarray")):
        return "grouped_gemm (experts)"
    if any(k in low for k in ("fmha", "flash", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "triton_tem_fused_mm",
                              "_mm_", "splitk")):
        return "dense_gemm"
    if any(k in low for k in ("chunk_cat", "split_with_sizes", "foreach_copy")):
        return "fsdp_copy_in_out"
    if any(k in low for k in ("multi_tensor", "adam", "foreach")):
        return "optimizer"
    if any(k in low for k in ("index", "gather", "scatter", "sort", "radix", "cumsum", "scan", "histc", "bincount",
                              "permute", "nonzero", "masked", "unique", "searchsorted", "topk")):
        return "permute/gather/scatter/sort"
    return "other"


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent",
              "aten::item", "aten::_local_scalar_dense", "aten::tolist", "aten::nonzero", "cudaMemcpyAsync")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_one(trace: Path) -> dict:
    events = json.loads(trace.read_text()).get("traceEvents", [])
    kern = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") in ("user_annotation", "cpu_op")]
    nsteps = max(len({e["name"] for e in steps}), 1)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    by_cat: dict[str, float] = defaultdict(float)
    for e in kern:
        c = category(e["name"], e["cat"])
        rec = by_name[e["name"]]
        rec[0] += e["dur"]
        rec[1] += 1
        rec[2] = c
        by_cat[c] += e["dur"]
    host: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("name") in HOST_WAITS and e.get("cat") in ("cuda_runtime", "cpu_op"):
            host[e["name"]][0] += e["dur"]
            host[e["name"]][1] += 1
    span = (max(e["ts"] + e["dur"] for e in kern) - min(e["ts"] for e in kern)) if kern else 0.0
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kern])
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kern if "nccl" in e["name"].lower()])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kern if "nccl" not in e["name"].lower()])
    total = sum(by_cat.values()) or 1.0
    ms = 1e-3 / nsteps  # trace durations are microseconds; report ms per step
    return {
        "trace": trace.name, "profiled_steps": nsteps,
        "gpu_span_ms_per_step": round(span * ms, 2),
        "gpu_busy_ms_per_step": round(busy * ms, 2),
        "compute_busy_ms_per_step": round(compute * ms, 2),
        "nccl_busy_ms_per_step": round(comm * ms, 2),
        "nccl_not_overlapped_ms_per_step": round((busy - compute) * ms, 2),
        "cpu_step_ms": round(sum(e["dur"] for e in steps) * 1e-3 / nsteps, 2),
        "categories_ms_per_step": {k: round(v * ms, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "categories_pct_of_kernel_time": {k: round(100 * v / total, 1)
                                          for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "host_waits_ms_per_step": {k: {"ms": round(v[0] * ms, 2), "calls": v[1] // nsteps}
                                   for k, v in sorted(host.items(), key=lambda kv: -kv[1][0])},
        "top_kernels": [{"name": n[:160], "category": v[2], "ms_per_step": round(v[0] * ms, 3),
                         "calls_per_step": v[1] // nsteps, "pct": round(100 * v[0] / total, 1)}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]],
    }


def profile(trace_dir: Path, prefix: Path) -> None:
    traces = sorted(trace_dir.rglob("rank*_steps*.json"))
    if not traces:
        print(json.dumps({"run": "profile", "error": f"no trace under {trace_dir}"}))
        return
    rank0 = next((t for t in traces if t.name.startswith("rank0_")), traces[0])
    report = profile_one(rank0)
    others = {}
    for t in traces:  # the category totals of every rank (all-to-all waits differ with the rank's load)
        if t != rank0:
            r = profile_one(t)
            others[t.name.split("_")[0]] = {"gpu_busy_ms_per_step": r["gpu_busy_ms_per_step"],
                                            "categories_ms_per_step": r["categories_ms_per_step"]}
    report["other_ranks"] = others
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"{rank0.name}: {report['profiled_steps']} steps; per step: GPU span {report['gpu_span_ms_per_step']} ms, "
             f"busy {report['gpu_busy_ms_per_step']} ms (compute {report['compute_busy_ms_per_step']}, nccl "
             f"{report['nccl_busy_ms_per_step']}, nccl not overlapped {report['nccl_not_overlapped_ms_per_step']}), "
             f"host step {report['cpu_step_ms']} ms", "", "category                              ms/step    %"]
    for k, v in report["categories_ms_per_step"].items():
        lines.append(f"{k:36s} {v:9.2f} {report['categories_pct_of_kernel_time'][k]:5.1f}")
    lines += ["", "host waits                            ms/step  calls/step"]
    for k, v in report["host_waits_ms_per_step"].items():
        lines.append(f"{k:36s} {v['ms']:9.2f} {v['calls']:6d}")
    lines += ["", "top kernels (ms/step, calls/step, %, category)"]
    for r in report["top_kernels"]:
        lines.append(f"{r['ms_per_step']:9.3f} {r['calls_per_step']:5d} {r['pct']:5.1f}  {r['category']:28s} "
                     f"{r['name']}")
    for rank, r in others.items():
        lines.append(f"{rank}: busy {r['gpu_busy_ms_per_step']} ms/step " + json.dumps(r["categories_ms_per_step"]))
    prefix.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(json.dumps({"run": "profile", "rank0_busy_ms_per_step": report["gpu_busy_ms_per_step"],
                      "categories_ms_per_step": report["categories_ms_per_step"],
                      "host_waits_ms_per_step": {k: v["ms"] for k, v in report["host_waits_ms_per_step"].items()}}))


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "ours":
        print(json.dumps(ours(Path(rest[0]), rest)), flush=True)
    elif mode == "tt":
        print(json.dumps(tt(rest[0], Path(rest[1]), rest)), flush=True)
    elif mode == "profile":
        profile(Path(rest[0]), Path(rest[1]))
    elif mode == "resume":
        print(json.dumps(resume(Path(rest[0]), Path(rest[1]))), flush=True)
    else:
        sys.exit(f"unknown mode {mode!r}: expected ours, tt, profile or resume")
