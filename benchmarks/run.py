"""Run benchmark scenarios and their baselines in one call; one JSON line per run in the results.

  python benchmarks/run.py NAME... [--steps N] [--out DIR] [--deadline S] [--runs RUN,...] [--commit SHA]
  python benchmarks/run.py --list
  python benchmarks/run.py --prepare-previous REF

NAME: a scenario of benchmarks/scenarios.toml (``--list`` prints them). Each scenario runs through
``python -m torchtitan_ext.train`` (``torch.distributed.run`` on more than one GPU), then each baseline it names:
``previous`` (this trainer at REF: ``--prepare-previous REF`` writes ``git archive REF`` into .bench_previous/,
which is untracked and not ignored, so it travels with the working tree to the device machine), ``plain`` (the
plain script: .ttbench/plain_llama.py or ../shared/bench/plain_llama.py, or --plain PATH) and ``torchtitan``
(torchtitan 0.2.0, importable or from the wheels in .whl/, with the configs of benchmarks/torchtitan/ and its
assets: benchmarks/torchtitan/assets, .ttbench/assets, or built by its make_assets.py).

Every run appends one line to DIR/<scenario>.jsonl (DIR: --out, default benchmarks/results) and, where the
environment sets OUT, to $OUT/<scenario>.jsonl as well, with the runs' logs in $OUT/logs.tar.gz: date, call
(shared by the runs of one call), scenario, run, device, gpus, commit, command, status (ok or failed), wall_s,
figures (benchmarks/steady.py: medians after the scenario's warm-up steps) and, for a failed run, error.
--deadline S: no run starts with under 60 s of S left, and none runs past it (a skipped run's line says so).
Exit code 0 when every run succeeded, 1 when one failed (its line says why), 2 for a bad argument or scenario.

On a GPU machine, from the repository root, with .whl/ (torchao, torchtitan 0.2.0 and its needs) and
.ttbench/ (the plain script, torchtitan's assets) carried:
  WHEELS=.whl source benchmarks/device_prelude.sh && python3 benchmarks/run.py dense_1b --deadline 540
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

import steady  # noqa: E402  (this folder)

from torchtitan_ext.cli import ArgumentParser, positive_whole, run_tool  # noqa: E402
from torchtitan_ext.errors import UserError  # noqa: E402

SCENARIOS = BENCH / "scenarios.toml"
TORCHTITAN = BENCH / "torchtitan"
PREVIOUS = ROOT / ".bench_previous"
BASELINES = ("previous", "plain", "torchtitan")
PLAIN_SCRIPTS = (ROOT / ".ttbench" / "plain_llama.py", ROOT.parent / "shared" / "bench" / "plain_llama.py")
TT_ASSETS = (TORCHTITAN / "assets", ROOT / ".ttbench" / "assets")
TT_SITE = Path("/tmp/tt_site")
MIN_START_S = 60  # under --deadline, a run starts only with this much time left
ERROR_LINES = 6  # a failed run's last log lines kept in its results line
KEYS = {"description": str, "gpus": int, "config": str, "trainer_args": str, "args": str, "batch": int, "seq": int,
        "steps": int, "warmup": int, "log_freq": int, "timeout_s": int, "baselines": list, "figures": list,
        "env": dict, "reference": str, "model_parallel": int, "launcher": str, "plain": dict, "torchtitan": dict}
LAUNCHERS = ("torchrun", "two_nodes", "two_nodes_one_host")

KIND = {str: "a string", int: "a whole number", list: "a list", dict: "a table"}


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    gpus: int
    config: str
    args: list[str]
    batch: int
    seq: int
    steps: int
    warmup: int
    log_freq: int
    timeout_s: int
    baselines: list[str]
    figures: list[str]
    env: dict[str, str] = field(default_factory=dict)
    reference: str | None = None
    model_parallel: int = 1
    launcher: str = "torchrun"
    plain: dict = field(default_factory=dict)
    torchtitan: dict = field(default_factory=dict)

    def trainer_args(self, config: str) -> list[str]:
        """The trainer's arguments, less the dump folder: ``config`` is the TOML file as that tree sees it."""
        return ["--config", config, *self.args, "--training.local_batch_size", str(self.batch),
                "--training.seq_len", str(self.seq), "--training.steps", str(self.steps),
                "--metrics.log_freq", str(self.log_freq)]


