"""Small inputs several test files build the same way: a Hugging Face tokenizer, per-domain shards, chat
conversations, JSONL trees and small random models."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.data.shards import write_shard
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder

TEXTS = [f"def func_{i}(x, y={i % 7}):\n    '''héllo wörld {i}: ñ 日本'''\n    return x * {i} + y  # note\n"
         for i in range(400)]


def make_hf(folder: Path, vocab_size: int = 300, config: bool = True, texts: list[str] = TEXTS) -> Path:
    """A byte-level BPE trained by the tokenizers library (and its tokenizer_config.json) in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": {"content": "<pad>", "special": True}}))
    return folder / "tokenizer.json"


def write_domains(folder: Path, n_domains: int = 2) -> list[dict]:
    """Byte-tokenized shards of distinct text per domain (stdlib sources, their docstrings-less halves)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tables = []
    for d in range(n_domains):
        text = "".join(f.read_text(errors="replace") for f in files[d * 12:(d + 1) * 12])
        tokens = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
        cut = len(tokens) // 8
        write_shard(folder / f"d{d}_val.bin", tokens[:cut])
        write_shard(folder / f"d{d}_train.bin", tokens[cut:])
        tables.append({"name": f"d{d}", "train": str(folder / f"d{d}_train.bin"),
                       "val": str(folder / f"d{d}_val.bin"), "weight": float(d + 1)})
    return tables


def conversation(i: int) -> list[dict]:
    """Chat turns of conversation ``i``: a question and its answer; every third one with a system turn and a
    second exchange."""
    turns = [{"role": "user", "content": f"what is {i} plus {i}?"},
             {"role": "assistant", "content": f"{2 * i}."}]
    if i % 3 == 0:
        turns = [{"role": "system", "content": "be brief"}, *turns,
                 {"role": "user", "content": "and times two?"}, {"role": "assistant", "content": f"{4 * i}"}]
    return turns


def write_chat(path: Path, n: int, start: int = 0) -> Path:
    """A JSONL chat file of conversations ``start`` .. ``start + n - 1``."""
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(start, start + n)))
    return path


def write_trees(path: Path, n: int, seed: int) -> list[dict]:
    """A JSONL file of ``n`` random trees of 1-5 nodes (short lower-case texts), nodes in reverse order."""
    rng = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    trees = []
    for t in range(n):
        nodes = []
        for i in range(int(torch.randint(1, 6, (1,), generator=rng))):
            parent = None if i == 0 else int(torch.randint(0, i, (1,), generator=rng))
            text = "".join(letters[int(c)] for c in torch.randint(0, 27, (int(torch.randint(2, 9, (1,),
                                                                                             generator=rng)),),
                                                                   generator=rng))
            nodes.append({"id": f"{t}-{i}", "parent": None if parent is None else f"{t}-{parent}", "text": text})
        trees.append({"nodes": nodes[::-1]})  # any order in the file: prepare sorts them
    path.write_text("\n".join(json.dumps(x) for x in trees) + "\n")
    return trees


# A small Decoder's arguments (the eval, generation and export tests' default).
SMALL_MODEL = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=48,
                   rope_theta=500.0)


def random_decoder(seed: int = 0, base: dict = SMALL_MODEL, **kw) -> Decoder:
    """A Decoder of ``base`` updated by ``kw`` in eval mode, with random weights large enough to give peaked
    logits (matrices N(0, 0.2), norm weights U(0.5, 1.5)) from ``seed``."""
    torch.manual_seed(seed)
    model = Decoder(ModelArgs(**{**base, **kw}))
    model.init_buffers(torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model.eval()
