"""Tokenizers: bytes (the fastest tests) and SentencePiece BPE (the built-in corpus, or any .model)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-text id 256."""

    vocab_size = 257
    eot_id = 256
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model; its end-of-sentence id (or a user-defined ``<|endoftext|>``) separates documents."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm

        if not Path(path).is_file():
            raise FileNotFoundError(f"data.tokenizer = {str(path)!r}: no such SentencePiece model file")
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        eot = self.sp.piece_to_id("<|endoftext|>")
        self.eot_id = eot if eot != self.sp.unk_id() else self.sp.eos_id()
        self.name = Path(path).stem

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.sp.encode(text), dtype=np.int32)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.sp.encode(texts, num_threads=os.cpu_count())]

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


class FileLock:
    """An exclusive lock on ``path`` so that one process builds a cached file while the others wait."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def train_bpe(texts: Iterable[str], vocab_size: int, model_path: Path) -> None:
    """Train a byte-fallback BPE model on ``texts`` and write it to ``model_path`` atomically."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", max_sentence_length=1 << 16,
        input_sentence_size=200_000, shuffle_input_sentence=True, num_threads=os.cpu_count(),
        user_defined_symbols=["<|endoftext|>"], minloglevel=2)
    tmp = model_path.with_name(model_path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, model_path)