def load_scenarios(path: Path = SCENARIOS) -> dict[str, Scenario]:
    """Every scenario of ``path``, each over its [defaults]; a bad key or value is a UserError naming it."""
    with open(path, "rb") as f:
        table = tomllib.load(f)
    defaults = table.get("defaults", {})
    out = {}
    for name, own in table.get("scenario", {}).items():
        raw = {**defaults, **own}
        where = f"{path.name}: scenario.{name}"
        for key, value in raw.items():
            if key not in KEYS:
                raise UserError(f"{where}: unknown key {key!r} (expected one of {', '.join(KEYS)})")
            if not isinstance(value, KEYS[key]) or isinstance(value, bool):
                raise UserError(f"{where}.{key} = {value!r}: expected {KIND[KEYS[key]]}")
        missing = [k for k in ("batch", "seq", "description") if k not in raw]
        if missing:
            raise UserError(f"{where}: missing {', '.join(missing)}")
        if raw.get("launcher", "torchrun") not in LAUNCHERS:
            raise UserError(f"{where}.launcher = {raw['launcher']!r}: expected one of {', '.join(LAUNCHERS)}")
        if bad := [b for b in raw.get("baselines", []) if b not in BASELINES]:
            raise UserError(f"{where}.baselines: unknown {bad[0]!r} (expected {', '.join(BASELINES)})")
        for baseline in ("plain", "torchtitan"):
            if baseline in raw.get("baselines", []) and baseline not in raw:
                raise UserError(f"{where}: runs the {baseline} baseline but has no {baseline}.args")
        out[name] = Scenario(
            name=name, description=raw["description"], gpus=raw.get("gpus", 1), config=raw.get("config", ""),
            args=shlex.split(raw.get("trainer_args", "")) + shlex.split(raw.get("args", "")),
            batch=raw["batch"], seq=raw["seq"], steps=raw.get("steps", 30), warmup=raw.get("warmup", 10),
            log_freq=raw.get("log_freq", 5), timeout_s=raw.get("timeout_s", 300),
            baselines=raw.get("baselines", []), figures=raw.get("figures", []),
            env={k: str(v) for k, v in raw.get("env", {}).items()}, reference=raw.get("reference"),
            model_parallel=raw.get("model_parallel", 1), launcher=raw.get("launcher", "torchrun"),
            plain=raw.get("plain", {}), torchtitan=raw.get("torchtitan", {}))
    return out


@dataclass
class Call:
    """What the runs of one invocation share: where results and logs go, the clock, the commit and device."""

    out: Path
    work: Path
    commit: str | None
    plain_script: Path | None
    previous: Path
    deadline: float | None
    started: float = field(default_factory=time.monotonic)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    logs: list[Path] = field(default_factory=list)

    def limit(self, timeout_s: int) -> float | None:
        """Seconds the next run may take, or None when under MIN_START_S are left of the deadline."""
        if self.deadline is None:
            return timeout_s
        left = self.deadline - (time.monotonic() - self.started)
        return min(timeout_s, left) if left >= MIN_START_S else None


def git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def tree_commit(previous: Path) -> str | None:
    """This checkout's commit (``+dirty`` with uncommitted changes to tracked files); without git (the device
    machine's copy) the one --prepare-previous recorded as HEAD in ``previous``."""
    head = git("rev-parse", "--short=12", "HEAD")
    if head is not None:
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    recorded = previous / "HEAD_COMMIT"
    return recorded.read_text().strip() if recorded.is_file() else None


def prepare_previous(ref: str, folder: Path) -> str:
    """``git archive REF`` into ``folder`` (replacing what was there), with REF's commit in COMMIT and this
    checkout's in HEAD_COMMIT; returns the line to print."""
    commit = git("rev-parse", "--short=12", f"{ref}^{{commit}}")
    if commit is None:
        raise UserError(f"--prepare-previous {ref}: not a commit of this repository")
    head = tree_commit(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    (folder / "COMMIT").write_text(commit + "\n")
    if head is not None:
        (folder / "HEAD_COMMIT").write_text(head + "\n")
    return f"{folder}: the tree of {commit} ({ref}), the 'previous' baseline's"


def device_name(gpus: int) -> str:
    if gpus:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def launcher(gpus: int, module: str) -> list[str]:
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
                "-m", module]
    return [sys.executable, "-m", module]


