"""Issue 43, inputs that are not what they claim, at the tools' boundary (``cli.run_tool``, in process): a repeated
``--config``, a non-UTF-8 byte in a TOML file, a launcher variable that is not a number and an unknown
``WANDB_MODE`` are each one ``error:`` line naming the file or variable, exit code 2, and nothing on disk changes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from torchtitan_ext.cli import run_tool
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED, EXIT_USER, ConfigError, RunStopped
from torchtitan_ext.tools import eval as eval_tool
from torchtitan_ext.tools import train as train_tool
from torchtitan_ext.train.preemption import InterruptedAgain, StartupInterrupted


def _sums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(capsys, code: int) -> str:
    """The single stderr line of a tool that stopped with exit code 2, without its ``error: `` prefix."""
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USER and len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0].removeprefix("error: ")


def test_each_ending_has_its_exit_code_from_errors(capsys):
    """The one table of exit codes (errors.py): what the tools' boundary returns for each ending, and the
    trainer's stop requests."""
    def raising(exc: BaseException):
        def main(argv: list[str]) -> int:
            raise exc
        return main

    assert (EXIT_OK, EXIT_USER, EXIT_STOPPED, EXIT_INTERRUPTED) == (0, 2, 3, 130)
    assert run_tool(lambda argv: None, []) == EXIT_OK
    assert run_tool(raising(ConfigError("model.dim: 0 is below the minimum 1")), []) == EXIT_USER
    assert run_tool(raising(RunStopped("loss is NaN at step 3")), []) == EXIT_STOPPED
    assert run_tool(raising(KeyboardInterrupt()), []) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.splitlines() == ["error: model.dim: 0 is below the minimum 1",
                                                    "error: loss is NaN at step 3",
                                                    "error: interrupted (SIGINT): stopped at once"]
    assert (StartupInterrupted.exit_code, InterruptedAgain.exit_code) == (EXIT_OK, EXIT_INTERRUPTED)


@pytest.fixture
def two_configs(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(f'[job]\ndump_folder = "{tmp_path / "out_a"}"\n[training]\nsteps = 3\n')
    b.write_text(f'[job]\ndump_folder = "{tmp_path / "out_b"}"\n[training]\nsteps = 5\n')
    return a, b


def test_repeated_config_names_both_files(tmp_path, two_configs, capsys):
    a, b = two_configs
    before = _sums(tmp_path)
    expected = (f"argument --config: given twice ({a}, then {b}); give one file and override its keys with "
                "--section.key value")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(a), "--training.steps", "4", "--config", str(b)])
    assert str(e.value) == expected
    # The trainer reads its arguments with the loader; eval (like teacher, plan, coord_check, scaling sweep)
    # with argparse first, which kept the last --config.
    assert _one_error(capsys, run_tool(train_tool._train, ["--config", str(a), "--config", str(b)])) == expected
    assert _one_error(capsys, run_tool(eval_tool._main, ["--config", str(a), f"--config={b}"])) == expected
    assert _sums(tmp_path) == before and not (tmp_path / "out_a").exists() and not (tmp_path / "out_b").exists()


def test_non_utf8_toml_names_the_file_and_offset(tmp_path, capsys):
    f = tmp_path / "job.toml"
    f.write_bytes(f'[job]\ndump_folder = "{tmp_path / "out"}"\n# caf\xe9 (Latin-1)\n'.encode("latin-1"))
    offset = f.read_bytes().index(b"\xe9")
    before = _sums(tmp_path)
    line = _one_error(capsys, run_tool(train_tool._train, ["--config", str(f)]))
    assert line == f"config file {f}: not UTF-8 text: byte 0xe9 at offset {offset} (line 3); TOML files are UTF-8"
    assert _sums(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, value, expected", [
    ("WORLD_SIZE", "abc", "environment variable WORLD_SIZE='abc': expected a whole number >= 1"),
    ("RANK", "abc", "environment variable RANK='abc': expected a whole number >= 0"),
    ("LOCAL_RANK", "1.5", "environment variable LOCAL_RANK='1.5': expected a whole number >= 0"),
    ("WORLD_SIZE", "0", "environment variable WORLD_SIZE='0': expected a whole number >= 1"),
])
def test_launcher_variable_not_a_number(tmp_path, monkeypatch, capsys, name, value, expected):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    missing = ["--config", str(tmp_path / "job.toml"), "--job.dump_folder", str(tmp_path / "out")]  # never read
    line = _one_error(capsys, run_tool(train_tool._train, missing))
    assert line == f"{expected} (torchrun sets it; unset it for a plain one-process run)"
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "2")  # numbers, but not a rank of that world
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = _one_error(capsys, run_tool(eval_tool._main, missing))
    assert line == "environment variable RANK=2: expected below WORLD_SIZE=2"


def test_unknown_wandb_mode_is_one_line_before_the_folder_is_touched(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    from torchtitan_ext.metrics.wandb_sink import tracking_sinks

    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "config.toml").write_text("[training]\nsteps = 3\n")  # a previous start's, left as it is
    before = _sums(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "bogus")
    expected = "metrics.wandb: environment variable WANDB_MODE='bogus': expected online, offline or disabled"
    code = run_tool(train_tool._train, ["--job.dump_folder", str(dump), "--metrics.wandb", "true"])
    assert _one_error(capsys, code) == expected
    cfg = parse_args(["--job.dump_folder", str(dump), "--metrics.wandb", "true"])
    for rank in (0, 1):  # every rank stops, not only the one that would log
        with pytest.raises(ConfigError) as e:
            tracking_sinks(cfg, rank)
        assert str(e.value) == expected
    assert _sums(tmp_path) == before and sorted(p.name for p in dump.iterdir()) == ["config.toml"]
