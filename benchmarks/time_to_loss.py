"""Time to a validation loss (issue 28): read the ``metrics.jsonl`` of finished ``python -m torchtitan_ext.train``
runs and report, for each, its training time and the time and tokens it took to reach a target validation
bits-per-byte: the final ``val_bpb`` of the baseline runs (their mean over seeds).

Training time is the sum over logged windows of (tokens in the window) / (the window's ``tokens_per_sec``): the
trainer measures each window without its evaluation, so evaluations are not counted. "With compile" is that
sum; "compile excluded" replaces the first window (which holds the compilation and the first steps) by its
tokens at the run's median speed. A run reaches the target between two evaluations: the time is interpolated
linearly in bpb between them (and so are the tokens).

    python benchmarks/time_to_loss.py --baseline OUT/base_s0 OUT/base_s1 --runs OUT/fast_s0 OUT/fast_s1 ...

prints one JSON line per run and a Markdown table; ``--json FILE`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import steady  # noqa: E402  (this folder)


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def training_clock(rows: list[dict]) -> list[tuple[int, float, float, float | None]]:
    """(tokens, seconds with compile, seconds without, val_bpb or None) at each logged row, in order."""
    windows = [r for r in rows if "tokens_per_sec" in r and r["tokens_per_sec"] > 0]
    if not windows:
        raise ValueError("no logged training windows")
    median = steady_rate(rows)
    out, seen, with_compile, without = [], 0, 0.0, 0.0
    for i, row in enumerate(rows):
        if "tokens_per_sec" in row and row["tokens_per_sec"] > 0:
            tokens = row["tokens"] - seen
            with_compile += tokens / row["tokens_per_sec"]
            without += tokens / (median if i == 0 or row is windows[0] else row["tokens_per_sec"])
            seen = row["tokens"]
        out.append((seen, with_compile, without, row.get("val_bpb")))
    return out


def steady_rate(rows: list[dict]) -> float:
    """Tokens/s after the first logged window (benchmarks/steady.py's rule, its warm-up that window), or the one
    window's rate."""
    spans = steady.windows(rows)
    if len(spans) == 1:
        return spans[0].tokens / spans[0].seconds
    return steady.figures(spans, warmup=spans[0].end_step)["tokens_per_sec_per_device"]


def crossing(clock: list[tuple[int, float, float, float | None]], target: float) -> dict | None:
    """Tokens and seconds (with and without compile) at which val_bpb first reaches ``target``, interpolated
    between the evaluation before and the one at or below it; None if it never does."""
    evals = [c for c in clock if c[3] is not None]
    for prev, cur in zip([None, *evals], evals, strict=False):
        if cur[3] > target:
            continue
        if prev is None or prev[3] == cur[3]:
            return {"tokens": cur[0], "seconds": cur[1], "seconds_no_compile": cur[2]}
        f = (prev[3] - target) / (prev[3] - cur[3])
        return {"tokens": prev[0] + f * (cur[0] - prev[0]), "seconds": prev[1] + f * (cur[1] - prev[1]),
                "seconds_no_compile": prev[2] + f * (cur[2] - prev[2])}
    return None


def summarize(folder: Path, target: float | None) -> dict:
    rows = read_metrics(folder)
    clock = training_clock(rows)
    final = [c[3] for c in clock if c[3] is not None]
    out = {"run": folder.name, "final_val_bpb": final[-1] if final else None, "tokens": clock[-1][0],
           "train_seconds": clock[-1][1], "train_seconds_no_compile": clock[-1][2],
           "median_tokens_per_sec": steady_rate(rows)}
    if target is not None:
        out["to_target"] = crossing(clock, target)
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "not reached" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", nargs="+", type=Path, required=True, help="baseline run folders (the target)")
    p.add_argument("--runs", nargs="*", type=Path, default=[], help="other run folders")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    for folder in [*a.baseline, *a.runs]:
        if not (folder / "metrics.jsonl").is_file():
            p.error(f"{folder}: no metrics.jsonl (expected a finished run's dump folder)")
    base = [summarize(f, None) for f in a.baseline]
    if any(b["final_val_bpb"] is None for b in base):
        p.error("a baseline run has no val_bpb (it needs eval.steps > 0)")
    target = statistics.mean(b["final_val_bpb"] for b in base)
    results = [summarize(f, target) for f in [*a.baseline, *a.runs]]
    base_time = statistics.mean(r["to_target"]["seconds_no_compile"] for r in results[:len(base)] if r["to_target"])
    print(f"target val_bpb {target:.4f} (mean final of {len(base)} baseline runs)")
    print("| run | final val bpb | tokens/s | train s (no compile / with) | to target: tokens | s (no compile / with) "
          "| x baseline time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        hit = r["to_target"] or {}
        ratio = hit.get("seconds_no_compile") and hit["seconds_no_compile"] / base_time
        print(f"| {r['run']} | {r['final_val_bpb']:.4f} | {r['median_tokens_per_sec']:,.0f} | "
              f"{r['train_seconds_no_compile']:.0f} / {r['train_seconds']:.0f} | "
              f"{_fmt(hit.get('tokens'), ',.0f')} | {_fmt(hit.get('seconds_no_compile'), '.0f')} / "
              f"{_fmt(hit.get('seconds'), '.0f')} | {_fmt(ratio, '.2f')} |")
    if a.json:
        a.json.write_text(json.dumps({"target_val_bpb": target, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