def run_env(scenario: Scenario, pythonpath: list[Path]) -> dict[str, str]:
    env = {**os.environ, **scenario.env, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
    if scenario.gpus == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def execute(call: Call, name: str, cmd: list[str], cwd: Path, env: dict[str, str], limit: float) -> tuple[int, str]:
    """Run ``cmd`` into WORK/NAME.log with a time limit; (exit code, log text). 124: the limit was reached."""
    log = call.work / f"{name}.log"
    call.logs.append(log)
    with open(log, "w") as f:
        process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:  # the run's whole process group: torchrun's workers too
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            rc = 124
    return rc, log.read_text(errors="replace")


def failure(rc: int, log: str, limit: float) -> str:
    if rc == 124:
        return f"stopped at its limit of {limit:.0f} s"
    lines = [line for line in log.splitlines() if line.strip()]
    return f"exit {rc}: " + " | ".join(lines[-ERROR_LINES:])


def ours(call: Call, scenario: Scenario, run: str, limit: float) -> dict:
    """Our trainer (``run`` = ours) or the previous commit's (``run`` = previous) on the scenario."""
    tree = ROOT if run == "ours" else call.previous
    if run == "previous" and not (tree / "torchtitan_ext").is_dir():
        return {"status": "failed", "error": f"no previous tree in {tree}: run "
                                             "`python benchmarks/run.py --prepare-previous REF` first"}
    folder = call.work / f"{scenario.name}_{run}"
    shutil.rmtree(folder, ignore_errors=True)
    if scenario.launcher == "torchrun":
        launch = launcher(scenario.gpus, "torchtitan_ext.train")
    else:  # two torchrun agents on this host, seen by NCCL as two nodes (or as one: two_nodes_one_host)
        launch = ["bash", str(tree / "benchmarks" / "two_nodes.sh"), *(["--cpu"] if scenario.gpus == 0 else []),
                  *(["--no-hostid"] if scenario.launcher == "two_nodes_one_host" else []),
                  "--logs", f"{folder}.agents", "--"]
    cmd = [*launch, *scenario.trainer_args(scenario.config), "--job.dump_folder", str(folder)]
    start = time.monotonic()
    rc, log = execute(call, folder.name, cmd, tree, run_env(scenario, [tree]), limit)
    out = {"command": shlex.join(cmd), "wall_s": round(time.monotonic() - start, 1)}
    if run == "previous":
        out["commit"] = (tree / "COMMIT").read_text().strip() if (tree / "COMMIT").is_file() else None
    if rc != 0:
        return {**out, "status": "failed", "error": failure(rc, log, limit)}
    if not (folder / "metrics.jsonl").is_file():
        return {**out, "status": "failed", "error": f"exit 0 but no {folder.name}/metrics.jsonl"}
    processes = scenario.gpus or (4 if scenario.launcher != "torchrun" else 1)  # two_nodes.sh --cpu: 2 x 2
    rows = steady.metrics_rows(folder / "metrics.jsonl")
    result = measured(scenario, steady.windows(rows, processes), processes)
    if result["status"] == "ok":
        result["figures"].update(steady.validation(rows))
    return {**out, **result}


def measured(scenario: Scenario, windows: list[steady.Window], processes: int) -> dict:
    try:
        figures = steady.figures(windows, scenario.warmup)
    except steady.NoSteadyWindows as e:
        return {"status": "failed", "error": str(e)}
    figures["tokens_per_sec"] = figures["tokens_per_sec_per_device"] * processes
    return {"status": "ok", "figures": figures}


def plain(call: Call, scenario: Scenario, limit: float) -> dict:
    """The plain script at the scenario's shape: ``plain.args`` and the steps after the warm-up, timed."""
    if call.plain_script is None:
        return {"status": "failed", "error": "no plain script: give --plain PATH (plain_llama.py of ../shared/bench; "
                                             "copy it into .ttbench/ to take it to the device machine)"}
    cmd = [sys.executable, str(call.plain_script), *shlex.split(scenario.plain.get("args", "")),
           "--batch", str(scenario.batch), "--steps", str(scenario.steps - scenario.warmup)]
    start = time.monotonic()
    rc, log = execute(call, f"{scenario.name}_plain", cmd, ROOT, run_env(scenario, []), limit)
    out = {"command": shlex.join(cmd), "wall_s": round(time.monotonic() - start, 1)}
    if rc != 0:
        return {**out, "status": "failed", "error": failure(rc, log, limit)}
    printed = [line for line in log.splitlines() if line.startswith("{")]
    if not printed:
        return {**out, "status": "failed", "error": "the plain script printed no JSON line"}
    result = json.loads(printed[-1])
    if result.get("seq") != scenario.seq:
        return {**out, "status": "failed",
                "error": f"the plain script ran seq {result.get('seq')}, the scenario's is {scenario.seq}"}
    figures = {"tokens_per_sec": result["tok_s"], "tokens_per_sec_per_device": result["tok_s"],
               "mfu": result["mfu_989"], "peak_memory_gib": result["peak_gib"], "final_loss": result["loss"]}
    return {**out, "status": "ok", "figures": figures}


def torchtitan_ready(call: Call) -> tuple[list[Path], Path] | str:
    """torchtitan importable (as installed, or from .whl/ into TT_SITE) and its assets: (PYTHONPATH, assets),
    or why not."""
    site = [TT_SITE, TORCHTITAN]
    probe = [sys.executable, "-c", "import torchtitan"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, site))}
    if subprocess.run(probe, env=env, capture_output=True).returncode != 0:
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if not any(w.name.startswith("torchtitan-0.2.0") for w in wheels):
            return "torchtitan is not importable and .whl/ has no torchtitan-0.2.0 wheel (carry .whl)"
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                              "--target", str(TT_SITE), *map(str, wheels)], capture_output=True, text=True)
        if pip.returncode != 0:
            return f"installing the wheels of .whl/ failed: {pip.stderr.strip().splitlines()[-1:]}"
    for assets in (*TT_ASSETS, call.work / "tt_assets"):
        if (assets / "c4_local" / "train.jsonl").is_file():
            return site, assets
    made = subprocess.run([sys.executable, str(TORCHTITAN / "make_assets.py"), str(call.work / "tt_assets")], env=env,
                          capture_output=True, text=True)
    if made.returncode != 0:
        return f"building torchtitan's assets failed: {made.stderr.strip().splitlines()[-1:]}"
    return site, call.work / "tt_assets"


