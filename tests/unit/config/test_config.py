"""Config loading: TOML + CLI overrides, every error path is one line with exit code 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from trainer_utils import REPO

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.config.loader import help_text, load_toml, parse_args, to_toml
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.flavors import get_flavor
from torchtitan_ext.parallel.pp import layer_ranges
from torchtitan_ext.parallel.tp import check_tp


def test_toml_and_overrides(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 1e-3\n'
                 '[float8]\nfilter_fqns = ["output", "w2"]\n')
    cfg = parse_args(["--config", str(f), "--training.steps", "9", "--optimizer.beta2=0.99",
                      "--training.compile", "true", "--float8.filter_fqns", "output,wo"])
    assert cfg.training.steps == 9 and cfg.training.seq_len == 128
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.beta2 == 0.99
    assert cfg.training.compile is True
    assert cfg.float8.filter_fqns == ["output", "wo"]


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_args(["--training.steps", "3", "--data.tokenizer", "byte", "--parallelism.pp_split_points",
                      '["layers.2"]'])
    out = tmp_path / "config.toml"
    out.write_text(to_toml(cfg))
    again = JobConfig()
    load_toml(again, str(out))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("content, args, message", [
    ("[trainig]\nsteps = 3\n", [], "unknown section [trainig]; did you mean 'training'?"),
    ("[training]\nstep = 3\n", [], "unknown key 'training.step'; did you mean 'steps'?"),
    ("[training]\nsteps = \"ten\"\n", [], "training.steps: expected int, got 'ten'"),
    ("[training]\nsteps = 0\n", [], "training.steps: 0 is below the minimum 1"),
    ("[optimizer]\nbeta2 = 1.5\n", [], "optimizer.beta2: 1.5 is above the maximum 1.0"),
    ("[lr_scheduler]\nname = \"linear\"\n", [], "lr_scheduler.name: 'linear' is not one of"),
    ("[training\nsteps = 3\n", [], "TOML syntax error"),
    ("", ["--training.max_norm", "abc"], "argument --training.max_norm: training.max_norm: expected float"),
    ("", ["--training.compile", "maybe"], "expected bool, got 'maybe'"),
    ("", ["--steps", "3"], "expected --section.key"),
])
def test_bad_config_is_one_line(tmp_path, content, args, message):
    f = tmp_path / "bad.toml"
    f.write_text(content)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(f), *args])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file nope.toml: not found"):
        parse_args(["--config", "nope.toml"])


def test_cli_exit_code_2_without_traceback(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[training]\nlr = 3\n")
    proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", "--config", str(f)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {f}: unknown key 'training.lr'")
    assert "Traceback" not in proc.stderr


def test_help_lists_every_key():
    text = help_text()
    for sec in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(sec.default_factory()):
            assert f"--{sec.name}.{f.name} = " in text
    proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", "--help"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "--training.steps = 200" in proc.stdout


@pytest.mark.parametrize("path", sorted(str(p) for p in (REPO / "train_configs").glob("*.toml")))
def test_shipped_configs_load(path):
    """Every shipped job parses, names an existing flavor, and its layout divides the model."""
    cfg = parse_args(["--config", path])
    args = get_flavor(cfg.model.flavor)
    if cfg.parallelism.tp > 1 and args.vocab_size:
        check_tp(args, cfg.parallelism.tp)
    if cfg.parallelism.pp > 1:
        layer_ranges(args.n_layers, cfg.parallelism.pp * cfg.parallelism.pp_virtual_stages, [])
