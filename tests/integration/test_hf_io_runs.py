"""Hugging Face interchange from a trained dump: the sharded CLI export's logits equal transformers', continued
pretraining from a sharded folder under FSDP2 equals one process, refusals are one line and leave nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_utils import REPO, losses, run_trainer

from torchtitan_ext.hf.architectures import ExportError
from torchtitan_ext.hf.export import export_model
from torchtitan_ext.hf.load import load_hf
from torchtitan_ext.hf.safetensors_io import INDEX, SINGLE, SafetensorsReader

# A Llama-shaped tiny model (~460 KB in float32), trained 6 steps on one process with an EMA.
LLAMA = ["--model.flavor", "1b", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_hidden", "128", "--model.vocab_size", "320",
         "--training.steps", "6", "--checkpoint.enabled", "true", "--checkpoint.interval", "6"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "torchtitan_ext.export", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def _shard_bytes(folder: Path) -> dict[str, list[int]]:
    """file -> the bytes of each tensor in it."""
    with SafetensorsReader(folder) as r:
        out: dict[str, list[int]] = {}
        for name, shape in r.shapes.items():
            out.setdefault(r.file_of[name], []).append(torch.Size(shape).numel() * r.dtypes[name].itemsize)
        return out


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert all(w in lines[0] for w in words), lines[0]


@pytest.fixture(scope="module")
def sharded_export(trained, tmp_path_factory):
    """``trained`` exported by the CLI in float32, in shards of at most 40 KB: (folder, the CLI's result). Read
    by the tests, never written."""
    folder = tmp_path_factory.mktemp("sharded_export") / "f32"
    out = _cli("--checkpoint", str(trained), "--output", str(folder), "--dtype", "float32", "--max-shard-size", "40KB")
    assert out.returncode == 0, out.stderr
    return folder, out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dump = tmp_path_factory.mktemp("llama")
    run_trainer(dump, 0, *LLAMA)
    return dump


def test_sharded_cli_export_logits_and_load_hf(trained, sharded_export, tmp_path):
    """float32 sharded export through the CLI: >= 3 shards under the limit (a larger tensor alone), transformers'
    logits equal ours, load_hf gives the model back; the default bf16 export is bf16 in config and tensors,
    and load_hf keeps it bf16."""
    transformers = pytest.importorskip("transformers")
    from torchtitan_ext.eval.load import load_trained

    folder, out = sharded_export
    assert "LlamaForCausalLM (native transformers class)" in out.stdout and "float32" in out.stdout
    index = json.loads((folder / INDEX).read_text())
    shards = _shard_bytes(folder)
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert all(sum(sizes) <= 40_000 or len(sizes) == 1 for sizes in shards.values())
    assert any(len(sizes) == 1 and sizes[0] > 40_000 for sizes in shards.values())  # the embedding alone
    assert index["metadata"]["total_size"] == sum(map(sum, shards.values()))
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float32" and config["eos_token_id"] == 256
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 256
    model = load_trained(trained)[0]
    x = torch.randint(0, 320, (2, 32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)
        back = load_hf(folder)
        assert next(back.parameters()).dtype == torch.float32 and torch.equal(back(x), model(x))
    out = _cli("--checkpoint", str(trained), "--output", str(tmp_path / "bf16"))
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "bf16"
    assert (folder / SINGLE).is_file() and not (folder / INDEX).exists()  # 230 KB: one file under 5GB
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with SafetensorsReader(folder) as r:
        assert set(r.dtypes.values()) == {torch.bfloat16}
    back = load_hf(folder)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    for k, v in back.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].to(torch.bfloat16)), k
    assert hf.config.eos_token_id == 256


def test_continued_pretraining_from_sharded_folder_fsdp2_equals_one_process(trained, sharded_export, tmp_path):
    """checkpoint.initial_load_path = a sharded export: 2 FSDP processes train like 1 (same global batch), the
    weights were loaded (step 1's loss is the trained model's, below the fresh one's), and rank 0 read about
    half the folder."""
    start = ["--checkpoint.enabled", "false", "--training.steps", "3",
             "--checkpoint.initial_load_path", str(sharded_export[0])]
    one = run_trainer(tmp_path / "one", 0, *LLAMA, *start)
    two = run_trainer(tmp_path / "two", 2, *LLAMA, *start, "--training.local_batch_size", "2")
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == {1, 2, 3}
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)
    assert a[1] < losses(trained)[1] - 0.2
    for proc, share in ((one, 1.0), (two, 0.5)):  # rank 0's log line
        m = re.search(r"this rank read ([\d,]+) of the folder's ([\d,]+) bytes", proc.stdout)
        read, total = (int(g.replace(",", "")) for g in m.group(1, 2))
        assert abs(read / total - share) < 0.05, (read, total)


def test_refusals_are_one_line_and_leave_nothing(trained, tmp_path):
    """A non-empty --output, a bad --max-shard-size, --weights ema without an EMA, a damaged checkpoint: exit 2,
    one line naming it, nothing written. Damaged folders on import (an index naming a missing shard, a truncated
    shard, a corrupt index, no weights): one line naming the file, from load_hf and from the trainer."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    _one_line(_cli("--checkpoint", str(trained), "--output", str(tmp_path / "full")), "--output",
              "not an empty folder")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    _one_line(_cli("--checkpoint", str(trained), "--output", str(tmp_path / "a"), "--max-shard-size", "5XB"),
              "--max-shard-size", "5XB")
    _one_line(_cli("--checkpoint", str(trained), "--output", str(tmp_path / "a"), "--weights", "ema"),
              "--weights ema", "no EMA")
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    step = damaged / "checkpoint" / "step-6"
    for shard in step.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    _one_line(_cli("--checkpoint", str(damaged), "--output", str(tmp_path / "a")), f"{step}: damaged checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "full"]  # no output, no temporary folder

    from torchtitan_ext.eval.load import load_trained

    export_model(load_trained(trained)[0], tmp_path / "hf", dtype=torch.float32, max_shard_size=40_000)
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    for name, damage, words in [
            ("missing", lambda f: (f / files[1]).unlink(), ("names", files[1], "does not exist")),
            ("truncated", lambda f: (f / files[2]).write_bytes((f / files[2]).read_bytes()[:-7]), (files[2],)),
            ("corrupt", lambda f: (f / INDEX).write_text("{"), (INDEX, "not a safetensors index")),
            ("empty", lambda f: [p.unlink() for p in f.glob("model*")], ("no weights",))]:
        folder = tmp_path / name
        shutil.copytree(tmp_path / "hf", folder)
        damage(folder)
        with pytest.raises(ExportError) as e:
            load_hf(folder)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), e.value
    bad = run_trainer(tmp_path / "job", 0, *LLAMA, "--checkpoint.enabled", "false",
                      "--checkpoint.initial_load_path", str(tmp_path / "missing"), check=False)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'missing' / INDEX}: names")