def torchtitan(call: Call, scenario: Scenario, limit: float) -> dict:
    ready = torchtitan_ready(call)
    if isinstance(ready, str):
        return {"status": "failed", "error": ready}
    site, assets = ready
    folder = call.work / f"{scenario.name}_torchtitan"
    shutil.rmtree(folder, ignore_errors=True)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
              str(max(scenario.gpus, 1)), "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
              "-m", "torchtitan.train"]  # rank 0's lines alone, as torchtitan's run_train.sh keeps them
    cmd = [*launch, "--job.config_file", scenario.torchtitan.get("config", "llama3.toml"),
           "--job.dump_folder", str(folder), "--model.hf_assets_path", str(assets / "tokenizer"),
           "--training.dataset_path", str(assets / "c4_local"), "--training.steps", str(scenario.steps),
           "--training.local_batch_size", str(scenario.batch), "--training.seq_len", str(scenario.seq),
           "--metrics.log_freq", str(scenario.log_freq), *shlex.split(scenario.torchtitan.get("args", ""))]
    start = time.monotonic()
    rc, log = execute(call, folder.name, cmd, TORCHTITAN, run_env(scenario, site), limit)
    out = {"command": shlex.join(cmd), "wall_s": round(time.monotonic() - start, 1), "version": "torchtitan 0.2.0"}
    if rc != 0:
        return {**out, "status": "failed", "error": failure(rc, log, limit)}
    tokens_per_step = scenario.batch * scenario.seq // scenario.model_parallel  # a device's
    return {**out, **measured(scenario, steady.torchtitan(log, tokens_per_step), max(scenario.gpus, 1))}


def run_scenario(call: Call, scenario: Scenario, device: str, only: list[str] | None) -> list[dict]:
    """Ours, then each baseline (those of ``only``, when given); one results line each, written as it finishes."""
    lines = []
    for run in (r for r in ("ours", *scenario.baselines) if only is None or r in only):
        limit = call.limit(scenario.timeout_s)
        if limit is None:
            result = {"status": "failed", "error": f"skipped: under {MIN_START_S} s left of --deadline"}
        elif run in ("ours", "previous"):
            result = ours(call, scenario, run, limit)
        elif run == "plain":
            result = plain(call, scenario, limit)
        else:
            result = torchtitan(call, scenario, limit)
        if "figures" in result:  # the scenario's figures, in its order, rounded
            kept = scenario.figures or list(result["figures"])
            result["figures"] = {k: round(result["figures"][k], 4) for k in kept if k in result["figures"]}
        line = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "call": call.id,
                "scenario": scenario.name, "run": run, "device": device, "gpus": scenario.gpus,
                "commit": call.commit, "steps": scenario.steps, "warmup": scenario.warmup, **result}
        if scenario.reference:
            line["reference"] = scenario.reference
        write(call, scenario.name, line)
        print(summary_line(line), flush=True)
        lines.append(line)
    return lines


