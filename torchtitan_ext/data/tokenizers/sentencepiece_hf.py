"""A SentencePiece model as a ``tokenizers`` pipeline that encodes and decodes as the ``sentencepiece`` library
does (an export's tokenizer.json), read from the model file's protobuf: its pieces (scores, types), algorithm,
byte fallback and normalizer settings.

* BPE: SentencePiece merges the adjacent pair whose concatenation is the best-scored piece (leftmost first), so
  every split of a piece into two pieces is a merge, ranked by the piece's score;
* unigram: the pieces and their scores; pieces that are no text (control, unknown, byte) scored out of reach;
* normalization over the whole text, as SentencePiece's: the precompiled character map, extra spaces removed,
  spaces as ``▁``, the dummy ``▁`` prefix;
* special pieces are added tokens matched in the normalized text (so the dummy prefix is not repeated after
  them). Their own content is normalized too, which prefixes the ``▁``: a rule for a text that is exactly the
  token gives a user-defined symbol (``<|endoftext|>``, matched in text as SentencePiece does) its content
  back, a control or unknown piece (``<s>``, ``</s>``, ``<unk>``: text to SentencePiece) a space, which the
  normalized text never holds. The one text encoded otherwise than by SentencePiece is a special piece alone
  (give or take the spaces a model removes): it is that piece;
* decoding: control pieces vanish, the unknown piece is `` ⁇ ``, byte pieces are bytes, the dummy ``▁`` goes.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from torchtitan_ext.data.tokenizers.common import TokenizerError, require
from torchtitan_ext.data.tokenizers.hf_files import WHAT, Pipeline

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # ModelProto.SentencePiece.Type (5 unused, 6 byte)
UNIGRAM, BPE = 1, 2  # TrainerSpec.ModelType
SPECIAL = (UNKNOWN, CONTROL, USER_DEFINED)
EVERY = 1 << 30  # a count of leading ▁ for the decoder's Strip that means all of them
UNREACHABLE = 1e4  # how far below the worst piece a unigram vocabulary scores the pieces that are no text


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: an int (varint) or bytes (the rest); read by hand, the
    protobuf package is no dependency of ours."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire in (1, 2, 5):  # 64-bit, length-delimited, 32-bit
            n, i = _varint(buf, i) if wire == 2 else (8 if wire == 1 else 4, i)
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield key >> 3, value


@dataclass
class Model:
    """What the pipeline needs of a ModelProto (defaults: the proto's)."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type), by id
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    whitespace_suffix: bool = False
    unk_surface: str = " \u2047 "
    charsmap: bytes = b""
    dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def read_model(data: bytes) -> Model:
    """The ModelProto fields of a ``.model`` file: pieces (1), trainer_spec (2), normalizer_spec (3)."""
    m = Model()
    for number, value in _fields(data):
        if number == 1:
            piece = dict(_fields(value))
            score = struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0
            m.pieces.append((piece.get(1, b"").decode("utf-8"), score, piece.get(3, NORMAL)))
        elif number == 2:
            spec = dict(_fields(value))
            m.model_type, m.byte_fallback = spec.get(3, UNIGRAM), bool(spec.get(35, False))
            m.whitespace_suffix = bool(spec.get(24, False))
            m.unk_surface = spec[44].decode("utf-8") if 44 in spec else m.unk_surface
        elif number == 3:
            spec = dict(_fields(value))
            m.charsmap, m.dummy_prefix = spec.get(2, b""), bool(spec.get(3, True))
            m.remove_extra_whitespaces, m.escape_whitespaces = bool(spec.get(4, True)), bool(spec.get(5, True))
    return m


def _model(tk, m: Model, unk: str | None):
    if m.model_type == BPE:
        normal = {p for p, _, t in m.pieces if t == NORMAL}
        ranked = sorted((i for i, (_, _, t) in enumerate(m.pieces) if t == NORMAL), key=lambda i: (-m.pieces[i][1], i))
        merges = [(p[:k], p[k:]) for p in (m.pieces[i][0] for i in ranked) for k in range(1, len(p))
                  if p[:k] in normal and p[k:] in normal]
        vocab = {p: i for i, (p, _, _) in enumerate(m.pieces)}
        return tk.models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=m.byte_fallback, fuse_unk=True)
    worst = min((s for _, s, t in m.pieces if t == NORMAL), default=0.0) - UNREACHABLE
    unk_id = next((i for i, (_, _, t) in enumerate(m.pieces) if t == UNKNOWN), None)
    return tk.models.Unigram([(p, s if t == NORMAL else worst) for p, s, t in m.pieces], unk_id, m.byte_fallback)


def _normalizer(tk, m: Model):
    n = tk.normalizers
    steps = [n.Precompiled(m.charsmap)] if m.charsmap else []
    if m.remove_extra_whitespaces:
        steps += [n.Replace(tk.Regex(r"\A +| +\z"), ""), n.Replace(tk.Regex(" {2,}"), " ")]
    steps.append(n.Replace(" ", SPACE))
    prefix = SPACE if m.dummy_prefix else ""
    steps += [n.Prepend(SPACE)] if m.dummy_prefix else []
    steps += [n.Replace(tk.Regex(rf"\A{re.escape(prefix + p)}\z"), p if t == USER_DEFINED else f" {p}")
              for p, _, t in m.pieces if t in SPECIAL]
    return n.Sequence(steps)


def _decoder(tk, m: Model, unk: str | None):
    d = tk.decoders
    # an added token reaches the decoder in its normalized form (" <s>"), see _normalizer
    steps = [d.Replace(f" {p}", "") for p, _, t in m.pieces if t == CONTROL]
    steps += [d.Replace(f" {unk}", m.unk_surface)] if unk else []
    steps += [d.ByteFallback()] if m.byte_fallback else []
    steps.append(d.Fuse())
    if m.remove_extra_whitespaces:  # SentencePiece drops every leading ▁ then
        steps.append(d.Strip(SPACE, EVERY, 0))
    elif m.dummy_prefix:
        steps.append(d.Strip(SPACE, 1, 0))
    steps.append(d.Replace(SPACE, " "))
    return d.Sequence(steps)


def pipeline(data: bytes, where: str) -> Pipeline:
    """The model file ``data`` (``where`` names it) as a Pipeline; TokenizerError for a model that cannot be one
    (word / char models, whitespace as a suffix, unescaped spaces)."""
    tk = require("tokenizers", WHAT)
    try:
        m = read_model(data)
    except (ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise TokenizerError(f"{where}: unreadable SentencePiece model ({e})") from None
    if m.model_type not in (UNIGRAM, BPE) or m.whitespace_suffix or not m.escape_whitespaces:
        raise TokenizerError(f"{where}: only SentencePiece unigram and BPE models with spaces as a ▁ prefix have a "
                             "Hugging Face form")
    unk = next((p for p, _, t in m.pieces if t == UNKNOWN), None)
    tok = tk.Tokenizer(_model(tk, m, unk))
    tok.normalizer = _normalizer(tk, m)
    tok.decoder = _decoder(tk, m, unk)
    tok.add_special_tokens([tk.AddedToken(p, special=True, normalized=True)
                            for p, _, t in m.pieces if t in (UNKNOWN, CONTROL)])
    tok.add_tokens([tk.AddedToken(p, special=False, normalized=True) for p, _, t in m.pieces if t == USER_DEFINED])
    return Pipeline(tok, unk_token=unk)
