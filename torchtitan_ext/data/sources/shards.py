"""``data.dataset = "shards"``: token shards prepared elsewhere (``python -m torchtitan_ext.data.prepare``,
or FineWeb's published shards), named by ``data.train_path`` / ``data.val_path`` (folder, file or glob).
``stream_loaders`` is what the single-stream sources (this one, the built-in corpus) share."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.data.base import Loader, LoaderContext, require_static_mixing
from torchtitan_ext.data.packers.concat import TokenDataLoader
from torchtitan_ext.data.shards import list_shards
from torchtitan_ext.errors import ConfigError


def stream_loaders(train_files: list[Path], val_files: list[Path], ctx: LoaderContext
                   ) -> tuple[Loader, TokenDataLoader | None]:
    """(training loader by ``ctx.packer``, given the sidecars and documents; validation windows in order)."""
    loader = ctx.packer(train_files, ctx, ctx.shuffle, sidecars=ctx.sidecars, documents=ctx.documents)
    val = TokenDataLoader(val_files, shuffle=False, documents=ctx.documents, **ctx.window_args()) if val_files else None
    return loader, val


def shard_files(data) -> tuple[list[Path], list[Path]]:
    """(training, validation) shard files of ``data.train_path`` / ``data.val_path``."""
    if not data.train_path:
        raise ConfigError(f"data.train_path is empty: expected a folder or glob of token shards "
                          f"(data.dataset = {data.dataset!r})")
    return (list_shards(data.train_path, "data.train_path"),
            list_shards(data.val_path, "data.val_path") if data.val_path else [])


def build(data, ctx: LoaderContext):
    require_static_mixing(data)
    return stream_loaders(*shard_files(data), ctx)