def write(call: Call, scenario: str, line: dict) -> None:
    folders = [call.out] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{scenario}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def summary_line(line: dict) -> str:
    head = f"{line['scenario']} {line['run']}: "
    if line["status"] != "ok":
        return head + line.get("error", "failed")
    fig = line["figures"]
    parts = [f"{fig[k]:,.0f} tokens/s" if k == "tokens_per_sec" else f"{k} {fig[k]:.4g}" for k in fig]
    return head + ", ".join(parts)


def run_names(raw: str) -> list[str]:
    """argparse type: a comma-separated list of ours and the baselines."""
    names = [n for n in raw.split(",") if n]
    if not names or any(n not in ("ours", *BASELINES) for n in names):
        raise argparse.ArgumentTypeError(f"expected names among ours, {', '.join(BASELINES)}, got {raw!r}")
    return names


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python benchmarks/run.py", description=__doc__)
    p.add_argument("names", nargs="*", metavar="NAME", help="scenarios of benchmarks/scenarios.toml")
    p.add_argument("--steps", type=positive_whole, help="steps of every run (more than each scenario's warmup)")
    p.add_argument("--out", type=Path, default=BENCH / "results", help="where <scenario>.jsonl is appended")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_runs"), help="run folders and logs")
    p.add_argument("--deadline", type=positive_whole, metavar="S", help="seconds for the whole call")
    p.add_argument("--commit", help="the commit to record (default: git's, or .bench_previous/HEAD_COMMIT)")
    p.add_argument("--runs", type=run_names, metavar="RUN,...",
                   help="run only these of ours, previous, plain, torchtitan (default: all the scenario names)")
    p.add_argument("--plain", type=Path, help="the plain script (default: .ttbench/ or ../shared/bench/)")
    p.add_argument("--list", action="store_true", help="print the scenarios and exit")
    p.add_argument("--prepare-previous", metavar="REF", help="write REF's tree into the --previous folder, exit")
    p.add_argument("--previous", type=Path, default=PREVIOUS, metavar="DIR",
                   help="the previous commit's tree (default .bench_previous/ of the repository)")
    p.add_argument("--scenarios", type=Path, default=SCENARIOS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if ns.prepare_previous:
        print(prepare_previous(ns.prepare_previous, ns.previous.resolve()))
        return 0
    scenarios = load_scenarios(ns.scenarios)
    if ns.list:
        for s in scenarios.values():
            where = f"{s.gpus} GPU{'s' if s.gpus > 1 else ''}" if s.gpus else "CPU"
            print(f"{s.name:<24} {where:<7} {s.description}")
        return 0
    if not ns.names:
        raise UserError("no scenario named (python benchmarks/run.py --list prints them)")
    if unknown := [n for n in ns.names if n not in scenarios]:
        raise UserError(f"unknown scenario {unknown[0]!r} (expected one of {', '.join(scenarios)})")
    chosen = [scenarios[n] for n in dict.fromkeys(ns.names)]
    if ns.steps is not None:
        if short := [s for s in chosen if ns.steps <= s.warmup]:
            raise UserError(f"--steps {ns.steps}: scenario {short[0].name} warms up for {short[0].warmup} steps; "
                            f"expected more")
        chosen = [Scenario(**{**s.__dict__, "steps": ns.steps}) for s in chosen]
    if ns.plain is not None and not ns.plain.is_file():
        raise UserError(f"--plain {ns.plain}: no such file")
    plain_script = ns.plain or next((p for p in PLAIN_SCRIPTS if p.is_file()), None)
    call = Call(out=ns.out.resolve(), work=(ns.work / time.strftime("%Y%m%d-%H%M%S")).resolve(),
                commit=ns.commit or tree_commit(ns.previous), plain_script=plain_script,
                previous=ns.previous.resolve(), deadline=ns.deadline)
    call.work.mkdir(parents=True, exist_ok=True)
    failed = 0
    try:
        for scenario in chosen:
            lines = run_scenario(call, scenario, device_name(scenario.gpus), ns.runs)
            failed += sum(line["status"] != "ok" for line in lines)
    finally:
        if os.environ.get("OUT") and call.logs:
            with tarfile.open(Path(os.environ["OUT"]) / "logs.tar.gz", "w:gz") as tar:
                for log in call.logs:
                    tar.add(log, arcname=log.name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
