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


# --- data.prepare's state ------------------------------------------------------------------------------------

def _jsonl_with_duplicates(n: int) -> bytes:
    """``n`` distinct documents, each followed later by a copy: what the minhash index must remember across a
    resume."""
    import random

    r = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    docs = [" ".join(r.choice(words) for _ in range(80)) for _ in range(n)]
    return "".join(json.dumps({"text": t}) + "\n" for t in docs + docs[::-1]).encode()


def test_prepare_resumes_from_a_state_without_pickles_and_dedups_across_it(tmp_path, capsys):
    """The saved state (tokens carried over, the near-duplicate index) holds only arrays and JSON; a
    preparation cut after some shards resumes from it and ends identical to one of the whole input, every
    copy of an earlier document (some before the cut, some after) removed."""
    import gzip

    from torchtitan_ext.data.prepare import STATE
    from torchtitan_ext.data.shards import read_shard
    from torchtitan_ext.tools.prepare import main

    whole = gzip.compress(_jsonl_with_duplicates(150))
    src = tmp_path / "x.jsonl.gz"
    src.write_bytes(whole[:len(whole) * 3 // 4])
    args = ["--shard-tokens", "5000", "--val-shards", "1", "--filters", "minhash"]
    out = tmp_path / "out"
    assert main(["--input", str(src), "--output-dir", str(out), *args]) == 2
    with np.load(out / STATE, allow_pickle=False) as saved:  # no object array: numpy would refuse it here
        assert {"record", "carry", "signatures", "digests"} <= set(saved.files) and len(saved["signatures"]) > 0
    src.write_bytes(whole)
    assert main(["--input", str(src), "--output-dir", str(out), *args]) == 0
    assert "resuming after record" in capsys.readouterr().err
    ref = tmp_path / "ref"
    assert main(["--input", str(src), "--output-dir", str(ref), *args]) == 0
    report = json.loads(next(line for line in capsys.readouterr().err.splitlines() if line.startswith("{")))
    assert report["documents_kept"] == 150 and report["removed"] == {"minhash/exact": 150}
    shards = sorted(p.name for p in ref.glob("*.bin"))
    assert shards == sorted(p.name for p in out.glob("*.bin"))
    assert all(np.array_equal(read_shard(ref / s), read_shard(out / s)) for s in shards)


def test_prepare_refuses_an_old_pickled_state_unread(tmp_path, capsys):
    from torchtitan_ext.data.prepare import OLD_STATE
    from torchtitan_ext.tools.prepare import main

    src = tmp_path / "x.jsonl"
    src.write_bytes(_jsonl_with_duplicates(20))
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "code-ran"
    (out / OLD_STATE).write_bytes(pickle.dumps({"args": CreatesFile(marker)}))
    kept = file_checksums(out)
    assert main(["--input", str(src), "--output-dir", str(out)]) == EXIT_USER
    assert [line for line in _errors(capsys) if line.startswith("error")] == [
        f"error: {out / OLD_STATE}: an earlier version's pickled preparation state, not read (unpickling a file can "
        f"run code); remove it and the folder's shards, then prepare again"]
    assert not marker.exists() and file_checksums(out) == kept


def test_prepare_refuses_a_state_holding_a_pickled_array(tmp_path, capsys):
    """A ``prepare_state.npz`` whose carry is an object array (numpy pickles those) is refused without
    unpickling it."""
    from torchtitan_ext.data.prepare import STATE
    from torchtitan_ext.tools.prepare import main

    src = tmp_path / "x.jsonl"
    src.write_bytes(_jsonl_with_duplicates(20))
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "code-ran"
    np.savez(out / STATE, record=np.frombuffer(b"{}", np.uint8), carry=np.array([CreatesFile(marker)], object))
    kept = file_checksums(out)
    assert main(["--input", str(src), "--output-dir", str(out)]) == EXIT_USER
    errors = [line for line in _errors(capsys) if line.startswith("error")]
    assert errors == [f"error: {out / STATE}: not a preparation state this version wrote (ValueError: Object arrays "
                      f"cannot be loaded when allow_pickle=False); remove it and the folder's shards, then prepare "
                      f"again"], errors
    assert not marker.exists() and file_checksums(out) == kept


# --- DCP's bytes entries -------------------------------------------------------------------------------------

def test_a_bytes_entry_that_would_run_code_is_refused_and_plain_ones_load(tmp_path):
    """DCP stores a non-tensor value with ``torch.save`` and torch's planner reads it back unrestricted; through
    ``safe_load`` plain values (numbers, strings, containers) load as saved and a pickle that would create a
    file is refused naming the shard file and the entry."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_ext.checkpoint.safe_reader import UnsafeCheckpointFile, safe_load

    plain = {"w": torch.arange(4.0), "train_state": {"step": 7, "seen": [1, 2.5, "x"], "pos": {"a": (3, 4)}}}
    dcp.save(plain, checkpoint_id=str(tmp_path / "plain"))
    state = {"w": torch.zeros(4), "train_state": {"step": 0, "seen": [], "pos": {"a": (0, 0)}}}
    safe_load(state, tmp_path / "plain")
    assert torch.equal(state["w"], plain["w"]) and state["train_state"] == plain["train_state"]

    marker = tmp_path / "code-ran"
    dcp.save({"w": torch.zeros(4), "train_state": {"step": CreatesFile(marker)}},
             checkpoint_id=str(tmp_path / "evil"))
    assert not marker.exists()
    state = {"w": torch.ones(4), "train_state": {"step": 0}}
    with pytest.raises(UnsafeCheckpointFile) as refused:
        safe_load(state, tmp_path / "evil")
    assert str(refused.value) == (
        f"{tmp_path / 'evil' / '__0_0.distcp'}: refused the entry train_state.step (it asks for {OPEN}, which the "
        f"weights-only unpickler does not admit): a file that would run code when loaded; use a checkpoint from a "
        f"source you trust")
    assert not marker.exists() and state["train_state"]["step"] == 0


class _EnumsByGetattr(pickle.Pickler):
    """Pickles enum members as ``getattr(class, name)``, as Python 3.11.2 (Debian bookworm's) does."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _pickled_with_getattr(metadata) -> bytes:
    import io

    buf = io.BytesIO()
    _EnumsByGetattr(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(metadata)
    return buf.getvalue()


def test_metadata_with_enums_pickled_by_getattr_loads_and_other_getattrs_are_refused(checkpointed_run, tmp_path):
    """A genuine checkpoint written where enums pickle through ``getattr`` (its tensors' memory-format enum)
    loads; ``getattr`` of anything but an enum member of an admitted class is refused in one line."""
    from torch.distributed.checkpoint.metadata import Metadata

    from torchtitan_ext.checkpoint.safe_reader import UnsafeCheckpointFile, read_metadata_file

    original = checkpointed_run / "checkpoint" / "step-4" / ".metadata"
    metadata = pickle.loads(original.read_bytes())  # the test's own, untampered file
    data = _pickled_with_getattr(metadata)
    assert b"getattr" in data and b"_MEM_FORMAT_ENCODING" in data
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    assert read_metadata_file(path).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()

    class GetattrOfAClass:
        def __reduce__(self):
            return getattr, (Metadata, "__reduce_ex__")

    metadata.planner_data = GetattrOfAClass()
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointFile, match=r": refused to unpickle getattr\(Metadata, '__reduce_ex__'\), "
                                                   r"which DCP never writes there"):
        read_metadata_file(path)
