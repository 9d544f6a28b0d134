"""Our model -> a Hugging Face folder: safetensors (sharded past ``max_shard_size``, ``safetensors_io.py``),
``config.json``, ``generation_config.json``, the tokenizer's files and, where transformers has no class that
computes our model, our modeling file (loaded with ``trust_remote_code=True``).

From a DCP checkpoint (``export_checkpoint``) the folder is written one shard at a time: the shards are planned
from the checkpoint's metadata, and each is read by one partial ``dcp.load`` into tensors allocated for it in
the export dtype (DCP casts while copying), written and freed before the next. Host memory holds about one
shard (a stacked-expert tensor is read whole, so plus the largest of those), never the model. The folder is
written beside ``output`` under a temporary name and renamed into place at the end: a failed export leaves
nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from torchtitan_ext.checkpoint.manager import load_on_one_process, unreadable_reason
from torchtitan_ext.checkpoint.safe_reader import UnsafeCheckpointFile, checkpoint_metadata
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.hf.architectures import ExportError, HFLayout, hf_layout, remote_code_files, stacked
from torchtitan_ext.hf.safetensors_io import plan_shards, shard_files, write_index, write_shard
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.outputs import new_output

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 5 * 10**9


class ExportResult(NamedTuple):
    """What an export wrote."""
    folder: Path
    architecture: str
    native: bool  # a transformers class; False: our modeling file, loaded with trust_remote_code=True
    dtype: torch.dtype
    weight_files: list[str]
    total_bytes: int  # of the tensors

    def describe(self) -> str:
        kind = "native transformers class" if self.native else \
            "our modeling file, load it with trust_remote_code=True"
        n = len(self.weight_files)
        return (f"{self.architecture} ({kind}) -> {self.folder}: {n} shard{'s' * (n > 1)}, "
                f"{_size_text(self.total_bytes)} {str(self.dtype).removeprefix('torch.')}")


class _Entry(NamedTuple):
    """One tensor of the folder: transformers' ``name`` for our ``key`` (its expert ``expert`` when ours
    stacks the experts along dim 0), ``nbytes`` in the export dtype."""
    name: str
    key: str
    expert: int | None
    nbytes: int


def _size_text(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _target_dtype(dtype: torch.dtype, stored: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


def _entries(layout: HFLayout, sources: dict[str, tuple[tuple[int, ...], torch.dtype]],
             dtype: torch.dtype) -> list[_Entry]:
    entries = []
    for key, names in layout.names.items():
        if not names:  # not written (a buffer the transformers class has no use for)
            continue
        shape, stored = sources[key]
        itemsize = _target_dtype(dtype, stored).itemsize
        if stacked(names):
            per_expert = itemsize * int(torch.Size(shape[1:]).numel())
            entries += [_Entry(name, key, e, per_expert) for e, name in enumerate(names)]
        else:
            entries.append(_Entry(names[0], key, None, itemsize * int(torch.Size(shape).numel())))
    return entries


def _check_output(output: str | Path) -> Path:
    return new_output("--output", output, folder=True)


def _write_folder(out: Path, layout: HFLayout, args: ModelArgs,
                  sources: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  fetch: Callable[[list[str]], dict[str, torch.Tensor]], dtype: torch.dtype,
                  max_shard_size: int, tokenizer) -> ExportResult:
    """Write the folder: per shard, ``fetch`` gives our tensors of the shard's keys (in their export dtype),
    which are written and dropped before the next shard's."""
    entries = _entries(layout, sources, dtype)
    groups = [entries[r.start:r.stop] for r in plan_shards([e.nbytes for e in entries], max_shard_size)]
    files = shard_files(len(groups))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        for file, group in zip(files, groups, strict=True):
            ours = fetch(list(dict.fromkeys(e.key for e in group)))
            # an expert is a view into its stack: cloned, since safetensors refuses tensors sharing memory
            tensors = {e.name: ours[e.key] if e.expert is None else ours[e.key][e.expert].clone() for e in group}
            del ours
            write_shard(tmp / file, tensors)
            del tensors
            weight_map.update((e.name, file) for e in group)
            log.info(f"export: wrote {file} ({len(group)} tensors)")
        total = sum(e.nbytes for e in entries)
        if len(files) > 1:
            write_index(tmp, weight_map, total)
        for name, data in _side_files(layout, args, dtype, tokenizer).items():
            (tmp / name).write_bytes(data)
        os.rename(tmp, out)  # an empty folder at ``out`` is replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, layout.architecture, layout.native, dtype, files, total)


