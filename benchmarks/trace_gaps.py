"""Where the GPU waits for the host: ``python benchmarks/trace_gaps.py TRACE.json [MIN_GAP_US]``.

Reads a torch.profiler Chrome trace recorded with CPU and CUDA activities and ``with_stack=True``, finds
the intervals in which no kernel, copy or memset runs, and charges each idle interval to the innermost
Python frames that were running on the host at its midpoint. Prints the GPU's busy share of the traced
span, then the frame chains with the most idle time.
"""

from __future__ import annotations

import bisect
import json
import math
import sys
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gaps(events: list[dict], min_gap_us: float) -> tuple[list[tuple[float, float, str]], float, float]:
    """Idle intervals (start, end, name of the GPU op after them), busy time and traced span, in us."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                 key=lambda e: e["ts"])
    idle, busy, end = [], gpu[0]["dur"], gpu[0]["ts"] + gpu[0]["dur"]  # end: when the GPU was last busy
    for e in gpu[1:]:
        if e["ts"] - end > min_gap_us:
            idle.append((end, e["ts"], e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    return idle, busy, end - gpu[0]["ts"]


def frames_at(python: list[dict], starts: list[float], t: float, depth: int) -> str:
    """The ``depth`` innermost Python frames whose span holds time ``t``."""
    i = bisect.bisect_right(starts, t)
    holding = [e for e in python[max(0, i - 4000):i] if e["ts"] + e["dur"] >= t]
    holding.sort(key=lambda e: (e["ts"], -e["dur"]))
    names = [e["name"].split("site-packages/")[-1] for e in holding[-depth:]]
    return " > ".join(names) or "(no Python frame)"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python benchmarks/trace_gaps.py TRACE.json [MIN_GAP_US]")
    path = sys.argv[1]
    try:
        min_gap = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    except ValueError:
        min_gap = math.nan
    if not math.isfinite(min_gap) or min_gap < 0:
        sys.exit(f"error: MIN_GAP_US = {sys.argv[2]!r}: expected a number of microseconds >= 0")
    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
            raise TypeError("traceEvents is not a list of events")
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {path}: not a readable torch.profiler Chrome trace ({type(e).__name__}: {e})")
    if not any(e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES for e in events):
        sys.exit(f"error: {path}: no GPU kernel in the trace (a CPU run, or the profiler without CUDA activity)")
    idle, busy, span = gaps(events, min_gap)
    python = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"),
                    key=lambda e: e["ts"])
    if not python:
        print(f"note: {path} has no Python stacks (record them: --profiling.with_stack true); idle time is "
              "charged to '(no Python frame)'")
    starts = [e["ts"] for e in python]
    by_chain: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end, _ in idle:
        chain = frames_at(python, starts, (start + end) / 2, 3)
        by_chain[chain][0] += end - start
        by_chain[chain][1] += 1
    total_idle = sum(end - start for start, end, _ in idle)
    print(f"GPU busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span ({100 * busy / span:.1f}%); "
          f"{len(idle)} idle gaps over {min_gap:.0f} us, {total_idle / 1e3:.1f} ms in all")
    for chain, (us, n) in sorted(by_chain.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {us / 1e3:7.2f} ms x{n:<4d} {chain[-230:]}")


if __name__ == "__main__":
    main()
