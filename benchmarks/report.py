"""The benchmarks' summary and the README's headline block, rendered from benchmarks/results/*.jsonl.

  python benchmarks/report.py                       write the summary table at the top of benchmarks/RESULTS.md
  python benchmarks/report.py --print               print it instead
  python benchmarks/report.py --write-readme PATH   rewrite PATH's headline block
  python benchmarks/report.py --check-readme PATH   exit 1 when PATH's headline block differs from the render

The summary has one row per scenario and baseline: our tokens/s per GPU, the baseline's from the same call
(benchmarks/run.py writes one ``call`` id on every line of an invocation), their ratio, device, date and commit;
the latest such call counts. A scenario with a ``reference`` (scenarios.toml) also gets a row against that
scenario's run of ours in the same call. The headline block shows the scenarios of scenarios.toml's
[report] headline with their ratios.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from run import load_scenarios, tomllib  # noqa: E402  (this folder)

from torchtitan_ext.cli import ArgumentParser, run_tool  # noqa: E402
from torchtitan_ext.errors import UserError  # noqa: E402

RESULTS = BENCH / "results"
RESULTS_MD = BENCH / "RESULTS.md"
SUMMARY = ("<!-- summary:begin -->", "<!-- summary:end -->")
HEADLINE = ("<!-- headline:begin -->", "<!-- headline:end -->")
FIGURE = "tokens_per_sec_per_device"
BASELINE_NAMES = {"previous": "previous commit", "plain": "plain script", "torchtitan": "torchtitan 0.2.0"}


def read_results(folder: Path) -> list[dict]:
    """Every line of ``folder``/*.jsonl; a line that is not JSON is a UserError naming its file and line."""
    lines = []
    for path in sorted(folder.glob("*.jsonl")):
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if text.strip():
                try:
                    lines.append(json.loads(text))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{number}: not a JSON line ({e.msg})") from None
    return lines


def comparisons(lines: Iterable[dict], references: dict[str, str]) -> list[dict]:
    """One row per scenario and baseline from the latest call where both ran and succeeded, and one of ours
    alone where its latest run is newer than those: scenario, ours (the results line), baseline (its name or
    None), theirs."""
    ok = [x for x in lines if x.get("status") == "ok" and FIGURE in x.get("figures", {})]
    by_call: dict[tuple[str, str], dict[str, dict]] = {}
    for x in sorted(ok, key=lambda x: x["date"]):
        by_call.setdefault((x["call"], x["scenario"]), {})[x["run"]] = x
    rows = []
    for scenario in dict.fromkeys(x["scenario"] for x in ok):
        calls = [(call, runs) for (call, name), runs in by_call.items() if name == scenario and "ours" in runs]
        if not calls:
            continue
        calls.sort(key=lambda c: c[1]["ours"]["date"])
        found = []
        for baseline in BASELINE_NAMES:
            with_it = [runs for _, runs in calls if baseline in runs]
            if with_it:
                found.append({"scenario": scenario, "ours": with_it[-1]["ours"], "baseline": baseline,
                              "theirs": with_it[-1][baseline]})
        if reference := references.get(scenario):
            paired = [(runs, by_call[(call, reference)]["ours"]) for call, runs in calls
                      if "ours" in by_call.get((call, reference), {})]
            if paired:
                found.append({"scenario": scenario, "ours": paired[-1][0]["ours"], "baseline": reference,
                              "theirs": paired[-1][1]})
        latest = calls[-1][1]["ours"]
        if all(row["ours"] is not latest for row in found):  # a newer run of ours than any compared one
            found.insert(0, {"scenario": scenario, "ours": latest, "baseline": None, "theirs": None})
        rows += found
    return rows


def _label(row: dict) -> str:
    if row["baseline"] is None:
        return "-"
    if row["baseline"] == "previous":
        return f"previous commit ({row['theirs'].get('commit') or 'unknown'})"
    return BASELINE_NAMES.get(row["baseline"], f"`{row['baseline']}`")


def _ratio(row: dict) -> str:
    return f"{row['ours']['figures'][FIGURE] / row['theirs']['figures'][FIGURE]:.3f}x" if row["theirs"] else "-"


def summary(rows: list[dict]) -> str:
    out = ["| scenario | figure | ours | baseline | baseline's | ratio | device | date | commit |",
           "|---|---|---:|---|---:|---:|---|---|---|"]
    for row in rows:
        ours = row["ours"]
        theirs = f"{row['theirs']['figures'][FIGURE]:,.0f}" if row["theirs"] else "-"
        out.append(f"| `{row['scenario']}` | tokens/s per GPU | {ours['figures'][FIGURE]:,.0f} | {_label(row)} | "
                   f"{theirs} | {_ratio(row)} | {ours['device']} | {ours['date'][:10]} | "
                   f"{ours.get('commit') or 'unknown'} |")
    return "\n".join(out)


def summary_block(rows: list[dict]) -> str:
    return "\n".join([SUMMARY[0], "", "Generated by `python benchmarks/report.py` from `benchmarks/results/*.jsonl`, "
                      "which `python benchmarks/run.py` appends to:", "the latest call per scenario and baseline. "
                      "The dated log below is the record.", "", summary(rows), "", SUMMARY[1]])


def headline_block(rows: list[dict], names: list[str]) -> str:
    """One row per scenario of ``names``: ours and its ratios from the latest call that compared it with a
    baseline other than the previous commit (or with its reference), else its latest run alone."""
    out = [HEADLINE[0], "| scenario | tokens/s per GPU | against | device, date |", "|---|---:|---|---|"]
    for name in names:
        mine = [r for r in rows if r["scenario"] == name]
        compared = [r for r in mine if r["theirs"] and r["baseline"] != "previous"]
        if compared:
            call = max(compared, key=lambda r: r["ours"]["date"])["ours"]["call"]
            shown = [r for r in compared if r["ours"]["call"] == call]
        else:
            shown = [max(mine, key=lambda r: r["ours"]["date"])] if mine else []
        if not shown:
            continue
        ours = shown[0]["ours"]
        against = "; ".join(f"{_ratio(r)} {_label(r)}" for r in shown if r["theirs"])
        out.append(f"| `{name}` | {ours['figures'][FIGURE]:,.0f} | {against or '-'} | "
                   f"{ours['device']}, {ours['date'][:10]} |")
    out += ["", "From `benchmarks/results/` by `python benchmarks/report.py`; more in "
            "[benchmarks/RESULTS.md](benchmarks/RESULTS.md).", HEADLINE[1]]
    return "\n".join(out)


def replace_block(text: str, markers: tuple[str, str], block: str, where: Path) -> str:
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise UserError(f"{where}: expected one {begin} line followed by one {end} line")
    return text[:text.index(begin)] + block + text[text.index(end) + len(end):]


def with_summary(text: str, block: str, where: Path) -> str:
    """RESULTS.md with the summary block replaced, or put after its title when it has none yet."""
    if SUMMARY[0] in text or SUMMARY[1] in text:
        return replace_block(text, SUMMARY, block, where)
    title, _, rest = text.partition("\n")
    return f"{title}\n\n{block}\n{rest}"


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python benchmarks/report.py", description=__doc__)
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder of <scenario>.jsonl files")
    p.add_argument("--results-md", type=Path, default=RESULTS_MD, help="the file whose summary block is written")
    p.add_argument("--scenarios", type=Path, default=BENCH / "scenarios.toml", help="scenarios.toml")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the summary table")
    mode.add_argument("--write-readme", type=Path, metavar="PATH", help="rewrite PATH's headline block")
    mode.add_argument("--check-readme", type=Path, metavar="PATH", help="exit 1 when PATH's headline block differs")
    ns = p.parse_args(argv)
    scenarios = load_scenarios(ns.scenarios)
    with open(ns.scenarios, "rb") as f:
        headline = tomllib.load(f).get("report", {}).get("headline", [])
    rows = comparisons(read_results(ns.results), {s.name: s.reference for s in scenarios.values() if s.reference})
    if ns.print:
        print(summary(rows))
    elif ns.write_readme or ns.check_readme:
        path = ns.write_readme or ns.check_readme
        text = path.read_text()
        rendered = replace_block(text, HEADLINE, headline_block(rows, headline), path)
        if ns.check_readme:
            if rendered != text:
                print(f"{path}: the headline block differs from benchmarks/results/ (python benchmarks/report.py "
                      f"--write-readme {path} rewrites it)", file=sys.stderr)
                return 1
            return 0
        path.write_text(rendered)
    else:
        ns.results_md.write_text(with_summary(ns.results_md.read_text(), summary_block(rows), ns.results_md))
        print(f"{ns.results_md}: {len(rows)} summary rows")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
