"""Issue 43, config location: ``eval --config DUMP/config.toml`` reads the run in the config file's folder (a copied
dump folder evaluated the original it was copied from, a moved one a folder that is gone), and eval and generate
say on stderr which checkpoint they read; an empty config is one line saying no checkpoint was found in the
default folder. The tools run in-process through ``cli.run_tool`` on a copy of the shared 4-step run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import numpy as np
from trainer_utils import file_checksums

from torchtitan_ext.cli import run_tool
from torchtitan_ext.data.shards import write_shard
from torchtitan_ext.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER, ConfigError
from torchtitan_ext.hf import export as hf_export
from torchtitan_ext.tools import eval as eval_tool
from torchtitan_ext.tools import export as export_tool
from torchtitan_ext.tools import generate as generate_tool
from torchtitan_ext.tools import quant_export as quant_export_tool
from torchtitan_ext.tools import teacher as teacher_tool


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


def _export(capsys, checkpoint, output, *extra: str) -> tuple[int, list[str]]:
    code = run_tool(export_tool._main, ["--checkpoint", str(checkpoint), "--output", str(output), "--dtype", "float32",
                                        "--max-shard-size", "2MB", *extra])
    return code, capsys.readouterr().err.strip().splitlines()


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(checkpointed_run, tmpfs, capsys):
    """A real 4 MiB filesystem: the 13 MB float32 export fills it at its third 2 MB shard. safetensors said that
    as a SafetensorError traceback; now one line naming the shard and ENOSPC, exit 2, no folder left, the
    checkpoint unchanged."""
    kept = file_checksums(checkpointed_run)
    fs = tmpfs("4m")
    code, err = _export(capsys, checkpointed_run, fs / "hf")
    assert code == EXIT_USER and len(err) == 1, err
    assert re.fullmatch(rf"error: export failed: {fs}/\.hf\.tmp-\d+/model-00003-of-00008\.safetensors: No space "
                        rf"left on device \(ENOSPC\); nothing written at {fs}/hf \(the partial folder was removed\); "
                        r"the checkpoint is untouched", err[0]), err
    assert list(fs.iterdir()) == []
    assert file_checksums(checkpointed_run) == kept


def test_export_ctrl_c_stops_with_130_and_leaves_nothing(checkpointed_run, tmp_path, capsys, monkeypatch,
                                                         restore_signal_handlers):
    """A real SIGINT to the process while the second shard is written: one line, exit 130, no output folder or
    temporary one beside it, the checkpoint unchanged; a rerun then completes."""
    kept = file_checksums(checkpointed_run)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    write_shard, calls = hf_export.write_shard, []

    def interrupted(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        write_shard(path, tensors)

    monkeypatch.setattr(hf_export, "write_shard", interrupted)
    code, err = _export(capsys, checkpointed_run, tmp_path / "hf")
    assert code == EXIT_INTERRUPTED and err == [
        f"error: interrupted (SIGINT): export stopped; nothing written at {tmp_path / 'hf'} (the partial folder was "
        "removed); the checkpoint is untouched"], err
    assert list(tmp_path.iterdir()) == [] and len(calls) == 2
    monkeypatch.setattr(hf_export, "write_shard", write_shard)
    code, _ = _export(capsys, checkpointed_run, tmp_path / "hf")
    assert code == EXIT_OK and len(list((tmp_path / "hf").glob("*.safetensors"))) == 8
    assert file_checksums(checkpointed_run) == kept


def _copy_without_step_4(original, where):
    """A copy of the shared run whose latest checkpoint is step-2 (the original's is step-4)."""
    shutil.copytree(original, where, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(where / "checkpoint" / "step-4")
    return where


def test_teacher_reads_a_copied_dump_where_its_config_is(checkpointed_run, tmp_path, capsys):
    """distill.teacher --config COPY/config.toml read the original's checkpoint (and saved its tokenizer copy into
    the original's folder); now the copy's, said on stderr as eval says it. The sidecars cover a 2,000-token shard."""
    kept = file_checksums(checkpointed_run)
    copy = _copy_without_step_4(checkpointed_run, tmp_path / "copy")
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "train_0.bin", np.arange(2000, dtype=np.int64) % 200)
    code = run_tool(teacher_tool._main, ["--config", str(copy / "config.toml"), "--output", str(tmp_path / "side"),
                                         "--k", "4", "--data.dataset", "shards",
                                         "--data.train_path", str(tmp_path / "data")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("teacher:")]
    assert code == EXIT_OK and err == [f"teacher: read checkpoint {copy / 'checkpoint' / 'step-2'} (the config "
                                       f"file's folder; its job.dump_folder = '{checkpointed_run}' is another folder)"]
    assert (tmp_path / "side" / "train_0.bin.topk").is_file()
    assert file_checksums(checkpointed_run) == kept


def test_quant_export_says_which_checkpoint_of_a_copy_it_read(checkpointed_run, tmp_path, capsys, monkeypatch):
    """quant.export --checkpoint COPY: the copy's checkpoint, said on stderr with the recorded folder (the
    validation pass is left out here: sizes only)."""
    def no_validation(cfg):
        raise ConfigError("no validation split")

    monkeypatch.setattr(quant_export_tool, "validation_streams", no_validation)
    copy = _copy_without_step_4(checkpointed_run, tmp_path / "copy")
    code = run_tool(quant_export_tool._main, ["--checkpoint", str(copy)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_OK and err == [f"quant.export: read checkpoint {copy / 'checkpoint' / 'step-2'} (the config "
                                       f"file's folder; its job.dump_folder = '{checkpointed_run}' is another folder)"]
    assert (copy / "export-int8.pt").is_file() and not (checkpointed_run / "export-int8.pt").exists()
