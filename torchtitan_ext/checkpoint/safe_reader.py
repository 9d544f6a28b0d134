"""Reading a checkpoint folder without running code from it.

DCP keeps a checkpoint's index in ``.metadata``, a pickle, and every non-tensor entry of a state dict (a step,
a loader position) as a ``torch.save`` of it; torch's ``FileSystemReader`` and ``DefaultLoadPlanner`` unpickle
both without restriction, so a ``.metadata`` or a bytes entry rewritten by whoever sent the folder runs any
command it names when the folder is loaded (``checksums.json`` does not help: a sender rewrites it too).

``SafeFileSystemReader`` is torch's reader with both paths restricted:

* ``read_metadata`` unpickles through ``MetadataUnpickler``, whose ``find_class`` admits only what DCP writes
  there: the classes of ``torch.distributed.checkpoint.metadata``, the storage record ``_StorageInfo``,
  ``torch.Size``, torch's dtypes and layouts, paths (the checkpoint id) and plain containers, and
  ``getattr`` only as some Python versions (3.11.2, Debian's) pickle an enum member: ``getattr(enum class,
  member name)`` on one of those classes;
* every bytes entry is first unpickled by torch's ``weights_only`` unpickler (tensors, numbers, strings and
  containers only) before the planner places it.

Anything else refuses the whole file with ``UnsafeCheckpointFile``: one line naming the file and the global it
asked for. Every loader of the project (the trainer's resume and initial weights, eval, generate, export, quant
export, the teacher pass) reads checkpoints through this module only.
"""

from __future__ import annotations

import enum
import functools
import io
import os
import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from torchtitan_ext.errors import UserError

_PLAIN = {("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict"),
          ("torch", "Size"), ("torch.serialization", "_get_layout"),
          ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_PATHS = {"PosixPath": Path, "PurePosixPath": PurePosixPath, "PureWindowsPath": PureWindowsPath}


class UnsafeCheckpointFile(UserError):
    """A checkpoint file asks to unpickle something DCP never writes there: it would run code if loaded."""


def _admitted(module: str, name: str) -> Any | None:
    """The object ``module.name`` when DCP's metadata may hold it, else None."""
    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        return found if isinstance(found, type) else None
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
        return getattr(torch, name)
    if module in ("pathlib", "pathlib._local") and name in _PATHS:
        return _PATHS[name]
    if (module, name) in _PLAIN:
        if module == "torch.distributed.checkpoint.filesystem":
            return getattr(dcp_filesystem, name)
        return getattr(__import__(module, fromlist=[name]), name)
    return None


def _enum_member(path: str | os.PathLike, cls: Any, name: Any) -> enum.Enum:
    """``getattr(cls, name)`` where ``cls`` is an admitted enum class and ``name`` one of its members."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeCheckpointFile(
        f"{path}: refused to unpickle getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}), which DCP "
        f"never writes there (a file that would run code when loaded); use a checkpoint from a source you trust")


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler of DCP's ``.metadata`` that refuses every global DCP does not write there."""

    def __init__(self, file: Any, path: str | os.PathLike):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return functools.partial(_enum_member, self.path)
        found = _admitted(module, name)
        if found is None:
            raise UnsafeCheckpointFile(
                f"{self.path}: refused to unpickle {module}.{name}, which DCP never writes there (a file that "
                f"would run code when loaded); use a checkpoint from a source you trust")
        return found


def read_metadata_file(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The ``Metadata`` in the file ``path``, unpickled by ``MetadataUnpickler``."""
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f, path).load()
        except UnsafeCheckpointFile:
            raise
        except Exception as e:  # noqa: BLE001  truncated or not a pickle at all: one line naming the file
            raise ValueError(f"{path}: not a DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointFile(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _SafeBytes:
    """The load planner, seen by the reader: each bytes entry is unpickled by torch's ``weights_only``
    unpickler first, and refused naming the file when it asks for anything else."""

    def __init__(self, planner: LoadPlanner, reader: SafeFileSystemReader):
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            file = Path(self._reader.path) / self._reader.storage_data[read_item.storage_index].relative_path
            asked = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = f"it asks for {asked[1]}" if asked else "it is not a plain value"
            raise UnsafeCheckpointFile(
                f"{file}: refused the entry {read_item.dest_index.fqn} ({what}, which the weights-only unpickler "
                f"does not admit): a file that would run code when loaded; use a checkpoint from a source you "
                f"trust") from None
        self._planner.load_bytes(read_item, io.BytesIO(data))  # only what weights_only admitted


class SafeFileSystemReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader`` whose metadata and bytes entries admit only what DCP writes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        return super().read_data(plan, _SafeBytes(planner, self))  # type: ignore[arg-type]


def checkpoint_metadata(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint folder's entries (fqn -> DCP storage metadata), read safely."""
    return SafeFileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata


def safe_load(state: dict[str, Any], checkpoint: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.load`` of ``state`` from the folder ``checkpoint`` through ``SafeFileSystemReader``. The metadata
    is checked before DCP reads it (a refusal is raised as itself, not inside DCP's per-rank report), and a
    refused bytes entry comes out of DCP's ``CheckpointException`` as the ``UnsafeCheckpointFile`` it is."""
    reader = SafeFileSystemReader(str(checkpoint))
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        refused = next((f for f in map(_exception_of, e.failures.values()) if isinstance(f, UnsafeCheckpointFile)),
                       None)
        if refused is not None:
            raise refused from None
        raise


def _exception_of(failure: Any) -> BaseException | None:
    exc = failure[0] if isinstance(failure, tuple) else failure
    return exc if isinstance(exc, BaseException) else None