def _side_files(layout: HFLayout, args: ModelArgs, dtype: torch.dtype, tokenizer) -> dict[str, bytes]:
    """config.json, generation_config.json, the tokenizer's files and (not native) our modeling file."""
    config = dict(layout.config)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": int(tokenizer.eot_id),
           "pad_token_id": tokenizer.pad_id} if tokenizer is not None else {}
    config.update(ids)
    generation = {**{k: v for k, v in ids.items() if v is not None}, "do_sample": False}
    out = {name: (json.dumps(value, indent=2) + "\n").encode()
           for name, value in (("config.json", config), ("generation_config.json", generation))}
    if tokenizer is not None:
        out.update(tokenizer.hf_files(args.max_seq_len))
    if not layout.native:
        out.update(remote_code_files())
    return out


def export_model(model: Decoder, output: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 max_shard_size: int = DEFAULT_SHARD_SIZE, tokenizer=None) -> ExportResult:
    """Write an in-memory Decoder as a Hugging Face folder (each shard cast as it is written)."""
    layout = hf_layout(model.args)
    out = _check_output(output)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    sources = {k: (tuple(state[k].shape), state[k].dtype) for k, names in layout.names.items() if names}

    def fetch(keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: state[k].to("cpu", _target_dtype(dtype, state[k].dtype)).contiguous() for k in keys}

    return _write_folder(out, layout, model.args, sources, fetch, dtype, max_shard_size, tokenizer)


def _check_ema(checkpoint: Path, metadata: dict) -> None:
    if "ema.started" not in metadata:
        raise ExportError(f"--weights ema: {checkpoint} holds no EMA (the run had no ema.decay)")
    started = {"ema.started": torch.tensor(0)}
    load_on_one_process(started, checkpoint)
    if not int(started["ema.started"]):
        raise ExportError(f"--weights ema: the EMA in {checkpoint} had not started yet (ema.start_step)")


def export_checkpoint(checkpoint: str | Path, args: ModelArgs, output: str | Path, *,
                      dtype: torch.dtype = torch.bfloat16, max_shard_size: int = DEFAULT_SHARD_SIZE,
                      tokenizer=None, weights: str = "model") -> ExportResult:
    """Write the model of shape ``args`` in the DCP checkpoint folder ``checkpoint`` (a ``step-N``) as a
    Hugging Face folder, one shard in memory at a time. ``weights = "ema"``: the EMA's average of the
    parameters (the persistent buffers are the model's)."""
    layout = hf_layout(args)
    out = _check_output(output)
    checkpoint = Path(checkpoint)
    try:
        metadata = checkpoint_metadata(checkpoint)
    except UnsafeCheckpointFile:
        raise
    except Exception as e:  # noqa: BLE001  a missing or damaged .metadata
        raise ConfigError(f"{checkpoint}: cannot read this checkpoint ({unreadable_reason(e)})") from None
    if weights == "ema":
        _check_ema(checkpoint, metadata)
    with torch.device("meta"):
        model = Decoder(args)
    params = {n for n, _ in model.named_parameters()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    where = {k: f"ema.shadow.{k}" if weights == "ema" and k in params else f"model.{k}"
             for k, names in layout.names.items() if names}
    sources = {}
    for key, fqn in where.items():
        md = metadata.get(fqn)
        if md is None or not hasattr(md, "size"):
            raise ExportError(f"{checkpoint}: no tensor {fqn} (the run's config.toml describes another model?)")
        if tuple(md.size) != expected[key]:
            raise ExportError(f"{checkpoint}: {fqn} has shape {list(md.size)}, the run's config.toml gives "
                              f"{list(expected[key])}")
        sources[key] = (tuple(md.size), md.properties.dtype)

    def fetch(keys: list[str]) -> dict[str, torch.Tensor]:
        state = {where[k]: torch.empty(sources[k][0], dtype=_target_dtype(dtype, sources[k][1])) for k in keys}
        load_on_one_process(state, checkpoint)
        return {k: state[where[k]] for k in keys}

    return _write_folder(out, layout, args, sources, fetch, dtype, max_shard_size, tokenizer)
