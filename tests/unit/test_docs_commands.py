"""Every fenced command in README.md and docker/README.md runs as written here or is listed, with the reason,
in NOT_IN_CI: the test fails on a fenced command that is in neither table, and on a table entry that no
longer matches a fenced command, so the tables follow the docs.

Command fences are those without a language (or sh / bash); a line is one command (a trailing ``\\``
continues it), its ``  # comment`` dropped. Unlabelled fences that are not commands are listed by their
first line in NOT_COMMANDS. The commands in CI run in README order in one scratch folder that holds the
repository's launch/, train_configs/ and torchtitan_ext/ (so outputs/ and hf/ land there), on CPU, with
``python`` and ``python3`` this interpreter; training commands get the overrides in SHRINK appended (2 steps
of the debug model on byte tokens, 64-token sequences: seconds instead of the default job's minutes). The
lm-evaluation-harness lines and the transformers snippet run in the ``slow`` test on the same folder, with
the task files the README shows."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_utils import REPO, TEST_CACHE

DOCS = ("README.md", "docker/README.md")
SHRINK = ("--data.tokenizer", "byte", "--data.cache_dir", str(TEST_CACHE), "--training.steps", "2",
          "--training.seq_len", "64", "--training.local_batch_size", "2", "--eval.steps", "1",
          "--metrics.log_freq", "1")

# command -> arguments appended when CI runs it
CI = {
    "launch/train.sh": SHRINK,
    "python -m torchtitan_ext.eval --config outputs/debug/config.toml": (),
    "python -m torchtitan_ext.train --config train_configs/sft_debug.toml":  # from outputs/debug, so its tokens
        ("--data.tokenizer", "byte", "--data.cache_dir", str(TEST_CACHE), "--training.steps", "2",
         "--metrics.log_freq", "1"),
    "python -m torchtitan_ext.train --help": (),
    "python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug": (),
}
# run by the slow test, in this order, as one shell script
SLOW = (
    "python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug-fp32 --dtype float32",
    "EOT=$(python -c \"import json; print(json.load(open('hf/debug-fp32/generation_config.json'))['eos_token_id'])\")",
    "lm_eval --model hf --model_args pretrained=hf/debug-fp32,dtype=float32,trust_remote_code=True,"
    "prefix_token_id=$EOT --tasks my_task --include_path my_tasks --batch_size 8 --log_samples --output_path results",
)
WALKTHROUGH = "tests/integration/test_walkthrough.py runs exactly these lines on files it makes"
DOCKER = ("an engine and a GPU image: docker/test.sh builds and runs the image with podman, outside CI's time "
          "budget (docker/run.sh's arguments: tests/integration/test_docker_files.py)")
NOT_IN_CI = {
    "git clone <this repository's URL> torchtitan_ext && cd torchtitan_ext": "network; CI runs in a clone",
    "python3 -m venv .venv && . .venv/bin/activate": "CI's own environment is made this way",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e '.[dev]'":
        "network; CI's own environment is made this way",
    "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128 && pip install -e '.[dev]'":
        "network; CUDA wheels for GPU machines",
    "docker build -f docker/Dockerfile -t torchtitan_ext . && docker/run.sh": DOCKER,
    "docker build -f docker/Dockerfile -t torchtitan_ext .": DOCKER,
    "docker/run.sh": DOCKER,
    "docker/run.sh launch/train.sh --config train_configs/600m.toml": DOCKER,
    "podman build -f docker/Dockerfile -t torchtitan_ext .": DOCKER,
    "DOCKER=podman docker/run.sh launch/train.sh --config train_configs/600m.toml": DOCKER,
    "launch/test.sh": "the test suite itself (this test is part of it)",
    "launch/train.sh --config train_configs/600m.toml --training.steps 1000": "GPU (bf16, compiled 600M model)",
    "NNODES=4 MASTER_ADDR=node0 launch/train.sh --config train_configs/7b.toml": "cluster: 4 nodes of 8 GPUs",
    "sbatch --nodes=4 launch/slurm.sbatch --config train_configs/7b.toml":
        "cluster (Slurm); its preemption path: tests/integration/test_slurm_forwarding.py",
    "python -m torchtitan_ext.data.prepare --input 'corpus/*.parquet' --tokenizer my_tok --output-dir data/mine "
    "--val-shards 1 --shard-tokens 20000 --workers 2": WALKTHROUGH,
    "python -m torchtitan_ext.train --config train_configs/debug.toml --data.dataset shards --data.train_path "
    "'data/mine/train_*.bin' --data.val_path 'data/mine/val_*.bin' --data.tokenizer my_tok --training.steps 60 "
    "--job.dump_folder outputs/mine": WALKTHROUGH,
    "python -m torchtitan_ext.eval --config outputs/mine/config.toml --eval.steps 4": WALKTHROUGH,
    "python -m torchtitan_ext.generate --checkpoint outputs/mine --prompt 'The ' --max-new-tokens 32": WALKTHROUGH,
    **{command: "slow test in this file (lm-evaluation-harness: about a minute)" for command in SLOW},
}
NOT_COMMANDS = {"torchtitan_ext/": "the Architecture section's package tree"}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.M | re.S)


def fences(doc: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((REPO / doc).read_text())]


def commands(doc: str) -> list[str]:
    found = []
    for lang, body in fences(doc):
        if lang not in ("", "sh", "bash") or body.split("\n", 1)[0].strip() in NOT_COMMANDS:
            continue
        for line in re.sub(r"\\\n\s*", "", body).splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                found.append(line)
    return found


def test_every_fenced_command_is_run_or_listed():
    documented = [c for doc in DOCS for c in commands(doc)]
    unlisted = [c for c in documented if c not in CI and c not in NOT_IN_CI]
    assert not unlisted, f"fenced commands neither run in CI nor listed in NOT_IN_CI: {unlisted}"
    stale = [c for c in [*CI, *NOT_IN_CI] if c not in documented]
    assert not stale, f"table entries no longer in the docs: {stale}"
    assert not set(CI) & set(NOT_IN_CI)


def _env(folder: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
            "VENV": str(folder / "no-venv"), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _sh(folder: Path, script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder, env=_env(folder),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The CI commands, in README order, in a scratch folder: (folder, command -> its result)."""
    folder = tmp_path_factory.mktemp("docs")
    for name in ("launch", "train_configs", "torchtitan_ext", "pyproject.toml"):
        (folder / name).symlink_to(REPO / name)
    results = {}
    for command in dict.fromkeys(c for c in commands("README.md") if c in CI):
        extra = " ".join(f"'{a}'" for a in CI[command])
        results[command] = _sh(folder, f"{command} {extra}")
    return folder, results


