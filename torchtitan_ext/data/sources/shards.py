"""``data.dataset = "shards"``: token shards prepared elsewhere (``python -m torchtitan_ext.data.prepare``,
or FineWeb's published shards), named by ``data.train_path`` / ``data.val_path`` (folder, file or glob)."""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext.config.loader import ConfigError
from torchtitan_ext.data.base import LoaderContext, require_static_mixing
from torchtitan_ext.data.shards import list_shards
from torchtitan_ext.data.sources.stream import stream_loaders


def shard_files(data) -> tuple[list[Path], list[Path]]:
    """(training, validation) shard files of ``data.train_path`` / ``data.val_path``."""
    if not data.train_path:
        raise ConfigError("data.train_path is empty: expected a folder or glob of token shards "
                          "(data.dataset = 'shards')")
    train_files = list_shards(data.train_path, "data.train_path")
    val_files = list_shards(data.val_path, "data.val_path") if data.val_path else []
    return train_files, val_files


def build(data, ctx: LoaderContext):
    require_static_mixing(data)
    return stream_loaders(*shard_files(data), ctx)
