"""Issue 64, item 3 (tools): every tool checks its arguments before its work. generate's sampling options are
finite and in range (``nan`` and ``1e-300`` were RuntimeError tracebacks, ``inf`` was accepted), ``--device
cuda`` without CUDA is one line (an AssertionError); ``quant.export --output`` onto an existing file
overwrote it silently and onto a folder was a traceback: now the refusal ``export`` shares, the file
untouched; eval, generate and export say that a folder holds no checkpoint before they import torch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch
from trainer_utils import REPO, file_checksums

from torchtitan_ext.cli import run_tool
from torchtitan_ext.errors import EXIT_USER
from torchtitan_ext.tools import export as export_tool
from torchtitan_ext.tools import generate as generate_tool
from torchtitan_ext.tools import quant_export as quant_export_tool


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("option, value, line", [
    ("--temperature", "nan", "--temperature nan: expected 0 (greedy) or a number from 0.001 to 1000"),
    ("--temperature", "1e-300", "--temperature 1e-300: expected 0 (greedy) or a number from 0.001 to 1000"),
    ("--temperature", "inf", "--temperature inf: expected 0 (greedy) or a number from 0.001 to 1000"),
    ("--temperature", "-1", "--temperature -1.0: expected 0 (greedy) or a number from 0.001 to 1000"),
    ("--top-p", "nan", "--top-p nan: expected a number above 0 and at most 1"),
    ("--top-p", "0", "--top-p 0.0: expected a number above 0 and at most 1"),
    ("--max-new-tokens", "0", "--max-new-tokens 0: expected a whole number >= 1"),
])
def test_generate_sampling_options_are_checked_first(checkpointed_run, capsys, option, value, line):
    code = run_tool(generate_tool._main, ["--checkpoint", str(checkpointed_run), "--prompt", "a", option, value])
    assert code == EXIT_USER and _errors(capsys) == [f"error: {line}"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda_is_one_line(checkpointed_run, capsys):
    code = run_tool(generate_tool._main, ["--checkpoint", str(checkpointed_run), "--prompt", "a", "--device", "cuda"])
    assert code == EXIT_USER and _errors(capsys) == [
        "error: --device cuda: this torch sees no CUDA device (a CPU build, or no GPU visible); use --device cpu or "
        "auto"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_quant_export_never_overwrites_an_existing_output(checkpointed_run, tmp_path, capsys):
    """An existing file (given, or the default ``export-int8.pt`` of an earlier export) and an existing folder
    are refused with export's line, before any work; the file is untouched."""
    kept = file_checksums(checkpointed_run)
    mine = tmp_path / "weights.pt"
    mine.write_bytes(b"the user's own file")
    before = _sha(mine)
    code = run_tool(quant_export_tool._main, ["--checkpoint", str(checkpointed_run), "--output", str(mine)])
    assert code == EXIT_USER and _errors(capsys) == [
        f"error: --output {mine}: exists (a file); the tool writes a new file (remove it or name another path)"]
    assert _sha(mine) == before
    code = run_tool(quant_export_tool._main, ["--checkpoint", str(checkpointed_run), "--output", str(tmp_path)])
    assert code == EXIT_USER and _errors(capsys) == [
        f"error: --output {tmp_path}: exists (a folder); the tool writes a new file (remove it or name another "
        f"path)"]
    assert file_checksums(checkpointed_run) == kept


def test_export_refuses_an_existing_file_or_folder_with_the_same_line(checkpointed_run, tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("the user's own file\n")
    before = file_checksums(tmp_path)
    for output in (mine, tmp_path):
        code = run_tool(export_tool._main, ["--checkpoint", str(checkpointed_run), "--output", str(output)])
        assert code == EXIT_USER and _errors(capsys) == [
            f"error: --output {output}: exists and is not an empty folder (the tool writes a new one; remove it or "
            f"name another path)"]
    assert file_checksums(tmp_path) == before


@pytest.mark.parametrize("tool, argv", [
    ("eval", ["--config", "{tmp}/job.toml"]),
    ("generate", ["--checkpoint", "{missing}", "--prompt", "a"]),
    ("export", ["--checkpoint", "{missing}", "--output", "{tmp}/hf"]),
])
def test_a_missing_folder_is_said_before_torch_is_imported(tmp_path, tool, argv):
    """The tool's own process: one line, exit 2, and torch never imported (the seconds its import takes come
    after the paths are checked)."""
    missing = tmp_path / "no-such-run"
    (tmp_path / "job.toml").write_text(f'[job]\ndump_folder = "{missing}"\n')
    argv = [a.format(missing=missing, tmp=tmp_path) for a in argv]
    probe = (f"import sys\nfrom torchtitan_ext.tools import {tool} as tool\ncode = tool.main({argv!r})\n"
             f"print('torch imported' if 'torch' in sys.modules else 'torch not imported')\nsys.exit(code)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    errors = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_USER and errors == [
        f"error: {missing}: no complete checkpoint found there (no such folder; expected a dump folder with "
        f"checkpoint/step-N/)"], proc.stderr
    assert proc.stdout.strip() == "torch not imported"
