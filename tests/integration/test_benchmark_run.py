"""benchmarks/run.py end to end: the smoke_cpu scenario really trains (the debug model on the CPU, a few steps)
and its results line carries the figures; bad input is one line and exit code 2; a failed run is a line that
says so and exit code 1."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


run = _module()


def _run(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run([sys.executable, str(RUN), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_cpu_trains_and_appends_its_line(tmp_path):
    results, device_out = tmp_path / "results", tmp_path / "device_out"
    (results).mkdir()
    (results / "smoke_cpu.jsonl").write_text('{"earlier": "line"}\n')  # appended to, not replaced
    done = _run("smoke_cpu", "--out", str(results), "--work", str(tmp_path / "work"), out=device_out)
    assert done.returncode == 0, done.stderr[-2000:]
    earlier, line = _lines(results / "smoke_cpu.jsonl")
    assert earlier == {"earlier": "line"}
    assert _lines(device_out / "smoke_cpu.jsonl") == [line]
    assert {"date", "call", "device", "commit", "command", "wall_s"} <= set(line)
    assert (line["scenario"], line["run"], line["status"], line["gpus"]) == ("smoke_cpu", "ours", "ok", 0)
    assert line["device"].startswith("cpu") and line["date"].endswith("Z")
    assert " -m torchtitan_ext.train --config train_configs/debug.toml " in line["command"]
    assert "--training.steps 6 --metrics.log_freq 1" in line["command"]
    fig = line["figures"]
    assert list(fig) == ["tokens_per_sec", "tokens_per_sec_per_device", "step_s", "first_step_s", "final_loss",
                         "tail_loss"]  # eval.steps 0: no val_loss
    assert fig["tokens_per_sec"] == fig["tokens_per_sec_per_device"] > 0
    assert fig["step_s"] > 0 and fig["first_step_s"] > 0 and 0 < fig["final_loss"] < math.log(257) + 1
    # tokens/s and the step time describe the same steady steps: 2 x 64 tokens a step
    assert abs(fig["tokens_per_sec"] * fig["step_s"] / 128 - 1) < 0.5
    with tarfile.open(device_out / "logs.tar.gz") as tar:
        assert tar.getnames() == ["smoke_cpu_ours.log"]
    assert done.stdout.startswith("smoke_cpu ours: ") and "tokens/s" in done.stdout


def test_a_failed_run_is_a_line_that_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    scenarios = tmp_path / "scenarios.toml"
    scenarios.write_text('[scenario.broken]\ndescription = "a flavor that does not exist"\ngpus = 0\n'
                         'config = "train_configs/debug.toml"\nargs = "--model.flavor nosuch"\nbatch = 2\nseq = 64\n'
                         'baselines = ["previous"]\n'
                         '[scenario.slow]\ndescription = "past its limit"\ngpus = 0\n'
                         'config = "train_configs/debug.toml"\nbatch = 2\nseq = 64\ntimeout_s = 2\n')
    code = run.run_tool(run.main, ["broken", "slow", "--scenarios", str(scenarios), "--out", str(tmp_path),
                                   "--work", str(tmp_path / "w"), "--previous", str(tmp_path / "none")])
    assert code == 1, capsys.readouterr()
    ours, previous = _lines(tmp_path / "broken.jsonl")
    assert ours["status"] == "failed" and ours["error"].startswith("exit 2: ") and "nosuch" in ours["error"]
    assert "figures" not in ours
    assert previous == {**previous, "run": "previous", "status": "failed",
                        "error": f"no previous tree in {tmp_path / 'none'}: run `python benchmarks/run.py "
                                 "--prepare-previous REF` first"}
    (slow,) = _lines(tmp_path / "slow.jsonl")
    assert (slow["status"], slow["error"]) == ("failed", "stopped at its limit of 2 s")
    # --runs: only the runs named (slow's one run, ours, is not among them)
    code = run.run_tool(run.main, ["broken", "slow", "--scenarios", str(scenarios), "--out", str(tmp_path / "o"),
                                   "--work", str(tmp_path / "w"), "--previous", str(tmp_path / "none"),
                                   "--runs", "previous"])
    assert code == 1 and sorted(p.name for p in (tmp_path / "o").iterdir()) == ["broken.jsonl"]
    assert [x["run"] for x in _lines(tmp_path / "o" / "broken.jsonl")] == ["previous"]


def _bad_scenarios(tmp_path: Path, text: str) -> str:
    path = tmp_path / "scenarios.toml"
    path.write_text(text)
    return str(path)


BAD_INPUT = {
    ("nope",): "error: unknown scenario 'nope' (expected one of smoke_cpu, dense_1b, ",
    (): "error: no scenario named (python benchmarks/run.py --list prints them)",
    ("smoke_cpu", "--steps", "2"): "error: --steps 2: scenario smoke_cpu warms up for 2 steps; expected more",
    ("smoke_cpu", "--steps", "0"): "error: argument --steps: expected a finite number > 0, got '0'",
    ("smoke_cpu", "--bogus"): "error: unrecognized arguments: --bogus",
    ("smoke_cpu", "--runs", "ours,nanogpt"):
        "error: argument --runs: expected names among ours, previous, plain, torchtitan, got 'ours,nanogpt'",
    ("--prepare-previous", "no-such-ref"):
        "error: --prepare-previous no-such-ref: not a commit of this repository",
    ("x", "--scenarios", 'steps = "ten"'):
        "error: scenarios.toml: scenario.x.steps = 'ten': expected a whole number",
    ("x", "--scenarios", "colour = 1"):
        "error: scenarios.toml: scenario.x: unknown key 'colour' (expected one of ",
    ("x", "--scenarios", 'baselines = ["nanogpt"]'):
        "error: scenarios.toml: scenario.x.baselines: unknown 'nanogpt' (expected previous, plain, torchtitan)",
    ("x", "--scenarios", 'baselines = ["plain"]'):
        "error: scenarios.toml: scenario.x: runs the plain baseline but has no plain.args",
}


@pytest.mark.parametrize("args, message", BAD_INPUT.items(), ids=[" ".join(a) or "none" for a in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_code_2(args, message, tmp_path, capsys):
    args = list(args)
    if "--scenarios" in args:  # a scenario x with one bad line
        i = args.index("--scenarios") + 1
        args[i] = _bad_scenarios(tmp_path, f'[scenario.x]\ndescription = "d"\nbatch = 1\nseq = 8\n{args[i]}\n')
    code = run.run_tool(run.main, [*args, "--out", str(tmp_path / "r"), "--previous", str(tmp_path / "p")])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "p").exists()
