"""Hugging Face folder -> our Decoder (``load_hf``) or into a job's (sharded) model (``load_hf_weights``).

Both read one ``model.safetensors`` or an index and its shards (``safetensors_io.py``), through the layout's
tensor names (``architectures.hf_layout``), tensor by tensor or slice by slice: no full copy of the model is
ever built beside the one being filled.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan_ext.hf.architectures import ExportError, args_from_config, hf_layout, stacked
from torchtitan_ext.hf.safetensors_io import SafetensorsReader
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder

log = logging.getLogger(__name__)

# Wrappers whose names appear in a parallelized part's state-dict keys but not in the model's FQNs
# (DDP, torch.compile per block, activation checkpointing, FSDP1).
_WRAPPERS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
# config.json keys that may differ between a folder and the job that loads it: the RoPE table's length, the
# dtype, the token ids, and MoDE's training-only coefficients.
_FREE = {"max_position_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
         "aux_loss_coef", "router_z_loss_coef", "bias_update_rate"}


def read_config(folder: Path) -> ModelArgs:
    """The ``ModelArgs`` of a folder's config.json; ExportError naming the file."""
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not a JSON object ({e})") from None
    return args_from_config(config, str(path))


def _fqn(key: str) -> str:
    return ".".join(p for p in key.split(".") if p not in _WRAPPERS)


def _box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's tensor, its shape, its offset in the global tensor). A DTensor's local shard is the box
    DCP also assumes for it (``compute_local_shape_and_global_offset``), including FSDP x TP's strided
    sharding of one dimension (FSDP's share of a TP shard is a contiguous range of it)."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(shape), tuple(offset)
    return t, tuple(t.shape), (0,) * t.ndim


def _fill(parts: list[nn.Module], reader: SafetensorsReader, names: dict[str, tuple[str, ...]]) -> int:
    """Copy each part's slices from the folder; returns how many tensors of the parts the folder did not
    cover (left as they are)."""
    state = [(_fqn(key), t) for part in parts for key, t in part.state_dict(keep_vars=True).items()]
    targets = [(fqn, t) for fqn, t in state if names.get(fqn)]
    missing = sorted({n for fqn, _ in targets for n in names[fqn] if n not in reader.shapes})
    if missing:
        raise ExportError(f"{reader.folder}: no tensor {missing[0]} ({len(missing)} tensors missing)")
    skipped = len(state) - len(targets)
    with torch.no_grad():
        for fqn, t in targets:
            hf = names[fqn]
            want = tuple(t.shape[1:]) if stacked(hf) else tuple(t.shape)
            wrong = next((n for n in hf if reader.shapes[n] != want), None)
            if wrong is not None:
                raise ExportError(f"{reader.folder}: {wrong} has shape {list(reader.shapes[wrong])}, the model "
                                  f"expects {list(want)} ({fqn}{' per expert' if stacked(hf) else ''})")
            local, shape, offset = _box(t)
            if local.numel() == 0:
                continue
            box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            if stacked(hf):  # the local experts, each its slice of the rest
                for i, e in enumerate(range(box[0].start, box[0].stop)):
                    local[i].copy_(reader.read(hf[e], box[1:]))
            else:
                local.copy_(reader.read(hf[0], box))
    return skipped


def load_hf(path: str | Path, dtype: torch.dtype | None = None) -> Decoder:
    """Our Decoder (CPU, eval mode) from a Hugging Face folder of one of the architectures of
    ``architectures.py`` (one file or sharded), in the dtype its tensors are stored in unless ``dtype``."""
    folder = Path(path).expanduser()
    args = read_config(folder)
    with SafetensorsReader(folder) as reader:
        dtype = dtype or reader.stored_dtype()
        with torch.device("meta"):
            model = Decoder(args).to(dtype)
        model.to_empty(device="cpu")
        model.init_buffers(torch.device("cpu"))
        model.to(dtype)  # the RoPE tables, made in float32
        _fill([model], reader, hf_layout(args).names)
    return model.eval()


def load_hf_weights(parts: list[nn.Module], path: str | Path, args: ModelArgs) -> int:
    """Load a Hugging Face folder into the model ``parts`` of shape ``args`` (this rank's: FSDP / TP / EP
    DTensors, pipeline stages), each rank reading only the slices it holds: the bytes it read are returned.
    The folder's config must describe ``args`` (``max_position_embeddings`` may differ), else ExportError
    naming the first key that differs. Tensors of the model the layout does not name (none for a native
    architecture's own) keep their initialisation."""
    folder = Path(path).expanduser()
    layout = hf_layout(args)
    mine, saved = layout.config, hf_layout(read_config(folder)).config
    diff = [k for k in mine if k not in _FREE and mine[k] != saved.get(k)]
    if diff:
        raise ExportError(f"checkpoint.initial_load_path = {str(path)!r}: {diff[0]} is {saved.get(diff[0])!r}, "
                          f"the job's model has {mine[diff[0]]!r}")
    with SafetensorsReader(folder) as reader:
        skipped = _fill(parts, reader, layout.names)
        log.info(f"{folder}: this rank read {reader.bytes_read:,} of the folder's {reader.total_bytes():,} bytes"
                 + (f"; {skipped} tensors of the model are not in it and keep their initialisation" if skipped
                    else ""))
        return reader.bytes_read
