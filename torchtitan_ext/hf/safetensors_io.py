"""Safetensors folders as transformers writes them: one ``model.safetensors``, or shards
``model-00001-of-00003.safetensors`` listed by ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``: tensor name -> file). Writing plans the shards from sizes alone, so a caller can produce one
shard at a time; reading goes by tensor or by slice through the files' memory maps and counts the bytes it
returns, so a rank can show that it read only its share."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from torchtitan_ext.hf.architectures import ExportError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# Hugging Face's units: decimal (5GB = 5e9 bytes) and binary with an "i" (2MiB = 2 * 2**20).
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def parse_size(value: str | int, what: str = "--max-shard-size") -> int:
    """Bytes from ``5GB``, ``500MB``, ``2MiB`` or a plain number of bytes; ExportError naming ``what``."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
        if m is None:
            raise ExportError(f"{what} = {value!r}: expected a size such as 5GB, 500MB, 2MiB or a number of bytes")
        size = int(float(m[1]) * _UNITS[(m[2] or "B").upper()])
    if size <= 0:
        raise ExportError(f"{what} = {value!r}: expected a positive size")
    return size


def plan_shards(sizes: Sequence[int], max_shard_size: int) -> list[range]:
    """Consecutive runs of tensors (by position) of at most ``max_shard_size`` bytes each; a tensor larger
    than that is a shard of its own."""
    shards: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > max_shard_size:
            shards.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        shards.append(range(start, len(sizes)))
    return shards


def shard_files(n: int) -> list[str]:
    """The file names of ``n`` shards: one ``model.safetensors``, else numbered with an index."""
    return [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file; an I/O failure (a full disk) is an ``OSError`` naming ``path`` with its errno
    (safetensors raises its own ``SafetensorError`` with the errno only in its text)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        if (code := re.search(r"os error (\d+)", str(e))) is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from None
    # safetensors writes through a private temporary file (mode 0600): give the shard the mode open() would,
    # so that an export is readable by whoever the umask lets read the rest of the folder
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> file name, from the index (a sharded folder) or the single file's header."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise ExportError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
            raise ExportError(f"{index}: not a safetensors index (expected a weight_map of tensor -> file name)")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ExportError(f"{index}: names {folder / missing[0]}, which does not exist "
                              f"({len(missing)} shard file(s) missing)")
        return weight_map
    if (folder / SINGLE).is_file():
        return {}  # filled from the file's header
    raise ExportError(f"{folder}: no weights (expected {SINGLE} or {INDEX} with its shards)")


class SafetensorsReader:
    """A folder's tensors by name, each file opened once (memory-mapped); ``bytes_read`` counts what the
    reads returned. Every file's header is checked on opening: a damaged or truncated file is one line
    naming it, before anything is read."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        weight_map = _weight_map(self.folder)
        files = sorted(set(weight_map.values())) or [SINGLE]
        self._handles = {}
        for name in files:
            try:
                self._handles[name] = safe_open(str(self.folder / name), framework="pt")
            except Exception as e:  # noqa: BLE001  safetensors raises its own SafetensorError (or an OSError)
                raise ExportError(f"{self.folder / name}: cannot read it ({type(e).__name__}: {e})") from None
        self.file_of = weight_map or {t: SINGLE for t in self._handles[SINGLE].keys()}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for name, file in self.file_of.items():
            try:
                piece = self._handles[file].get_slice(name)
            except Exception:  # noqa: BLE001  a name the index puts in a file that lacks it
                raise ExportError(f"{self.folder / INDEX}: puts {name} in {file}, which has no such tensor") from None
            self.shapes[name] = tuple(piece.get_shape())
            self.dtypes[name] = _DTYPES.get(piece.get_dtype(), torch.float32)
        self.bytes_read = 0

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor ``name``, or the box ``index`` (one slice per leading dimension) of it."""
        file = self.file_of[name]
        try:
            t = self._handles[file].get_slice(name)[index] if index else self._handles[file].get_tensor(name)
        except Exception as e:  # noqa: BLE001  an I/O error under the memory map
            raise ExportError(f"{self.folder / file}: cannot read {name} ({type(e).__name__}: {e})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def total_bytes(self) -> int:
        return sum(torch.Size(s).numel() * self.dtypes[n].itemsize for n, s in self.shapes.items())

    def stored_dtype(self) -> torch.dtype:
        """The floating dtype the tensors are stored in (float32 when they mix several)."""
        floating = {d for d in self.dtypes.values() if d.is_floating_point}
        return floating.pop() if len(floating) == 1 else torch.float32

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
