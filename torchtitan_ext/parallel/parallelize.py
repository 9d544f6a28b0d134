"""Lay a meta-device Decoder out over the mesh, in torchtitan's order: TP -> EP -> CP -> AC -> compile -> FSDP.
Converters (float8, QAT, INT8: ``quant/swap.py``) have already run on the model."""

from __future__ import annotations

import logging

import torch.nn as nn

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing
from torchtitan_ext.parallel.compile import apply_compile
from torchtitan_ext.parallel.compression import replicate_all_reduce_replaced
from torchtitan_ext.parallel.context_parallel import apply_cp
from torchtitan_ext.parallel.dims import ParallelDims
from torchtitan_ext.parallel.ep import apply_ep
from torchtitan_ext.parallel.fsdp import DTYPES, apply_fsdp
from torchtitan_ext.parallel.sequence_balance import apply_sequence_balancing
from torchtitan_ext.parallel.tp import apply_tp, enable_async_tp

log = logging.getLogger(__name__)


def parallelize_decoder(model: nn.Module, dims: ParallelDims, cfg: JobConfig, on_gpu: bool,
                        loss_parallel: bool) -> None:
    """Apply every parallelism except pipelining (which splits the model first) to one model part."""
    if dims.tp > 1:
        apply_tp(model, dims.submesh("tp"), loss_parallel)
        if cfg.parallelism.async_tp:
            enable_async_tp(dims.submesh("tp"), compiled=cfg.training.compile, on_gpu=on_gpu)
    if dims.ep > 1:
        apply_ep(model, dims.submesh("ep_tp" if dims.tp > 1 else "ep"), data_parallel_share=dims.ep)
    if dims.cp > 1:
        apply_cp(model, dims.submesh("cp").get_group(), cfg.parallelism.cp_scheme)
    sequence_parts = [dims.submesh(name).get_group() for name, size in (("cp", dims.cp), ("tp", dims.tp)) if size > 1]
    if sequence_parts:  # each rank routes a part of every sequence: MoDE's load fractions sum the parts
        apply_sequence_balancing(model, sequence_parts)
    moe_under_tp = dims.tp > 1 and any(isinstance(block.feed_forward, MoDE) for block in model.layers.values())
    moe_fsdp_units = dims.ep > 1 or moe_under_tp  # the experts (EP) or the MoDE layers (TP) shard on their own
    ac = cfg.activation_checkpoint
    if apply_activation_checkpointing(model, ac.mode, ac.selective_every, moe_fsdp_units):
        log.info("activation_checkpoint: MoDE blocks under EP/TP are recomputed in full (torch's op-level "
              "selective checkpointing cannot wrap their FSDP units); other blocks use the op-level policy")
    if cfg.training.compile:  # experts join the block's graph only on GPU, outside their own FSDP units, in bf16
        # Float8 experts stay eager between graphs: inside the block's graph torchao 0.17's float8 grouped GEMMs
        # gave non-finite gradient norms on some steps.
        in_graph = on_gpu and not moe_fsdp_units and not cfg.float8.experts
        apply_compile(model, experts_in_graph=in_graph, tensor_parallel=dims.tp > 1,
                      compile_head=cfg.float8.enabled and cfg.float8.include_output,
                      eager_attention=dims.cp > 1 and cfg.parallelism.cp_scheme == "ring")
        if dims.tp > 1 and model.tok_embeddings is not None:
            log.info("compile: under TP the embedding's reduce-scatter completes before the first compiled block "
                  "(a compiled graph loses the gradient of an in-flight one)")
    if dims.fsdp_enabled or moe_under_tp:
        param_dtype = DTYPES[cfg.training.mixed_precision_param] if on_gpu and dims.fsdp_enabled \
            else DTYPES["float32"]  # without FSDP the blocks run under autocast
        # Native HSDP on a 2-D mesh, unless Squinch replaces its replicate all-reduce (then FSDP shards over
        # dp_shard alone and per-module all-reduce hooks average the replicas: parallel/compression.py).
        hsdp = dims.dp_replicate > 1 and not replicate_all_reduce_replaced(cfg.comm, dims)

        def dp_mesh(shard_dim: str):  # HSDP replicates over dp_replicate too
            return dims.submesh("dp_replicate", shard_dim) if hsdp else dims.submesh(shard_dim)

        apply_fsdp(model, dp_mesh("dp_shard_cp") if dims.fsdp_enabled else None, param_dtype,
                   DTYPES[cfg.training.mixed_precision_reduce], reshard_after_forward=dims.pp == 1,
                   experts_mesh=dp_mesh("dp_shard_mod_ep_cp" if dims.cp > 1 else "dp_shard_mod_ep")
                   if dims.ep > 1 else None,  # the dp (and CP) ranks left after EP
                   experts_unmanaged=dims.experts_alone,
                   moe_mesh=dp_mesh("dp_shard_tp") if moe_under_tp else None, tp=dims.tp)
