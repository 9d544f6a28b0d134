"""Summarise benchmark runs: ``python benchmarks/summarize.py DUMP_FOLDER [...]``.

For each run folder, reads metrics.jsonl and prints one JSON line: the median of tokens/s (job and per
device) and MFU over the logged windows after the first two (compilation and warm-up), peak memory, and
the first and last training loss.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summarize(folder: Path) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r and "tokens_per_sec" in r]
    steady = train[2:] or train
    out = {"run": folder.name, "steps": train[-1]["step"] if train else 0}
    for key in ("tokens_per_sec", "tokens_per_sec_per_device", "mfu"):
        if steady and key in steady[0]:
            out[key] = round(statistics.median(r[key] for r in steady), 4 if key == "mfu" else 0)
    if train and "memory_gib" in train[-1]:
        out["peak_memory_gib"] = round(max(r["memory_gib"] for r in train), 2)
        out["peak_reserved_gib"] = round(max(r.get("memory_reserved_gib", 0) for r in train), 2)
    if train:
        out["first_loss"], out["last_loss"] = round(train[0]["loss"], 4), round(train[-1]["loss"], 4)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    if vals:
        out["val_loss"] = round(vals[-1], 4)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        try:
            print(json.dumps(summarize(Path(arg))), flush=True)
        except FileNotFoundError:
            print(json.dumps({"run": Path(arg).name, "error": "no metrics.jsonl (run failed)"}), flush=True)