def test_ci_commands_run_as_written(ran):
    folder, results = ran
    assert set(results) == set(CI)
    assert (folder / "outputs" / "debug" / "checkpoint" / "step-2").is_dir()
    assert (folder / "outputs" / "debug" / "tb").is_dir() and (folder / "outputs" / "debug" / "metrics.jsonl").is_file()
    evaluated = json.loads(results["python -m torchtitan_ext.eval --config outputs/debug/config.toml"]
                           .stdout.strip().splitlines()[-1])
    assert math.isfinite(evaluated["val_loss"]) and evaluated["checkpoint"].endswith("step-2")
    assert "--training.steps" in results["python -m torchtitan_ext.train --help"].stdout
    sft = results["python -m torchtitan_ext.train --config train_configs/sft_debug.toml"].stdout
    assert "initial weights from outputs/debug/checkpoint/step-2" in sft and "chat data: 54 conversations" in sft
    assert (folder / "outputs" / "sft_debug" / "metrics.jsonl").is_file()
    weights = folder / "hf" / "debug" / "model.safetensors"
    mask = os.umask(0o022)
    os.umask(mask)
    assert weights.stat().st_mode & 0o777 == 0o666 & ~mask  # readable as the umask allows, not 0600


@pytest.mark.slow
def test_lm_eval_and_transformers_lines(ran):
    folder, _ = ran
    readme = fences("README.md")
    (folder / "my_tasks").mkdir()
    task = next(body for lang, body in readme if lang == "yaml" and body.startswith("# my_tasks/my_task.yaml"))
    (folder / "my_tasks" / "my_task.yaml").write_text(task)
    (folder / "my_tasks" / "my_task.jsonl").write_text(next(body for lang, body in readme if lang == "jsonl"))
    assert all(c in commands("README.md") for c in SLOW)
    _sh(folder, "\n".join(SLOW))
    results = list((folder / "results").rglob("results_*.json"))
    assert results, "lm_eval wrote no results"
    scores = json.loads(results[0].read_text())["results"]["my_task"]
    assert math.isfinite(scores["perplexity,none"])
    snippet = next(body for lang, body in readme if lang == "python" and "AutoModelForCausalLM" in body)
    out = _sh(folder, f"python - <<'EOF'\n{snippet}EOF").stdout
    assert out.startswith("def main("), out
