"""What the single-stream sources (built-in corpus, token shards) share: the training packer and a plain
validation stream over lists of shard files."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.data.base import Loader, LoaderContext
from torchtitan_ext.data.packers.concat import TokenDataLoader


def stream_loaders(train_files: list[Path], val_files: list[Path], ctx: LoaderContext
                   ) -> tuple[Loader, TokenDataLoader | None]:
    """(training loader by ``ctx.packer``, given the sidecars and documents; validation windows in order)."""
    loader = ctx.packer(train_files, ctx, ctx.shuffle, sidecars=ctx.sidecars, documents=ctx.documents)
    val = TokenDataLoader(val_files, shuffle=False, vocab_limit=ctx.vocab_limit, documents=ctx.documents,
                          **ctx.window_args()) if val_files else None
    return loader, val
