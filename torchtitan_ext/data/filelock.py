"""A lock file that lets one process build a cached file (a tokenizer, corpus shards) while the others wait."""

from __future__ import annotations

import fcntl
from pathlib import Path


class FileLock:
    """An exclusive lock on ``path`` so that one process builds a cached file while the others wait."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()
