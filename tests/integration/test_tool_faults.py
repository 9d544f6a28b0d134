"""Issue 43, config location: ``eval --config DUMP/config.toml`` reads the run in the config file's folder (a copied
dump folder evaluated the original it was copied from, a moved one a folder that is gone), and eval and generate
say on stderr which checkpoint they read; an empty config is one line saying no checkpoint was found in the
default folder. The tools run in-process through ``cli.run_tool`` on a copy of the shared 4-step run."""

from __future__ import annotations

import json
import shutil

from trainer_utils import file_checksums

from torchtitan_ext.cli import EXIT_OK, EXIT_USER, run_tool
from torchtitan_ext.tools import eval as eval_tool
from torchtitan_ext.tools import generate as generate_tool


def _eval(capsys, config) -> tuple[int, dict | None, list[str]]:
    code = run_tool(eval_tool._main, ["--config", str(config), "--eval.steps", "1"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == EXIT_OK else None, out.err.strip().splitlines()


def test_eval_reads_a_copied_or_moved_dump_where_its_config_is(checkpointed_run, tmp_path, capsys):
    original = checkpointed_run
    kept = file_checksums(original)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(copy / "checkpoint" / "step-4")  # the copy's latest is step-2, the original's step-4
    code, res, err = _eval(capsys, copy / "config.toml")
    assert code == EXIT_OK and res["checkpoint"] == str(copy / "checkpoint" / "step-2")
    assert err == [f"eval: read checkpoint {copy / 'checkpoint' / 'step-2'} (the config file's folder; its "
                   f"job.dump_folder = '{original}' is another folder)"]
    # A moved dump folder: the folder its config.toml records is gone.
    moved = tmp_path / "moved"
    copy.rename(moved)
    toml = moved / "config.toml"
    toml.write_text(toml.read_text().replace(f"dump_folder = \"{original}\"", f"dump_folder = \"{copy}\""))
    code, res, err = _eval(capsys, toml)
    assert code == EXIT_OK and res["checkpoint"] == str(moved / "checkpoint" / "step-2")
    assert err == [f"eval: read checkpoint {moved / 'checkpoint' / 'step-2'} (the config file's folder; its "
                   f"job.dump_folder = '{copy}' is not a folder here)"]
    # The run's own config in its own folder: no note; an explicit --job.dump_folder is obeyed.
    code, res, err = _eval(capsys, original / "config.toml")
    assert code == EXIT_OK and err == [f"eval: read checkpoint {original / 'checkpoint' / 'step-4'}"]
    code = run_tool(eval_tool._main, ["--config", str(toml), "--eval.steps", "1", "--job.dump_folder", str(original)])
    assert code == EXIT_OK and json.loads(capsys.readouterr().out)["checkpoint"].startswith(str(original))
    assert file_checksums(original) == kept


def test_generate_says_which_checkpoint_it_read(checkpointed_run, capsys):
    code = run_tool(generate_tool._main, ["--checkpoint", str(checkpointed_run), "--prompt", "a",
                                          "--max-new-tokens", "2", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == EXIT_OK and out.out.startswith("a")
    assert out.err.strip().splitlines() == [f"generate: read checkpoint {checkpointed_run / 'checkpoint' / 'step-4'}"]


def test_empty_config_without_a_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    code = run_tool(eval_tool._main, ["--config", "empty.toml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USER and err == [
        "error: outputs/default: no complete checkpoint found there (no such folder; expected a dump folder with "
        "checkpoint/step-N/); that is the default job.dump_folder (evaluate a run with --config DUMP/config.toml)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.toml"]
