"""Where a profiled step's GPU time goes, per kernel category, from the trainer's [profiling] traces:

  python benchmarks/kernel_table.py TRACE_DIR OUT_PREFIX

TRACE_DIR: a run's profile folder (``--profiling.enabled true --profiling.start_step N --profiling.end_step M``,
one ``rank*_steps*.json`` per rank). Writes OUT_PREFIX.json and OUT_PREFIX.txt (rank 0: GPU span and busy time
per step, compute against NCCL and how much of NCCL is not overlapped, categories, host waits, the top kernels;
each other rank's category totals) and prints a one-line JSON summary.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


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
    if len(sys.argv) != 3 or not Path(sys.argv[1]).is_dir():
        print("usage: python benchmarks/kernel_table.py TRACE_DIR OUT_PREFIX (TRACE_DIR: a run's profile folder)",
              file=sys.stderr)
        sys.exit(2)
    profile(Path(sys.argv[1]), Path(sys.argv[2]))
