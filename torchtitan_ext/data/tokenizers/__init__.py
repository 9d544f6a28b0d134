"""Tokenizers behind one interface (``common.py``), chosen from ``data.tokenizer`` (and ``data.prepare
--tokenizer``) by :func:`open_tokenizer`:

* ``byte``: UTF-8 bytes and an end-of-text id (``byte.py``);
* ``builtin``: a SentencePiece BPE trained on the built-in corpus and cached (``data/corpus.py``);
* a SentencePiece ``.model`` (``sentencepiece.py``);
* a Hugging Face ``tokenizer.json``, or a folder holding it with ``tokenizer_config.json`` (``hf.py``);
* a tiktoken BPE file ``.tiktoken``, optionally ``:<encoding>`` naming its split pattern (``tiktoken.py``);
* a folder written by ``save`` (``tokenizer_meta.json``), e.g. a run's ``<dump_folder>/tokenizer/``.

A run keeps its tokenizer in ``<dump_folder>/tokenizer/`` (:func:`run_tokenizer`): evaluation, generation,
export and the teacher pass read it from there, and a resume with a different tokenizer is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan_ext.data.tokenizers import tiktoken
from torchtitan_ext.data.tokenizers.byte import ByteTokenizer
from torchtitan_ext.data.tokenizers.common import (
    EXTRA,
    META,
    BaseTokenizer,
    TokenizerError,
    read_meta,
)
from torchtitan_ext.data.tokenizers.hf import HFTokenizer
from torchtitan_ext.data.tokenizers.sentencepiece import SentencePieceTokenizer, train_bpe
from torchtitan_ext.data.tokenizers.tiktoken import TiktokenTokenizer

__all__ = ["EXTRA", "META", "RUN_FOLDER", "BaseTokenizer", "ByteTokenizer", "HFTokenizer",
           "SentencePieceTokenizer", "TiktokenTokenizer", "TokenizerError", "load_tokenizer", "open_tokenizer",
           "read_meta", "run_tokenizer", "train_bpe", "vocab_size_of"]

KINDS = {  # kind -> (folder, meta) -> the tokenizer saved there
    "byte": lambda folder, meta: ByteTokenizer(),
    "sentencepiece": lambda folder, meta: SentencePieceTokenizer(folder / meta["files"][0], name=meta["name"]),
    "hf": lambda folder, meta: HFTokenizer(folder / "tokenizer.json", name=meta["name"]),
    "tiktoken": lambda folder, meta: TiktokenTokenizer(folder / meta["files"][0], name=meta["name"],
                                                       **meta["settings"]),
}
RUN_FOLDER = "tokenizer"
VALID = ("byte, builtin, none, a tokenizer.json file or folder, a .tiktoken file (optionally :<encoding>), a "
         "SentencePiece .model, or a saved tokenizer folder")


def load_tokenizer(folder: str | os.PathLike) -> BaseTokenizer:
    """A tokenizer saved by ``save`` (its files and ``tokenizer_meta.json``); TokenizerError when the files
    no longer match the recorded fingerprint."""
    folder = Path(folder).expanduser()
    meta = read_meta(folder)
    if meta is None:
        raise TokenizerError(f"{folder}: no {META} (not a saved tokenizer folder)")
    if meta.get("kind") not in KINDS:
        raise TokenizerError(f"{folder / META}: unknown tokenizer kind {meta.get('kind')!r}")
    tok = KINDS[meta["kind"]](folder, meta)
    if tok.fingerprint() != meta.get("fingerprint"):
        raise TokenizerError(f"{folder}: the tokenizer files do not match the fingerprint in {META} (modified?)")
    return tok


def _open_path(spec: str) -> BaseTokenizer:
    path, encoding = tiktoken.split_spec(spec)
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / META).is_file():
            return load_tokenizer(p)
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p / "tokenizer.json")
        if found := sorted(p.glob("*.tiktoken")):
            return TiktokenTokenizer(found[0], encoding)
        if found := sorted(p.glob("*.model"), key=lambda f: f.name != "tokenizer.model"):
            return SentencePieceTokenizer(found[0])
        raise TokenizerError(f"data.tokenizer = {spec!r}: the folder holds no tokenizer (expected "
                             f"tokenizer.json, a .tiktoken file, a SentencePiece .model or {META})")
    if not p.is_file():
        raise TokenizerError(f"data.tokenizer = {spec!r}: no such file or folder (valid: {VALID})")
    if p.suffix == ".tiktoken":
        return TiktokenTokenizer(p, encoding)
    if p.suffix not in (".json", ".model"):
        raise TokenizerError(f"data.tokenizer = {spec!r}: unknown tokenizer file type {p.suffix or '(none)'!r} "
                             f"(valid: {VALID})")
    return HFTokenizer(p) if p.suffix == ".json" else SentencePieceTokenizer(p)


def open_tokenizer(spec: str, vocab_size: int = 4096, cache_dir: str | os.PathLike | None = None) -> BaseTokenizer:
    """The tokenizer ``spec`` (a ``data.tokenizer`` value) names; ``vocab_size`` and ``cache_dir`` are the
    builtin tokenizer's (trained on first use and cached there)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "builtin":
        from torchtitan_ext.data.tokenizers.builtin import builtin_bpe

        return builtin_bpe(vocab_size, Path(cache_dir or "~/.cache/torchtitan_ext").expanduser())
    if spec == "none":
        raise TokenizerError("data.tokenizer = 'none': pretokenized shards have no tokenizer")
    return _open_path(spec)


