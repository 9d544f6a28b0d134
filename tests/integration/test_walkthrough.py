"""The walkthrough of docs/data-and-tokenizers.md, run line by line on files this test makes: parquet +
tokenizer.json -> data.prepare -> train -> eval -> generate."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")


def walkthrough_commands() -> list[str]:
    text = (REPO / "docs" / "data-and-tokenizers.md").read_text()
    block = re.search(r"<!-- walkthrough -->\n```\n(.*?)```", text, re.S)
    assert block, "docs/data-and-tokenizers.md has no walkthrough block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _corpus(root: Path) -> None:
    """Two parquet files of English-like documents, and a byte-level BPE trained on them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ("the model reads a token and writes the next one while the loss falls over many steps of "
             "training on documents that repeat simple patterns with numbers").split()
    docs = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 40)) + f" {i}." for i in range(900)]
    (root / "corpus").mkdir()
    pq.write_table(pa.table({"id": list(range(450)), "text": docs[:450]}), root / "corpus" / "part-0.parquet")
    pq.write_table(pa.table({"id": list(range(450, 900)), "text": docs[450:]}), root / "corpus" / "part-1.parquet")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "my_tok").mkdir()
    tok.save(str(root / "my_tok" / "tokenizer.json"))
    (root / "my_tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.mark.slow
def test_readme_walkthrough(tmp_path):
    _corpus(tmp_path)
    (tmp_path / "train_configs").symlink_to(REPO / "train_configs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO),
           "PYTHONUNBUFFERED": "1"}
    outputs = []
    for line in walkthrough_commands():
        argv = shlex.split(line)
        assert argv[0] == "python"
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    assert sorted(p.name for p in (tmp_path / "data" / "mine").glob("*.bin"))[0] == "train_000000.bin"
    records = [json.loads(x) for x in (tmp_path / "outputs" / "mine" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if "loss" in r]
    assert train[-1] < 0.6 * train[0], train
    assert (tmp_path / "outputs" / "mine" / "tokenizer" / "tokenizer.json").is_file()
    evaluated = json.loads(outputs[2].strip().splitlines()[-1])
    assert math.isfinite(evaluated["val_loss"]) and evaluated["val_loss"] < train[0]
    assert "The " in outputs[3]
