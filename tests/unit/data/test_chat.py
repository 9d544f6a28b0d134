"""Chat / SFT data: the assistant mask by hand, zero gradient from masked tokens, packed conversations equal
each conversation alone (float64), and a fine-tuning run from a pretrained dump folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_builders import conversation, write_chat

from torchtitan_ext.config.job_config import DataSection
from torchtitan_ext.data.chat import ChatTemplate, conversation_tokens
from torchtitan_ext.data.registry import build_tokenizer
from torchtitan_ext.data.sources.chat import IGNORE, ChatLoader
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.train.losses import cross_entropy_loss

BYTES = build_tokenizer(DataSection(tokenizer="byte"))


def test_assistant_mask_by_hand():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tokens, mask = conversation_tokens(messages, BYTES, ChatTemplate(), "hand")
    text = "<|user|>\nhi\n<|assistant|>\nhello\n"
    assert tokens.tolist() == list(text.encode()) + [BYTES.eot_id]
    start = len("<|user|>\nhi\n<|assistant|>\n")
    assert np.flatnonzero(mask).tolist() == list(range(start, len(text) + 1))  # "hello\n" and the end-of-text


def test_masked_tokens_contribute_zero_gradient(tmp_path):
    loader = ChatLoader([write_chat(tmp_path / "c.jsonl", 12)], BYTES, ChatTemplate(), seq_len=96,
                        local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0, shuffle=True)
    batch = loader.next_batch()
    logits = torch.randn(*batch.labels.shape, BYTES.vocab_size, dtype=torch.float64, requires_grad=True)
    cross_entropy_loss(logits, batch.labels).backward()
    per_token = logits.grad.abs().sum(-1)
    ignored = batch.labels == IGNORE
    assert ignored.any() and (~ignored).any()
    assert torch.all(per_token[ignored] == 0) and torch.all(per_token[~ignored] > 0)


def test_packed_conversations_equal_each_alone(tmp_path):
    """Each conversation's logits in a packed window (document visibility, positions from 0) equal the
    model's logits for that conversation alone, float64."""
    loader = ChatLoader([write_chat(tmp_path / "c.jsonl", 9)], BYTES, ChatTemplate(), seq_len=256,
                        local_batch_size=2, dp_rank=0, dp_world_size=1, seed=0, shuffle=False)
    torch.manual_seed(0)
    model = Decoder(ModelArgs(vocab_size=BYTES.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_hidden=64, max_seq_len=256)).double()
    model.init_buffers(torch.device("cpu"))
    batch = loader.next_batch()
    packed = model(batch.inputs, visibility=batch.visibility, positions=batch.positions)
    checked = 0
    for row in range(batch.inputs.shape[0]):
        ends = (batch.inputs[row] == BYTES.eot_id).nonzero().flatten().tolist()
        start = 0
        for end in ends:
            if end > start:  # a conversation (padding is a run of single end-of-text tokens)
                alone = model(batch.inputs[row:row + 1, start:end + 1])
                torch.testing.assert_close(packed[row, start:end + 1], alone[0], atol=1e-10, rtol=1e-10)
                checked += 1
            start = end + 1
    assert checked >= 4


def test_malformed_line_is_one_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": conversation(1)}) + "\n" + '{"messages": [{"role": "robot"}]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected"):
        ChatLoader([bad], BYTES, ChatTemplate(), seq_len=64, local_batch_size=1, dp_rank=0, dp_world_size=1,
                   seed=0, shuffle=False)


def test_tokenizer_chat_template_from_tokenizer_config(tmp_path):
    """A Hugging Face tokenizer's own chat template (tokenizer_config.json) renders the conversation, and the
    mask covers exactly the tokens of the assistant's reply and what the template puts after it."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello there, how are you? fine thanks"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                "chat_template": template}))
    hf = build_tokenizer(DataSection(tokenizer=str(tmp_path)))
    assert hf.chat_template == template
    messages = [{"role": "user", "content": "how are you?"}, {"role": "assistant", "content": "fine thanks"}]
    tokens, mask = conversation_tokens(messages, hf, ChatTemplate(hf.chat_template), "hf")
    reply = tok.encode("fine thanks<|im_end|>\n", add_special_tokens=False).ids
    assert tokens[mask].tolist() == reply + [hf.eot_id]
    assert hf.decode(tokens[:-1].tolist()).startswith("<|im_start|>user\nhow are you?<|im_end|>")
