"""tiktoken BPE files (``.tiktoken``: one ``base64(token bytes) rank`` per line), encoded by the ``tiktoken``
library with a split pattern: ``data.tokenizer = "enc.tiktoken:o200k_base"`` names the encoding whose
pattern (and, for that encoding's own file, special tokens) to use; without a name, a file of a known
encoding's size takes that encoding's, any other file cl100k_base's pattern with ``<|endoftext|>`` at the id
after the last rank."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torchtitan_ext.data.tokenizers.byte_level import byte_level_bpe
from torchtitan_ext.data.tokenizers.common import BaseTokenizer, TokenizerError, file_hash, require
from torchtitan_ext.data.tokenizers.hf_files import Pipeline

ENDOFTEXT = "<|endoftext|>"
_R50K = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
           r"""\s*[\r\n]|\s+(?!\S)|\s""")
_O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
# name -> (split pattern, number of ranks in its own file, its special tokens)
ENCODINGS: dict[str, tuple[str, int, dict[str, int]]] = {
    "gpt2": (_R50K, 50256, {ENDOFTEXT: 50256}),
    "r50k_base": (_R50K, 50256, {ENDOFTEXT: 50256}),
    "p50k_base": (_R50K, 50280, {ENDOFTEXT: 50256}),
    "cl100k_base": (_CL100K, 100256, {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                      "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "o200k_base": (_O200K, 199998, {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}),
}
DEFAULT = "cl100k_base"


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"path.tiktoken:o200k_base"`` -> (path, "o200k_base"); anything else -> (spec, None)."""
    path, sep, name = spec.rpartition(":")
    if sep and name in ENCODINGS and (path.endswith(".tiktoken") or Path(path).expanduser().is_dir()):
        return path, name
    return spec, None


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{path}:{n}: expected 'base64-token rank' (a tiktoken BPE file)") from None
    if not ranks:
        raise TokenizerError(f"{path}: empty tiktoken BPE file")
    return ranks


class TiktokenTokenizer(BaseTokenizer):
    kind = "tiktoken"

    def __init__(self, path: str | Path, encoding: str | None = None, name: str | None = None,
                 pattern: str | None = None, special_tokens: dict[str, int] | None = None):
        tiktoken = require("tiktoken", "a tiktoken BPE file")
        path = Path(path)
        self._file, self._bytes = path.name, path.read_bytes()
        ranks = read_ranks(path)
        if encoding is None and pattern is None:
            encoding = next((k for k, (_, n, _) in ENCODINGS.items() if n == len(ranks)), DEFAULT)
        if pattern is None:
            pattern, own_size, own_specials = ENCODINGS[encoding]
            special_tokens = dict(own_specials) if own_size == len(ranks) else {ENDOFTEXT: max(ranks.values()) + 1}
        self.encoding, self.pattern, self.special_tokens = encoding, pattern, dict(special_tokens or {})
        if ENDOFTEXT not in self.special_tokens:
            raise TokenizerError(f"{path}: no {ENDOFTEXT} special token")
        self.enc = tiktoken.Encoding(name=self._file, pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=self.special_tokens)
        self.ranks = ranks
        self._ids = set(ranks.values()) | set(self.special_tokens.values())
        self.vocab_size = max([*ranks.values(), *self.special_tokens.values()]) + 1
        self.eot_id = self.special_tokens[ENDOFTEXT]
        self.name = name or f"{path.stem}-{file_hash(self._bytes)[:10]}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.enc.encode_ordinary_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) in self._ids], errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        table = np.zeros(self.vocab_size, dtype=np.int64)
        for token, rank in self.ranks.items():
            table[rank] = len(token)
        return table

    def files(self) -> dict[str, bytes]:
        return {self._file: self._bytes}

    def settings(self) -> dict:
        return {"encoding": self.encoding, "pattern": self.pattern, "special_tokens": self.special_tokens}

    def hf_pipeline(self) -> Pipeline:
        """The ranks as a byte-level BPE with the same split pattern; special tokens in the text are text, as
        ``encode_ordinary`` reads them."""
        return Pipeline(byte_level_bpe(self.ranks, self.special_tokens, self.pattern), split_special_tokens=True)
