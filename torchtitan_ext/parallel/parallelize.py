"""Lay a meta-device Decoder out over the mesh, in torchtitan's order: TP -> EP -> AC -> compile -> FSDP."""

from __future__ import annotations

import torch.nn as nn

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing
from torchtitan_ext.parallel.compile import apply_compile
from torchtitan_ext.parallel.dims import ParallelDims
from torchtitan_ext.parallel.fsdp import DTYPES, apply_fsdp


def parallelize_decoder(model: nn.Module, dims: ParallelDims, cfg: JobConfig, on_gpu: bool) -> None:
    """Apply every parallelism except pipelining (which splits the model first) to one model part."""
    if dims.tp > 1 or dims.ep > 1:
        raise NotImplementedError("parallelism.tp / parallelism.ep > 1 are not available in this build")
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_every)
    if cfg.training.compile:
        apply_compile(model)
    if dims.fsdp_enabled:
        param_dtype = DTYPES[cfg.training.mixed_precision_param] if on_gpu else DTYPES["float32"]
        mesh = (dims.submesh("dp_replicate", "dp_shard") if dims.dp_replicate > 1
                else dims.submesh("dp_shard"))
        apply_fsdp(model, mesh, param_dtype, DTYPES[cfg.training.mixed_precision_reduce],
                   reshard_after_forward=dims.pp == 1)
