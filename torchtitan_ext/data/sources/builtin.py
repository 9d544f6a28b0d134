"""``data.dataset = "builtin"``: the Python standard library's sources (``data/corpus.py``), tokenized
into cached shards on first use."""

from __future__ import annotations

from torchtitan_ext.data.base import LoaderContext, require_static_mixing
from torchtitan_ext.data.corpus import builtin_shards
from torchtitan_ext.data.sources.shards import stream_loaders


def build(data, ctx: LoaderContext):
    require_static_mixing(data)
    train, val = builtin_shards(ctx.tokenizer, ctx.cache_dir)
    return stream_loaders([train], [val], ctx)
