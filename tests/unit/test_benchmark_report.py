"""benchmarks/report.py: the summary table from results lines, and the README's headline block, which must be
what report.py renders from benchmarks/results/."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = module
    spec.loader.exec_module(module)
    return module


report = _module()


def _line(call: str, date: str, scenario: str, run: str, tps: float, status: str = "ok", **extra) -> dict:
    return {"date": date, "call": call, "scenario": scenario, "run": run, "device": "1 x GPU", "gpus": 1,
            "commit": "c0ffee", "status": status, "figures": {"tokens_per_sec_per_device": tps}, **extra}


LINES = [
    _line("a", "2026-12-01T10:00:00Z", "dense", "ours", 100.0),
    _line("a", "2026-12-01T10:05:00Z", "dense", "plain", 80.0),
    _line("a", "2026-12-01T10:09:00Z", "dense", "torchtitan", 50.0),
    _line("b", "2026-12-02T10:00:00Z", "dense", "ours", 110.0, commit="beef"),
    _line("b", "2026-12-02T10:05:00Z", "dense", "previous", 100.0, commit="f00d"),
    _line("b", "2026-12-02T10:09:00Z", "dense", "torchtitan", 0.0, status="failed"),  # not a comparison
    _line("b", "2026-12-02T11:00:00Z", "fast", "ours", 132.0),
    _line("c", "2026-12-03T10:00:00Z", "fast", "ours", 150.0),  # newer, but no reference run in its call
]


def test_summary_rows_pair_runs_of_one_call():
    rows = report.comparisons(LINES, {"fast": "dense"})
    assert [(r["scenario"], r["baseline"], r["ours"]["call"]) for r in rows] == [
        ("dense", "previous", "b"), ("dense", "plain", "a"), ("dense", "torchtitan", "a"),
        ("fast", None, "c"), ("fast", "dense", "b")]
    assert report.summary(rows).splitlines()[2:] == [
        "| `dense` | tokens/s per GPU | 110 | previous commit (f00d) | 100 | 1.100x | 1 x GPU | 2026-12-02 | beef |",
        "| `dense` | tokens/s per GPU | 100 | plain script | 80 | 1.250x | 1 x GPU | 2026-12-01 | c0ffee |",
        "| `dense` | tokens/s per GPU | 100 | torchtitan 0.2.0 | 50 | 2.000x | 1 x GPU | 2026-12-01 | c0ffee |",
        "| `fast` | tokens/s per GPU | 150 | - | - | - | 1 x GPU | 2026-12-03 | c0ffee |",
        "| `fast` | tokens/s per GPU | 132 | `dense` | 110 | 1.200x | 1 x GPU | 2026-12-02 | c0ffee |"]
    block = report.headline_block(rows, ["dense", "fast", "absent"]).splitlines()
    # ours and its ratios from one call: the latest that compared it with other code than the previous commit's
    assert block[3:6] == ["| `dense` | 100 | 1.250x plain script; 2.000x torchtitan 0.2.0 | 1 x GPU, 2026-12-01 |",
                          "| `fast` | 132 | 1.200x `dense` | 1 x GPU, 2026-12-02 |", ""]


def _results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "dense.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES if x["scenario"] == "dense"))
    return folder


def test_results_md_gets_one_summary_block(tmp_path, capsys):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## 2026-11-01 a dated section\n")
    for _ in range(2):  # written, then replaced
        assert report.run_tool(report.main, ["--results", str(_results(tmp_path)), "--results-md", str(md)]) == 0
        (tmp_path / "results" / "dense.jsonl").unlink()
        (tmp_path / "results").rmdir()
    text = md.read_text()
    assert text.startswith("# Benchmark results\n\n<!-- summary:begin -->\n") and text.count("summary:begin") == 1
    assert text.endswith("<!-- summary:end -->\n\n## 2026-11-01 a dated section\n")
    assert "| `dense` | tokens/s per GPU | 110 | previous commit (f00d) |" in text


def test_check_and_write_readme(tmp_path, capsys):
    readme, results = tmp_path / "README.md", str(_results(tmp_path))
    readme.write_text("# x\n<!-- headline:begin -->\nstale\n<!-- headline:end -->\nafter\n")
    assert report.run_tool(report.main, ["--results", results, "--check-readme", str(readme)]) == 1
    assert capsys.readouterr().err == (f"{readme}: the headline block differs from benchmarks/results/ (python "
                                       f"benchmarks/report.py --write-readme {readme} rewrites it)\n")
    assert report.run_tool(report.main, ["--results", results, "--write-readme", str(readme)]) == 0
    assert report.run_tool(report.main, ["--results", results, "--check-readme", str(readme)]) == 0
    assert "| `dense_1b` |" not in readme.read_text() and readme.read_text().endswith("<!-- headline:end -->\nafter\n")
    readme.write_text("# no block\n")
    assert report.run_tool(report.main, ["--results", results, "--check-readme", str(readme)]) == 2
    assert capsys.readouterr().err == (f"error: {readme}: expected one <!-- headline:begin --> line followed by one "
                                       "<!-- headline:end --> line\n")


def test_a_bad_results_line_is_one_error_line(tmp_path, capsys):
    folder = _results(tmp_path)
    (folder / "broken.jsonl").write_text('{"ok": 1}\n{not json\n')
    assert report.run_tool(report.main, ["--results", str(folder), "--print"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {folder / 'broken.jsonl'}:2: not a JSON line (")


def test_readme_headline_block_is_the_render():
    readme = (REPO / "README.md").read_text()
    if report.HEADLINE[0] not in readme:
        pytest.skip("README.md has no <!-- headline:begin --> block yet (the README rewrite adds it)")
    assert report.run_tool(report.main, ["--check-readme", str(REPO / "README.md")]) == 0, (
        "README.md's headline block differs: python benchmarks/report.py --write-readme README.md")
