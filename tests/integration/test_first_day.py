"""First-day surprises (issue 64): ``python -m torchtitan_ext.train`` without arguments runs the README's
default job (the file ``launch/train.sh`` runs), or says in one line that this installation has none; the
start-up says which data the job reads, whatever the config's description says; a validation line names the
windows it scored."""

from __future__ import annotations

import json
import os
import subprocess

from trainer_utils import REPO, TEST_CACHE

from torchtitan_ext.cli import run_tool
from torchtitan_ext.config.job_config import DataSection
from torchtitan_ext.config.loader import parse_args, to_toml
from torchtitan_ext.data.registry import describe_data
from torchtitan_ext.errors import EXIT_USER
from torchtitan_ext.tools import train as train_tool
from torchtitan_ext.tools.train import main


def test_no_arguments_is_the_readme_default_job():
    assert train_tool.DEFAULT_JOB.relative_to(train_tool.DEFAULT_JOB.parents[1]).as_posix() == \
        "train_configs/debug.toml"
    assert to_toml(parse_args(train_tool.default_job([]))) == \
        to_toml(parse_args(["--config", str(train_tool.DEFAULT_JOB)]))
    assert train_tool.default_job(["--training.steps", "3"]) == ["--training.steps", "3"]  # overrides: as given


def test_no_arguments_trains_the_default_job_file(tmp_path, capsys, monkeypatch):
    """The default job swapped for a small one: no arguments train exactly that file, and its start-up names
    the data it reads, and its validation the windows scored (3 steps x 4 sequences)."""
    os.environ.pop("RANK", None)
    job = tmp_path / "default.toml"
    job.write_text(f"""[job]
dump_folder = "{tmp_path / 'run'}"
description = "a description written for other data"
[model]
flavor = "debug"
[training]
steps = 2
seq_len = 64
local_batch_size = 4
[metrics]
tensorboard = false
[checkpoint]
enabled = false
[eval]
steps = 3
[data]
tokenizer = "byte"
cache_dir = "{TEST_CACHE}"
""")
    monkeypatch.setattr(train_tool, "DEFAULT_JOB", job)
    assert main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"no arguments: the default job, --config {job}"
    assert out[1:3] == ["job: a description written for other data",
                        "data: the built-in corpus (the Python standard library's sources); tokenizer byte"]
    line = next(x for x in out if x.startswith("validation loss "))
    assert line.endswith(" over 12 windows of 64 tokens (eval.steps = 3)"), line
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["val_windows"] == 12


def test_no_default_job_in_the_installation_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train_tool, "DEFAULT_JOB", tmp_path / "train_configs" / "debug.toml")
    assert run_tool(train_tool._train, []) == EXIT_USER
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: no --config: give the job's TOML file (--config FILE; the default job {tmp_path}/train_configs/"
        "debug.toml is not in this installation); --help lists every key"]


def test_the_data_line_names_the_data_in_use():
    shards = DataSection(dataset="shards", train_path="data/mine/train_*.bin", val_path="data/mine/val_*.bin",
                         tokenizer="my_tok")
    assert describe_data(shards) == ("data: shards data/mine/train_*.bin, validation data/mine/val_*.bin; "
                                     "tokenizer my_tok")
    chat = DataSection(dataset="chat", train_path="chats.jsonl")
    assert describe_data(chat) == "data: conversations chats.jsonl, no validation data; tokenizer builtin"
    domains = DataSection(dataset="domains", domains=[{"name": "code", "train": "a"}, {"name": "prose", "train": "b"}])
    assert describe_data(domains) == "data: 2 weighted domains (code, prose); tokenizer builtin"


def test_the_coordinate_checks_plot_lands_in_the_ignored_outputs_folder():
    from torchtitan_ext.tools.coord_check import parser

    plot = parser().parse_known_args([])[0].plot
    assert plot == "outputs/coord_check.png"
    ignored = subprocess.run(["git", "check-ignore", "-q", plot], cwd=REPO)
    assert ignored.returncode == 0  # .gitignore keeps it out of the repository
