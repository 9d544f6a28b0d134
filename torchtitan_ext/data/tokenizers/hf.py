"""Hugging Face tokenizers (the ``tokenizers`` library): a ``tokenizer.json`` file, or a folder holding it
with ``tokenizer_config.json`` (and ``special_tokens_map.json``), whose ``bos_token`` / ``eos_token`` /
``pad_token`` give the special ids; the end-of-text id is the ``eos_token``'s (else a well-known
end-of-text token of the vocabulary).

``encode`` is the library's encoding without the post-processor's special tokens (documents are joined
by the end-of-text id instead), truncation and padding off; ``hf_pipeline`` (an export) is the same file
without them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torchtitan_ext.data.tokenizers.byte_level import byte_level_alphabet
from torchtitan_ext.data.tokenizers.common import BaseTokenizer, TokenizerError, file_hash, require
from torchtitan_ext.data.tokenizers.hf_files import Pipeline

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


def _types(node) -> set[str]:
    """Every component type in a tokenizer.json section (Sequence members included)."""
    if isinstance(node, dict):
        return {node.get("type", "")} | set().union(*map(_types, node.values()))
    if isinstance(node, list):
        return set().union(*map(_types, node))
    return set()


class HFTokenizer(BaseTokenizer):
    kind = "hf"

    def __init__(self, json_path: str | Path, name: str | None = None):
        tokenizers = require("tokenizers", "a Hugging Face tokenizer.json")
        json_path = Path(json_path)
        self._files = {"tokenizer.json": json_path.read_bytes(), **{extra: (json_path.parent / extra).read_bytes()
                       for extra in CONFIG_FILES if (json_path.parent / extra).is_file()}}
        try:
            self.tok = tokenizers.Tokenizer.from_str(self._files["tokenizer.json"].decode("utf-8"))
            config = {}
            for extra in reversed(CONFIG_FILES):  # tokenizer_config.json wins
                if extra in self._files:
                    config.update(json.loads(self._files[extra]))
        except Exception as e:  # the library raises plain Exceptions for a bad file
            raise TokenizerError(f"{json_path}: not a Hugging Face tokenizer ({str(e).splitlines()[0]})") from None
        self.tok.no_truncation()
        self.tok.no_padding()
        self.added = self.tok.get_added_tokens_decoder()
        self.vocab_size = max([self.tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in self.added)])
        ids = {key: self._token_id(config.get(f"{key}_token"), json_path, key) for key in ("bos", "eos", "pad")}
        self.bos_id, self.pad_id = ids["bos"], ids["pad"]
        eot = next((i for i in (ids["eos"], *map(self.tok.token_to_id, EOT_NAMES)) if i is not None), None)
        if eot is None:
            raise TokenizerError(f"{json_path}: no end-of-text token (give tokenizer_config.json an eos_token, or "
                                 f"add one of {', '.join(EOT_NAMES)})")
        self.eot_id = int(eot)
        template = config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None  # data/chat.py renders with it
        self.name = name or f"{json_path.parent.name or 'hf'}-{file_hash(self._files['tokenizer.json'])[:10]}"

    def _token_id(self, token, path: Path, key: str) -> int | None:
        if isinstance(token, dict):  # an AddedToken record
            token = token.get("content")
        if not token:
            return None
        i = self.tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{path.parent}: {key}_token {token!r} of tokenizer_config.json is not in the "
                                 "vocabulary")
        return int(i)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(self._known(ids), skip_special_tokens=False)

    def token_byte_lengths(self) -> np.ndarray:
        """Byte-level vocabularies (GPT-2 style): one byte per character; others: the token's text in UTF-8
        with ``▁`` a space, ``<0x..>`` byte-fallback tokens one byte and a WordPiece ``##`` dropped.
        Special tokens count zero; other added tokens their text."""
        decoder = _types(json.loads(self._files["tokenizer.json"]).get("decoder"))
        byte_level, alphabet = "ByteLevel" in decoder, set(byte_level_alphabet())
        table = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if i in self.added:
                table[i] = 0 if self.added[i].special else len(self.added[i].content.encode("utf-8"))
                continue
            piece = self.tok.id_to_token(i)
            if piece is None:
                continue
            if byte_level:
                table[i] = sum(1 if c in alphabet else len(c.encode("utf-8")) for c in piece)
            elif "ByteFallback" in decoder and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table[i] = 1
            else:
                if "WordPiece" in decoder and piece.startswith("##"):
                    piece = piece[2:]
                table[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
        return table

    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def hf_pipeline(self) -> Pipeline:
        """The tokenizer.json less a post-processor that adds special tokens (a BOS): ``encode`` leaves them out,
        so the model never saw them; the unknown token is its model's."""
        tok = type(self.tok).from_str(self.tok.to_str())  # a copy (truncation and padding already off)
        if tok.post_processor is not None and tok.post_processor.num_special_tokens_to_add(False):
            tok.post_processor = None
        model = json.loads(self._files["tokenizer.json"]).get("model", {})
        unk = model.get("unk_token") or (tok.id_to_token(model["unk_id"]) if model.get("unk_id") is not None else None)
        return Pipeline(tok, unk_token=unk)
