"""UTF-8 bytes 0..255 plus an end-of-text id 256 (``data.tokenizer = "byte"``: the fastest tests)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from torchtitan_ext.data.tokenizers.common import BaseTokenizer


class ByteTokenizer(BaseTokenizer):
    kind = "byte"
    vocab_size = 257
    eot_id = 256
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        table = np.ones(self.vocab_size, dtype=np.int64)
        table[self.eot_id] = 0
        return table


def load(folder, meta: dict) -> ByteTokenizer:
    return ByteTokenizer()
