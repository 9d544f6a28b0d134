"""The ``torchtitan-ext`` console script that pyproject.toml's ``[project.scripts]`` names, run in process:
its tool table, each tool's ``--help`` and the one-line refusal of an unknown tool."""

from __future__ import annotations

import importlib
import sys

import pytest
from trainer_utils import REPO

from torchtitan_ext import cli
from torchtitan_ext.tools.__main__ import TOOLS

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def _entry_point():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, attribute = scripts["torchtitan-ext"].split(":")
    return getattr(importlib.import_module(module), attribute)


def _exit_code(code: int) -> None:
    raise SystemExit(code)


def _run(monkeypatch, *argv: str) -> int:
    """The console script on ``argv`` as pip's wrapper runs it; its exit code (``cli.exit_now`` would end
    this process, so it raises SystemExit here)."""
    monkeypatch.setattr(sys, "argv", ["torchtitan-ext", *argv])
    monkeypatch.setattr(cli, "exit_now", _exit_code)
    with pytest.raises(SystemExit) as exited:
        _entry_point()()
    return exited.value.code


def test_help_lists_every_tool(monkeypatch, capsys):
    assert _run(monkeypatch, "--help") == 0
    out = capsys.readouterr().out
    assert "torchtitan-ext <tool> [arguments]" in out
    listed = [line.split()[0] for line in out.split("tools:\n", 1)[1].splitlines()]
    assert listed == list(TOOLS)


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_tool_answers_help(monkeypatch, capsys, tool):
    assert _run(monkeypatch, tool, "--help") == 0
    out = capsys.readouterr().out
    if tool == "train":
        assert "--training.steps" in out and "--parallelism.tp" in out
    else:
        assert out.startswith(f"usage: python -m torchtitan_ext.{tool}")


def test_train_subcommand_refuses_an_unknown_key(monkeypatch, capsys):
    assert _run(monkeypatch, "train", "--config", str(REPO / "train_configs" / "debug.toml"),
                "--training.step", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "'training.step'" in err


def test_unknown_tool_is_one_line_and_exit_code_2(monkeypatch, capsys):
    assert _run(monkeypatch, "trian") == 2
    assert capsys.readouterr().err == f"error: unknown tool 'trian'; expected one of: {', '.join(TOOLS)}\n"
