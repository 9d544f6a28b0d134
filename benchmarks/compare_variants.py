"""The table of a variant benchmark (bench_float8.sh, bench_float8_mode.sh): for each variant, the throughput
run ``OUT/tp_<variant>`` (median tokens/s and MFU over the windows after the first two, which hold compilation
and warm-up; peak memory) and the loss runs ``OUT/loss_<variant>`` or ``OUT/loss_<variant>_s<seed>`` if there
are any (final loss, mean of the last 50 logged steps, final validation loss: each the mean over the seeds, the
seeds' own values beside it); speed and losses relative to ``bf16``. A variant without metrics shows the last
line of its log (a one-line refusal, e.g. float8 on a CPU).
``--note TEXT`` adds what follows TEXT in the throughput log.

    python benchmarks/compare_variants.py OUT VARIANT... [--note "float8 experts:"]

Prints the table and its JSON, and writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = ["tokens_per_sec", "speedup_vs_bf16", "mfu", "peak_memory_gib", "final_loss", "mean_loss_last_50",
           "loss_vs_bf16_pct", "val_loss", "val_vs_bf16_pct"]


def read(folder: Path, key: str = "loss") -> list[dict]:
    path = folder / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if key in r] if path.exists() else []


def loss_summary(folder: Path) -> dict:
    """One loss run's final loss, mean of its last 50 steps' logged losses, and final validation loss."""
    loss, val = read(folder), read(folder, "val_loss")
    if not loss:
        return {}
    tail = [r["loss"] for r in loss if r["step"] > loss[-1]["step"] - 50]
    out = {"loss_steps": loss[-1]["step"], "final_loss": loss[-1]["loss"], "mean_loss_last_50": statistics.mean(tail)}
    if val:
        out["val_loss"] = val[-1]["val_loss"]
    return out


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
    folders = [out / f"loss_{variant}"] + sorted(out.glob(f"loss_{variant}_s*"))
    runs = {f.name.removeprefix(f"loss_{variant}").lstrip("_") or "s?": loss_summary(f) for f in folders}
    runs = {seed: r for seed, r in runs.items() if r}
    if runs:
        row["loss_steps"] = max(r["loss_steps"] for r in runs.values())
        for key in ("final_loss", "mean_loss_last_50", "val_loss"):
            values = [r[key] for r in runs.values() if key in r]
            if values:
                row[key] = round(statistics.mean(values), 4)
        if len(runs) > 1:
            row["seeds"] = {seed: {k: round(v, 4) for k, v in r.items() if k != "loss_steps"}
                            for seed, r in runs.items()}
    return row


def compare(out: Path, variants: list[str], note: str = "") -> dict[str, dict]:
    summary = {v: variant_row(out, v, note) for v in variants}
    base = summary.get("bf16", {})
    for row in summary.values():
        if "tokens_per_sec" in row and "tokens_per_sec" in base:
            row["speedup_vs_bf16"] = round(row["tokens_per_sec"] / base["tokens_per_sec"], 3)
        for key, pct in (("mean_loss_last_50", "loss_vs_bf16_pct"), ("val_loss", "val_vs_bf16_pct")):
            if key in row and key in base:
                row[pct] = round(100 * (row[key] / base[key] - 1), 2)
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
        extra = "".join(f"  {row[k]}" for k in ("error", "note", "seeds") if k in row)
        print(f"{v:<{width}}{cells}{extra}")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
