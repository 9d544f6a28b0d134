"""What every tokenizer kind shares: the interface (``BaseTokenizer``), saving into a run folder with its
``tokenizer_meta.json`` (vocabulary size, special ids, fingerprint) and the fingerprint itself: the sha256 of the
kind, the tokenizer's files and the settings that are not in them (a tiktoken split pattern)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torchtitan_ext.data.tokenizers.hf_files import Pipeline, tokenizer_files
from torchtitan_ext.errors import ConfigError

META = "tokenizer_meta.json"
EXTRA = "pip install -e '.[data]'"


class TokenizerError(ConfigError):
    """A tokenizer that cannot be built or loaded; one line naming it."""


def require(module: str, what: str):
    """Import ``module`` (an optional library); TokenizerError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TokenizerError(f"{what} needs the {module!r} package: {EXTRA}") from None


def file_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BaseTokenizer:
    """The interface. Subclasses set ``kind``, ``name``, ``vocab_size``, ``eot_id`` (and ``bos_id`` /
    ``pad_id`` when they have them) and implement ``encode``, ``decode``, ``token_byte_lengths`` and
    ``files`` (file name -> bytes, what ``save`` writes and ``load_tokenizer`` reads back)."""

    kind = ""
    name = ""
    vocab_size = 0
    eot_id = 0
    bos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = None  # a Hugging Face tokenizer_config.json's

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_byte_lengths(self) -> np.ndarray:
        """(vocab_size,) int64: UTF-8 bytes each token id stands for (special tokens 0), for bits per byte."""
        raise NotImplementedError

    def files(self) -> dict[str, bytes]:
        return {}

    def hf_files(self, model_max_length: int | None = None) -> dict[str, bytes]:
        """This tokenizer as Hugging Face files (file name -> bytes: tokenizer.json, tokenizer_config.json,
        special_tokens_map.json) for an exported model: AutoTokenizer on them encodes and decodes as we do, its
        eos our end-of-text id (``hf_files.py``)."""
        return tokenizer_files(self, self.hf_pipeline(), model_max_length)

    def hf_pipeline(self) -> Pipeline:
        """This tokenizer as a ``tokenizers.Tokenizer`` and the settings of its config."""
        raise TokenizerError(f"{self.kind} tokenizer {self.name!r}: no Hugging Face form")

    def settings(self) -> dict:
        """What ``load`` needs besides the files (part of the fingerprint)."""
        return {}

    def special_ids(self) -> dict[str, int | None]:
        return {"eot_id": int(self.eot_id), "bos_id": self.bos_id, "pad_id": self.pad_id}

    def fingerprint(self) -> str:
        desc = {"kind": self.kind, "files": {n: file_hash(b) for n, b in sorted(self.files().items())},
                "settings": self.settings(), **self.special_ids()}
        return file_hash(json.dumps(desc, sort_keys=True).encode())

    def describe(self) -> str:
        ids = ", ".join(f"{k[:-3]} {v}" for k, v in self.special_ids().items() if v is not None)
        return f"{self.kind} tokenizer {self.name!r} (vocabulary {self.vocab_size:,}; {ids})"

    def save(self, folder: str | os.PathLike, replace: bool = False, **extra) -> Path:
        """Write the files and ``tokenizer_meta.json`` into ``folder`` atomically (a temporary sibling folder
        renamed into place); a folder already there (another process won) is left as it is unless ``replace``."""
        folder = Path(folder)
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, data in self.files().items():
            (tmp / name).write_bytes(data)
        meta = {"kind": self.kind, "name": self.name, "vocab_size": int(self.vocab_size), **self.special_ids(),
                "fingerprint": self.fingerprint(), "files": sorted(self.files()), "settings": self.settings(), **extra}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        if replace and folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (folder / META).is_file():
                raise
        return folder

    def _known(self, ids: Iterable[int]) -> list[int]:
        """Ids within the vocabulary (a model's padded embedding may sample past it)."""
        return [int(i) for i in ids if 0 <= int(i) < self.vocab_size]


def read_meta(folder: str | os.PathLike) -> dict | None:
    """A saved tokenizer folder's ``tokenizer_meta.json``, or None when there is none."""
    path = Path(folder) / META
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: unreadable tokenizer record ({e})") from None
