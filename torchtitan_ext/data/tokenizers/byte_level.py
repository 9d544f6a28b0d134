"""GPT-2's byte-level alphabet (each byte a printable character in byte-level vocabularies: the bits-per-byte
lengths of ``hf.py``) and a byte-level BPE of the ``tokenizers`` library that encodes as tiktoken does: the
Hugging Face form of the byte and tiktoken kinds."""

from __future__ import annotations

import re

from torchtitan_ext.data.tokenizers.common import require
from torchtitan_ext.data.tokenizers.hf_files import WHAT


def byte_level_alphabet() -> list[str]:
    """The printable character standing for each byte 0..255 (printable Latin-1 bytes themselves, the others
    U+0100 onwards in byte order)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(others)) for b in range(256)]


def _oniguruma(pattern: str) -> str:
    """A tiktoken (Rust regex) split pattern for the tokenizers library (Oniguruma): there ``{m,n}+`` repeats the
    interval instead of being possessive; the patterns end an alternative with it, where greedy matches alike."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def byte_level_bpe(ranks: dict[bytes, int], special_tokens: dict[str, int], pattern: str | None = None):
    """A ``tokenizers.Tokenizer`` encoding as tiktoken does: ``ranks`` (token bytes -> id) merged lowest rank
    first, the text split by ``pattern`` first (None: the whole text is one piece). tiktoken merges any adjacent
    pair whose concatenation is a token, so every split of a token into two tokens is a merge (ranked by the
    token); it takes a piece that is itself a token whole (``ignore_merges``, only with a pattern: without one
    the piece is the whole text). ``special_tokens`` keep their ids and are never merged into."""
    tk = require("tokenizers", WHAT)
    alphabet = byte_level_alphabet()
    chars = lambda token: "".join(alphabet[b] for b in token)
    vocab = {**{chars(t): i for t, i in ranks.items()}, **special_tokens}
    merges = [(chars(t[:k]), chars(t[k:])) for t in sorted(ranks, key=ranks.__getitem__) for k in range(1, len(t))
              if t[:k] in ranks and t[k:] in ranks]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, ignore_merges=pattern is not None))
    split = [tk.pre_tokenizers.Split(tk.Regex(_oniguruma(pattern)), behavior="isolated")] if pattern else []
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [*split, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t in sorted(special_tokens, key=special_tokens.__getitem__)])
    return tok
