"""Chat / SFT in the trainer: a fine-tuning run from a pretrained dump folder."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from data_builders import conversation, write_chat
from trainer_utils import losses, run_trainer

from torchtitan_ext.config.job_config import DataSection
from torchtitan_ext.data.chat import ChatTemplate, conversation_tokens
from torchtitan_ext.data.registry import build_tokenizer

BYTES = build_tokenizer(DataSection(tokenizer="byte"))


def test_sft_from_a_pretrained_dump(tmp_path):
    """Pretrain 20 steps, then fine-tune on conversations from that dump folder: the fine-tuning loss (on
    the assistant's tokens) starts from the pretrained model and falls; without initial weights the job
    stops with one line."""
    run_trainer(tmp_path / "pre", 0, "--training.steps", "20", "--checkpoint.enabled", "true")
    chat = ["--data.dataset", "chat", "--data.train_path", str(write_chat(tmp_path / "train.jsonl", 64)),
            "--data.val_path", str(write_chat(tmp_path / "val.jsonl", 8, start=100)), "--training.mode", "sft",
            "--training.seq_len", "128", "--training.steps", "30", "--eval.steps", "2", "--eval.interval", "30"]
    run_trainer(tmp_path / "sft", 0, *chat, "--checkpoint.initial_load_path", str(tmp_path / "pre"),
                "--checkpoint.enabled", "true")
    got = losses(tmp_path / "sft")
    assert np.mean([got[s] for s in range(26, 31)]) < 0.7 * got[1], got
    # The export carries the template the run rendered with: transformers' apply_chat_template gives its ids.
    transformers = pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-m", "torchtitan_ext.export", "--checkpoint", str(tmp_path / "sft"),
                          "--output", str(tmp_path / "hf")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tokens, _ = conversation_tokens(conversation(3), BYTES, ChatTemplate(), "chat")
    ids = hf.apply_chat_template(conversation(3), tokenize=True, return_dict=False)
    assert list(ids) + [BYTES.eot_id] == tokens.tolist()
    proc = run_trainer(tmp_path / "sft2", 0, *chat, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "checkpoint.initial_load_path" in proc.stderr
