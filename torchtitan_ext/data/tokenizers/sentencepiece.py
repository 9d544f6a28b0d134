"""SentencePiece models (any ``.model``; ``builtin`` is one trained on the corpus by :func:`train_bpe`)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torchtitan_ext.data.tokenizers import sentencepiece_hf
from torchtitan_ext.data.tokenizers.common import BaseTokenizer, TokenizerError, require
from torchtitan_ext.data.tokenizers.hf_files import Pipeline


class SentencePieceTokenizer(BaseTokenizer):
    """A SentencePiece model; its end-of-sentence id (or a user-defined ``<|endoftext|>``) separates
    documents."""

    kind = "sentencepiece"

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        spm = require("sentencepiece", "a SentencePiece tokenizer")
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"data.tokenizer = {str(path)!r}: no such SentencePiece model file")
        self._bytes, self._file = path.read_bytes(), path.name
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=self._bytes)
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        self.vocab_size = self.sp.get_piece_size()
        eot = self.sp.piece_to_id("<|endoftext|>")
        self.eot_id = eot if eot != self.sp.unk_id() else self.sp.eos_id()
        if self.eot_id < 0:
            raise TokenizerError(f"{path}: the SentencePiece model has no end-of-sentence piece")
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        self.name = name or path.stem

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.sp.encode(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.sp.encode(texts, num_threads=os.cpu_count())]

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(self._known(ids))

    def token_byte_lengths(self) -> np.ndarray:
        """A piece's text in UTF-8 (``▁`` a space), a byte-fallback piece ``<0x..>`` one byte; control,
        unknown and end-of-text pieces zero."""
        sp, table = self.sp, np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if sp.is_control(i) or sp.is_unknown(i) or i == self.eot_id:
                continue
            table[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return table

    def files(self) -> dict[str, bytes]:
        return {self._file: self._bytes}

    def hf_pipeline(self) -> Pipeline:
        return sentencepiece_hf.pipeline(self._bytes, self._file)


def train_bpe(texts: Iterable[str], vocab_size: int, model_path: Path) -> None:
    """Train a byte-fallback BPE model on ``texts`` and write it to ``model_path`` atomically."""
    spm = require("sentencepiece", "the builtin tokenizer")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity", max_sentence_length=1 << 16,
            input_sentence_size=200_000, shuffle_input_sentence=True, num_threads=os.cpu_count(),
            user_defined_symbols=["<|endoftext|>"], minloglevel=2)
    except (RuntimeError, OSError) as e:  # SentencePiece's own check (e.g. a vocabulary too small)
        raise TokenizerError(f"{model_path}: SentencePiece training failed with data.tokenizer_vocab_size = "
                             f"{vocab_size} ({str(e).strip().splitlines()[-1][:300]})") from None
    tmp = model_path.with_name(model_path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, model_path)