def vocab_size_of(spec: str, vocab_size: int = 4096) -> int:
    """The vocabulary ``spec`` names without training anything (the planner): builtin's is ``vocab_size``,
    none's 0, a file's or folder's read from it."""
    if spec == "builtin":
        return vocab_size
    if spec == "none":
        return 0
    return open_tokenizer(spec, vocab_size).vocab_size


def run_tokenizer(spec: str, vocab_size: int, cache_dir: str | os.PathLike | None, dump_folder: str | os.PathLike,
                  save: bool, resume: bool = True) -> BaseTokenizer:
    """The tokenizer of a run whose dump folder is ``dump_folder``. When ``<dump_folder>/tokenizer/`` holds
    one saved under the same setting and its source is gone (or is ``builtin``: nothing is retrained), that
    copy; otherwise the tokenizer ``spec`` names, which must match the saved copy's fingerprint when the
    job ``resume``s (a resume with another tokenizer stops here, in one line). ``save``: write the copy when
    there is none, or replace a stale one on a start from step 0 (rank 0)."""
    folder = Path(dump_folder).expanduser() / RUN_FOLDER
    meta = read_meta(folder)
    key = f"builtin:{vocab_size}" if spec == "builtin" else spec  # what identifies the setting
    path = Path(tiktoken.split_spec(spec)[0]).expanduser()
    if meta is not None and meta.get("spec") == key and (spec == "builtin" or (spec != "byte" and not path.exists())):
        return load_tokenizer(folder)
    tok = open_tokenizer(spec, vocab_size, cache_dir)
    stale = meta is not None and meta.get("fingerprint") != tok.fingerprint()
    if stale and resume:
        raise TokenizerError(
            f"{folder} holds this run's tokenizer ({meta.get('spec')!r}: {meta.get('kind')} "
            f"{meta.get('name')!r}, vocabulary {meta.get('vocab_size')}, {str(meta.get('fingerprint'))[:12]}) but "
            f"data.tokenizer = {spec!r} is another ({tok.kind} {tok.name!r}, vocabulary {tok.vocab_size}, "
            f"{tok.fingerprint()[:12]}); resume with the run's tokenizer (data.tokenizer = '{folder}') or use a new "
            "job.dump_folder")
    if (meta is None or stale) and save:
        tok.save(folder, replace=stale, spec=key)
    return tok
