"""The data layer's one entry: ``cfg.data`` -> tokenizer, loaders and the helpers handed to them.

Sources and packers are tables: a new source (parquet, Hugging Face datasets, chat data) is a module under
``data/sources/`` with ``build(data, ctx) -> (training loader, validation loader(s) or None)`` and one line
in ``SOURCES``; a packer is a module under ``data/packers/`` with ``build(files, ctx, shuffle, sidecars=None,
documents=None)`` and one line in ``PACKERS``. Nothing else in ``data/`` imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from torchtitan_ext.config.job_config import DataSection, JobConfig
from torchtitan_ext.data.base import Loader, LoaderContext, PretokenizedVocab
from torchtitan_ext.data.documents import Documents
from torchtitan_ext.data.packers import bfd, concat
from torchtitan_ext.data.sources import builtin, chat, domains, shards, trees
from torchtitan_ext.data.tokenizers import BaseTokenizer, open_tokenizer, run_tokenizer
from torchtitan_ext.errors import ConfigError

SOURCES: dict[str, Callable] = {
    "builtin": builtin.build,
    "shards": shards.build,
    "trees": trees.build,
    "domains": domains.build,
    "chat": chat.build,
}
PACKERS: dict[str, Callable] = {
    "concat": concat.build,
    "bfd": bfd.build,
}


class DataBundle(NamedTuple):
    loader: Loader  # training loader (a MixingLoader with data.domains)
    val_loader: Loader | dict[str, Loader] | None
    documents: Documents | None  # data.attention == "document": the helper the loaders use


def build_tokenizer(data: DataSection, dump_folder: str | None = None, save: bool = False,
                    resume: bool = True) -> BaseTokenizer | PretokenizedVocab:
    """The tokenizer ``data.tokenizer`` names (``data/tokenizers``); for none (pretokenized shards) a stand-in
    whose vocabulary comes from model.vocab_size. ``dump_folder``: the run's, whose ``tokenizer/`` copy is used, checked
    against (``resume``), or (``save``) written (``data/tokenizers.run_tokenizer``)."""
    if data.tokenizer == "none":
        if data.dataset == "builtin":
            raise ConfigError("data.tokenizer = 'none' needs data.dataset = 'shards' (the built-in corpus is "
                              "raw text)")
        return PretokenizedVocab()
    if dump_folder is not None:
        return run_tokenizer(data.tokenizer, data.tokenizer_vocab_size, _cache_dir(data), dump_folder, save, resume)
    return open_tokenizer(data.tokenizer, data.tokenizer_vocab_size, _cache_dir(data))


def build_loaders(cfg: JobConfig, tokenizer, *, dp_rank: int, dp_world_size: int, vocab_limit: int,
                  sidecars: Callable[[Loader], object] | None = None) -> DataBundle:
    """Training and validation loaders of this data-parallel rank. ``vocab_limit``: a token id >= it stops
    the job naming its shard (0: unchecked). ``sidecars(loader)``: distillation's sidecars, built by the
    plain shard stream (other loaders leave ``loader.sidecars`` None)."""
    d, t = cfg.data, cfg.training
    name = source_name(d)
    if d.packing not in PACKERS:
        raise ConfigError(f"data.packing = {d.packing!r}: unknown packer; valid: {', '.join(PACKERS)}")
    if d.attention == "document" and getattr(tokenizer, "eot_id", None) is None:
        raise ConfigError("data.attention = 'document' needs a tokenizer with an end-of-text token")
    documents = Documents(tokenizer.eot_id, d.position_reset) if d.attention == "document" else None
    ctx = LoaderContext(tokenizer=tokenizer, cache_dir=_cache_dir(d), seq_len=t.seq_len,
                        local_batch_size=t.local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
                        seed=cfg.job.seed, shuffle=d.shuffle, vocab_limit=vocab_limit, packer=PACKERS[d.packing],
                        documents=documents, sidecars=sidecars)
    loader, val_loader = SOURCES[name](d, ctx)
    return DataBundle(loader, val_loader, documents)


def describe_data(d: DataSection) -> str:
    """The data this job reads, for its start-up line (a config's ``job.description`` may predate overrides)."""
    val = f", validation {d.val_path}" if d.val_path else ", no validation data"
    if d.dataset == "builtin":
        what = "the built-in corpus (the Python standard library's sources)"
    elif d.dataset == "domains":
        names = [str(t.get("name", "?")) if isinstance(t, dict) else "?" for t in d.domains]
        what = f"{len(d.domains)} weighted domains ({', '.join(names)})"
    elif d.dataset == "chat":
        what = f"conversations {d.train_path}{val}"
    else:
        what = f"{'tree ' if d.dataset == 'trees' else ''}shards {d.train_path}{val}"
    return f"data: {what}; tokenizer {d.tokenizer}"


def source_name(d: DataSection) -> str:
    """The ``SOURCES`` key, which ``data.dataset`` alone names: ConfigError (one line) where another key asks
    for another source, so that no key silently overrides the one the user wrote."""
    if d.dataset not in SOURCES:
        raise ConfigError(f"data.dataset = {d.dataset!r}: unknown source; valid: {', '.join(SOURCES)}")
    if d.attention == "tree" and d.dataset != "trees":
        raise ConfigError(f"data.attention = 'tree' needs data.dataset = 'trees' (got {d.dataset!r})")
    if d.dataset == "trees" and d.attention != "tree":
        raise ConfigError(f"data.dataset = 'trees' needs data.attention = 'tree' (got {d.attention!r})")
    if d.domains and d.dataset != "domains":
        raise ConfigError(f"data.domains is set: needs data.dataset = 'domains' (got {d.dataset!r})")
    if d.dataset == "domains" and not d.domains:
        raise ConfigError("data.dataset = 'domains' needs [[data.domains]] tables")
    return d.dataset


def _cache_dir(data: DataSection) -> Path:
    return Path(os.path.expanduser(data.cache_dir))
