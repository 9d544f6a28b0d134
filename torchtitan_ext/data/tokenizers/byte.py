"""UTF-8 bytes 0..255 plus an end-of-text id 256 (``data.tokenizer = "byte"``: the fastest tests)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from torchtitan_ext.data.tokenizers.byte_level import byte_level_bpe
from torchtitan_ext.data.tokenizers.common import BaseTokenizer, require
from torchtitan_ext.data.tokenizers.hf_files import WHAT, Pipeline
from torchtitan_ext.data.tokenizers.tiktoken import ENDOFTEXT


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

    def hf_pipeline(self) -> Pipeline:
        """The bytes as a byte-level vocabulary without merges and ``<|endoftext|>`` at 256, which the text
        never holds (its literal is bytes) and which decodes to nothing, as here."""
        tk = require("tokenizers", WHAT)
        tok = byte_level_bpe({bytes([b]): b for b in range(256)}, {ENDOFTEXT: self.eot_id})
        tok.decoder = tk.decoders.Sequence([tk.decoders.Replace(ENDOFTEXT, ""), tok.decoder])
        return Pipeline(tok, split_special_tokens=True)
