"""The table of a variant benchmark (bench_float8.sh, bench_float8_mode.sh): for each variant, the throughput
run ``OUT/tp_<variant>`` (median tokens/s and MFU over the windows after the first two, which hold compilation
and warm-up; peak memory) and the loss run ``OUT/loss_<variant>`` if there is one (final loss, mean of the
last 50 steps); speed and loss relative to ``bf16``. A variant without metrics shows the last line of its log
(a one-line refusal, e.g. float8 on a CPU). ``--note TEXT`` adds what follows TEXT in the throughput log.

    python benchmarks/compare_variants.py OUT VARIANT... [--note "float8 experts:"]

Prints the table and its JSON, and writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = ["tokens_per_sec", "speedup_vs_bf16", "mfu", "peak_memory_gib", "final_loss", "mean_loss_last_50",
           "loss_vs_bf16_pct"]


def read(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r] if path.exists() else []


def last_line(log: Path) -> str:
    text = log.read_text() if log.exists() else ""
    lines = [x for x in text.splitlines() if x.strip() and "Failed to load" not in x]
    return lines[-1][:160] if lines else "no output"


def variant_row(out: Path, variant: str, note: str) -> dict:
    row: dict = {}
    tp = read(out / f"tp_{variant}")
    if tp:
        steady = tp[2:] or tp
        row["tokens_per_sec"] = round(statistics.median(r["tokens_per_sec"] for r in steady))
        if "mfu" in steady[0]:
            row["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
        if "memory_gib" in tp[-1]:
            row["peak_memory_gib"] = round(max(r["memory_gib"] for r in tp), 2)
    else:
        row["error"] = last_line(out / f"tp_{variant}.log")
    log = out / f"tp_{variant}.log"
    if note and log.exists():
        hits = [x.split(note, 1)[1].strip()[:60] for x in log.read_text().splitlines() if note in x]
        if hits:
            row["note"] = hits[0]
    loss = read(out / f"loss_{variant}")
    if loss:
        tail = [r["loss"] for r in loss if r["step"] > loss[-1]["step"] - 50]
        row.update(loss_steps=loss[-1]["step"], final_loss=round(loss[-1]["loss"], 4),
                   mean_loss_last_50=round(statistics.mean(tail), 4))
    return row


def compare(out: Path, variants: list[str], note: str = "") -> dict[str, dict]:
    summary = {v: variant_row(out, v, note) for v in variants}
    base = summary.get("bf16", {})
    for row in summary.values():
        if "tokens_per_sec" in row and "tokens_per_sec" in base:
            row["speedup_vs_bf16"] = round(row["tokens_per_sec"] / base["tokens_per_sec"], 3)
        if "mean_loss_last_50" in row and "mean_loss_last_50" in base:
            row["loss_vs_bf16_pct"] = round(100 * (row["mean_loss_last_50"] / base["mean_loss_last_50"] - 1), 2)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("variants", nargs="+")
    p.add_argument("--note", default="")
    a = p.parse_args()
    summary = compare(a.out, a.variants, a.note)
    width = max(len(v) for v in summary) + 2
    print(f"{'run':<{width}}" + "".join(f"{c:>19}" for c in COLUMNS))
    for v, row in summary.items():
        cells = "".join(f"{row.get(c, '-')!s:>19}" for c in COLUMNS)
        extra = "".join(f"  {row[k]}" for k in ("error", "note") if k in row)
        print(f"{v:<{width}}{cells}{extra}")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
