"""A run on data.prepare shards keeps the tokenizer it started with (the trainer, resumed with another
data.tokenizer)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from data_builders import TEXTS, make_hf
from trainer_utils import REPO, run_trainer

from torchtitan_ext.data.tokenizers import (
    META,
)

pytest.importorskip("tokenizers")

pytest.importorskip("tiktoken")

def _cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "",
                                            **(env or {})})


def _docs(tmp_path: Path, n: int = len(TEXTS)) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:n]))
    return path


def test_shard_run_keeps_its_tokenizer(tmp_path):
    """A shard job trained with a tokenizer.json: the tokenizer is saved in the dump folder, eval, generate
    and export work after the source file is gone, and a resume with another tokenizer stops in one line."""
    src = make_hf(tmp_path / "hf")
    shards = tmp_path / "shards"
    res = _cli("torchtitan_ext.data.prepare", "--input", str(_docs(tmp_path)), "--output-dir", str(shards),
               "--tokenizer", str(src), "--shard-tokens", "3000", "--val-shards", "1")
    assert res.returncode == 0, res.stderr
    dump = tmp_path / "dump"
    data = ["--data.dataset", "shards", "--data.train_path", str(shards / "train_*.bin"),
            "--data.val_path", str(shards / "val_*.bin"), "--data.tokenizer", str(src)]
    exportable = ["--model.rope_fraction", "1", "--model.nope_every", "0"]  # a Qwen3 model: transformers has it
    run_trainer(dump, 0, *data, "--training.steps", "2", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "2", *exportable)
    meta = json.loads((dump / "tokenizer" / META).read_text())
    assert meta["kind"] == "hf" and meta["vocab_size"] == 300 and (meta["eot_id"], meta["bos_id"], meta["pad_id"]) \
        == (0, 1, 2) and meta["spec"] == str(src)
    shutil.rmtree(tmp_path / "hf")  # no retraining, no network, no source file: the run's copy
    out = _cli("torchtitan_ext.eval", "--config", str(dump / "config.toml"), "--eval.steps", "2")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["scored_tokens"] == 2 * 4 * 64 and res["val_bpb"] > 0
    gen = _cli("torchtitan_ext.generate", "--checkpoint", str(dump), "--prompt", "def main(", "--max-new-tokens",
               "5", "--json")
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout)["completions"]) == 1
    exported = _cli("torchtitan_ext.export", "--checkpoint", str(dump), "--output", str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "exported" / "config.json").is_file()
    # a resume with another tokenizer: one line, exit code 2, before any work
    bad = run_trainer(dump, 0, *data, "--data.tokenizer", "byte", "--training.steps", "4", "--checkpoint.enabled",
                      "true", "--checkpoint.interval", "2", check=False)
    assert bad.returncode == 2, bad.stderr[-2000:]
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds this run's tokenizer" in lines[0] and "'byte'" in lines[0], bad.stderr
    assert not (dump / "checkpoint" / "step-4").exists()
