"""Rows and the table of benchmarks/bench_layouts.sh, one JSON line per row.

  python benchmarks/layouts_report.py row ROW RUN_FOLDER [--plan PLAN_TXT] [--wall S]
        ROW = [tt_]MODEL_LAYOUT[_f8]; ours: RUN_FOLDER's metrics.jsonl (+ RUN_FOLDER.log), torchtitan: RUN_FOLDER.log
        (benchmarks/scale_report.py reads both); --plan: the output of ``python -m torchtitan_ext.plan`` for the
        row's arguments (its predicted peak, and its predicted step time or tokens/s where it prints one)
  python benchmarks/layouts_report.py table SUMMARY_JSONL
        the table: tokens/s per GPU, MFU, peak memory (ours: max allocated and reserved on rank 0, and max
        allocated over all ranks; torchtitan logs max reserved on rank 0), the planner's peak and its ratio to
        the measured one (the largest over the ranks where logged), ours / torchtitan for
        rows measured by both, and each model's layouts ranked by measured (and, where printed, planned) speed;
        for a plan row (the planner's --search choice), whether it is the fastest of its model's rows.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_report  # noqa: E402  (this folder)

PLAN_PEAK = re.compile(r"^\s*peak \(x[\d.]+ allocator slack\)\s+([\d.]+) ([KMG])iB", re.M)
UNIT = {"K": 2**-20, "M": 2**-10, "G": 1}
PLAN_STEP = re.compile(r"step time[^\d\n]*([\d.]+)\s*(ms|s)\b", re.I)
PLAN_TPS = re.compile(r"([\d,]+(?:\.\d+)?)\s*tokens/s(?: per (?:GPU|device|rank))?", re.I)
# --search's pick: "chosen: FSDP 4, AC none: 67.6 GiB per GPU, step 1.12 s, 7,317 tokens/s per GPU"
PLAN_CHOSEN = re.compile(r"^chosen: (.+): ([\d.]+) GiB per GPU, step ([\d.]+) (ms|s), ([\d,]+) tokens/s per GPU",
                         re.M)


# Torchtitan 0.2.0 applies its bf16 mixed precision through FSDP: a layout without FSDP trains in float32 there
# ("Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled", seen on 4 H200s), so
# our bf16 row has no torchtitan counterpart to be compared with.
TT_FLOAT32_LAYOUTS = {"tp4", "tp2_pp2", "pp2_i1f1b", "pp2_zbv"}


def parse_row(row: str) -> dict:
    """``tt_8b_fsdp2_tp2_f8`` -> trainer torchtitan, model 8b, layout fsdp2_tp2, precision float8."""
    trainer = "torchtitan" if row.startswith("tt_") else "ours"
    rest = row.removeprefix("tt_")
    precision = "float8" if rest.endswith("_f8") else "bf16"
    model, _, layout = rest.removesuffix("_f8").partition("_")
    return {"row": row, "trainer": trainer, "model": model, "layout": layout, "precision": precision}


def parse_plan(text: str) -> dict:
    if m := PLAN_CHOSEN.search(text):
        return {"plan_choice": m[1], "plan_peak_gib": float(m[2]),
                "plan_step_s": float(m[3]) / (1000 if m[4] == "ms" else 1),
                "plan_tokens_per_sec": float(m[5].replace(",", ""))}
    out = {}
    if m := PLAN_PEAK.search(text):
        out["plan_peak_gib"] = round(float(m[1]) * UNIT[m[2]], 4)
    if m := PLAN_STEP.search(text):
        out["plan_step_s"] = float(m[1]) / (1000 if m[2] == "ms" else 1)
    if m := PLAN_TPS.search(text):
        out["plan_tokens_per_sec"] = float(m[1].replace(",", ""))
    if not out and (err := [line for line in text.splitlines() if line.startswith("error:")]):
        out["plan_error"] = err[0]
    return out


def row(argv: list[str]) -> dict:
    name, folder = argv[0], Path(argv[1])
    meta = parse_row(name)
    log = folder.with_name(folder.name + ".log")  # the row's console output, either trainer
    if meta["trainer"] == "ours":
        measured = scale_report.ours(folder, argv)
    else:
        measured = scale_report.tt(folder.name, log, argv)
    out = {**{k: v for k, v in measured.items() if k not in ("run", "trainer")}, **meta}
    if meta["layout"].endswith("_async") and log.is_file():
        # the row ran with TORCH_LOGS=output_code: 0 means Inductor's micro-pipeline pass fused nothing
        out["async_tp_fused_calls"] = len(re.findall(r"symm_mem\.fused_\w*(?:matmul|reduce_scatter)",
                                                     log.read_text(errors="replace")))
    if "--plan" in argv and (plan := Path(argv[argv.index("--plan") + 1])).is_file():
        out.update(parse_plan(plan.read_text(errors="replace")))
        # the planner predicts the heaviest rank: against the largest over the ranks where the trainer logs it
        measured_peak = out.get("peak_memory_max_gib") or out.get("peak_memory_gib")
        if "plan_peak_gib" in out and measured_peak:
            out["plan_over_measured"] = round(out["plan_peak_gib"] / measured_peak, 3)
    return out


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    cols = ("row", "tok/s/GPU", "MFU", "peak GiB", "max rank", "reserved", "plan GiB", "plan/meas", "vs tt", "rank",
            "plan rank")
    tt = {(r["model"], r["layout"], r["precision"]): r for r in rows
          if r.get("trainer") == "torchtitan" and r.get("tokens_per_sec_per_device")}
    ranks, plan_ranks = {}, {}
    for model in {r.get("model") for r in rows}:
        ours = [r for r in rows if r.get("model") == model and r.get("trainer") == "ours"]
        measured = sorted((r for r in ours if r.get("tokens_per_sec_per_device")),
                          key=lambda r: -r["tokens_per_sec_per_device"])
        ranks.update({r["row"]: i + 1 for i, r in enumerate(measured)})
        planned = [r for r in measured if r.get("plan_tokens_per_sec") or r.get("plan_step_s")]
        planned.sort(key=lambda r: -r["plan_tokens_per_sec"] if r.get("plan_tokens_per_sec") else r["plan_step_s"])
        plan_ranks.update({r["row"]: i + 1 for i, r in enumerate(planned)})
    lines = ["  ".join(f"{c:>12}" if i else f"{c:<28}" for i, c in enumerate(cols))]
    for r in rows:
        if "tokens_per_sec_per_device" not in r:
            lines.append(f"{r.get('row', '?'):<28}  {r.get('error') or r.get('plan_error') or 'no result'}")
            continue
        comparable = r["trainer"] == "ours" and r["layout"] not in TT_FLOAT32_LAYOUTS
        anchor = tt.get((r["model"], r["layout"], r["precision"])) if comparable else None
        ratio = r["tokens_per_sec_per_device"] / anchor["tokens_per_sec_per_device"] if anchor else None
        cells = (f"{r['tokens_per_sec_per_device']:,.0f}", _fmt(r.get("mfu"), ".1%"),
                 _fmt(r.get("peak_memory_gib"), ".2f"), _fmt(r.get("peak_memory_max_gib"), ".2f"),
                 _fmt(r.get("peak_reserved_gib"), ".2f"),
                 _fmt(r.get("plan_peak_gib"), ".2f"), _fmt(r.get("plan_over_measured"), ".3f"),
                 _fmt(ratio, ".3f"), _fmt(ranks.get(r["row"])), _fmt(plan_ranks.get(r["row"])))
        lines.append(f"{r['row']:<28}  " + "  ".join(f"{c:>12}" for c in cells))
    lines += [_choice_line(r, rows) for r in rows if r.get("plan_choice")]
    if any(r.get("trainer") == "torchtitan" and r.get("layout") in TT_FLOAT32_LAYOUTS for r in rows):
        lines.append(f"torchtitan's {', '.join(sorted(TT_FLOAT32_LAYOUTS))} rows train in float32 (no FSDP, so no "
                     f"mixed precision in torchtitan 0.2.0): no ours / torchtitan ratio")
    return "\n".join(lines)


def _choice_line(choice: dict, rows: list[dict]) -> str:
    """Issue 42, deliverable 3: the planner's choice against the fastest of our rows of its model and precision
    measured in the same call."""
    head = f"planner's choice for {choice['model']} {choice['precision']}: {choice['plan_choice']}"
    rivals = [r for r in rows if r.get("trainer") == "ours" and r.get("tokens_per_sec_per_device")
              and (r["model"], r["precision"]) == (choice["model"], choice["precision"])]
    if not choice.get("tokens_per_sec_per_device"):
        return f"{head}: not measured"
    best = max(rivals, key=lambda r: r["tokens_per_sec_per_device"])
    share = choice["tokens_per_sec_per_device"] / best["tokens_per_sec_per_device"]
    verdict = "the fastest row" if best is choice else f"{share:.3f}x the fastest row, {best['row']}"
    return f"{head}: {choice['tokens_per_sec_per_device']:,.0f} tokens/s per GPU, {verdict} (of {len(rivals)})"


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "row":
        print(json.dumps(row(sys.argv[2:])), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        print(table([json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines() if line.strip()]))
    else:
        sys.exit(__doc__)
