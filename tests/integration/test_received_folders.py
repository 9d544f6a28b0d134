"""Issue 64, item 2: nothing in a received folder runs code. A dump folder whose checkpoint ``.metadata`` was
rewritten by its sender (with ``checksums.json`` rewritten to match) into a pickle that creates a file when
unpickled is refused by every loader (the trainer's resume and ``checkpoint.initial_load_path``, eval,
generate, export, quant.export, distill.teacher) in one line naming the file, exit 2, the file not created;
``data.prepare`` refuses an earlier version's pickled state unread. Each test first shows that the tampered
file does run code under an unrestricted unpickler, then that the loader does not run it."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from trainer_utils import CKPT_EVERY_2, file_checksums, run_trainer

from torchtitan_ext.checkpoint.integrity import MANIFEST, crc32_of
from torchtitan_ext.cli import run_tool
from torchtitan_ext.data.shards import write_shard
from torchtitan_ext.errors import EXIT_USER, ConfigError
from torchtitan_ext.tools import eval as eval_tool
from torchtitan_ext.tools import export as export_tool
from torchtitan_ext.tools import generate as generate_tool
from torchtitan_ext.tools import quant_export as quant_export_tool
from torchtitan_ext.tools import teacher as teacher_tool

OPEN = f"{open.__module__}.{open.__qualname__}"  # what the tampered pickle calls


class CreatesFile:
    """Unpickled without restriction, this creates ``path``: the stand-in for any command."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def tamper(step: Path, marker: Path) -> Path:
    """Rewrite ``step/.metadata`` to carry a ``CreatesFile(marker)`` and its checksum to match, as a sender
    would; check that an unrestricted unpickler does create the marker, and remove it again."""
    path = step / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own, untampered file
    metadata.planner_data = CreatesFile(marker)
    path.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((step / MANIFEST).read_text())
    size, crc = crc32_of(path)
    manifest["files"][".metadata"] = {"size": size, "crc32": crc}
    (step / MANIFEST).write_text(json.dumps(manifest))
    pickle.loads(path.read_bytes())
    assert marker.is_file(), "the tampered file should run code when unpickled without restriction"
    marker.unlink()
    return path


def refusal(path: Path) -> str:
    return (f"error: {path}: refused to unpickle {OPEN}, which DCP never writes there (a file that would run code "
            f"when loaded); use a checkpoint from a source you trust")


@pytest.fixture
def tampered_run(checkpointed_run, tmp_path):
    """(a copy of the shared 4-step run with both checkpoints tampered, the marker file, step-4's .metadata)."""
    dump = tmp_path / "received"
    shutil.copytree(checkpointed_run, dump, ignore=shutil.ignore_patterns(".lock"))
    marker = tmp_path / "code-ran"
    tamper(dump / "checkpoint" / "step-2", marker)
    return dump, marker, tamper(dump / "checkpoint" / "step-4", marker)


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("tool", ["eval", "generate", "export", "quant.export", "distill.teacher"])
def test_every_tool_refuses_a_tampered_metadata(tampered_run, tmp_path, capsys, tool):
    dump, marker, metadata = tampered_run
    kept = file_checksums(dump)
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "train_0.bin", np.arange(2000, dtype=np.int64) % 200)
    main, argv = {
        "eval": (eval_tool._main, ["--config", str(dump / "config.toml"), "--eval.steps", "1"]),
        "generate": (generate_tool._main, ["--checkpoint", str(dump), "--prompt", "a", "--max-new-tokens", "2",
                                           "--device", "cpu"]),
        "export": (export_tool._main, ["--checkpoint", str(dump), "--output", str(tmp_path / "hf")]),
        "quant.export": (quant_export_tool._main, ["--checkpoint", str(dump), "--output", str(tmp_path / "q.pt")]),
        "distill.teacher": (teacher_tool._main, ["--config", str(dump / "config.toml"), "--output",
                                                 str(tmp_path / "side"), "--k", "4", "--data.dataset", "shards",
                                                 "--data.train_path", str(tmp_path / "data")]),
    }[tool]
    code = run_tool(main, argv)
    errors = [line for line in _errors(capsys) if not line.startswith(f"{tool.split('.')[-1]}: read checkpoint")]
    assert code == EXIT_USER and errors == [refusal(metadata)], errors
    assert not marker.exists()
    assert file_checksums(dump) == kept
    assert not (tmp_path / "hf").exists() and not (tmp_path / "q.pt").exists() and not (tmp_path / "side").exists()


def test_the_trainer_refuses_a_tampered_checkpoint_on_resume_and_as_initial_weights(tampered_run, tmp_path):
    """The resume stops at the tampered step-4 rather than falling back to step-2 (a refusal is not damage);
    ``checkpoint.initial_load_path`` pointing at the folder stops the same way."""
    dump, marker, metadata = tampered_run
    kept = file_checksums(dump)
    proc = run_trainer(dump, 0, *CKPT_EVERY_2, "--training.steps", "6", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == EXIT_USER and errors == [refusal(metadata)], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not marker.exists()
    assert file_checksums(dump) == kept
    fresh = tmp_path / "fresh"
    proc = run_trainer(fresh, 0, "--checkpoint.initial_load_path", str(dump), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == EXIT_USER and errors == [refusal(metadata)], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_quant_export_reads_back_its_file_without_unpickling_code(checkpointed_run, tmp_path, capsys, monkeypatch):
    """quant.export reads the file it wrote back through the weights-only unpickler: the export holds only
    tensors and plain values, so it loads; the sizes are reported (no validation split here)."""
    def no_validation(cfg):
        raise ConfigError("no validation split")

    monkeypatch.setattr(quant_export_tool, "validation_streams", no_validation)
    code = run_tool(quant_export_tool._main, ["--checkpoint", str(checkpointed_run), "--output",
                                              str(tmp_path / "q.pt")])
    assert code == 0 and (tmp_path / "q.pt").is_file(), capsys.readouterr().err
