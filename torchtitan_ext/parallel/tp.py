"""Tensor + sequence parallelism with DTensor (Megatron layout).

Q/K/V and the FFN's w1/w3 are split by output columns, ``wo`` and ``w2`` by input rows, so each block needs
one all-gather before and one reduce-scatter after each of attention and FFN. Between them the residual
stream and the norms stay sharded along the sequence (sequence parallel). The embedding is split by
vocabulary rows and the head by vocabulary columns; with loss parallel the logits stay sharded over the
vocabulary and the cross-entropy never gathers them.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.mode import MoDE


def check_tp(args: ModelArgs, tp: int) -> None:
    """ValueError naming the first model dimension that ``tp`` does not divide."""
    for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads), ("ffn_hidden", args.ffn_hidden),
                        ("vocab_size", args.vocab_size)):
        if value % tp:
            raise ValueError(f"parallelism.tp = {tp} does not divide model.{name} = {value}")
    if args.tie_embeddings:
        raise ValueError(f"parallelism.tp = {tp} needs untied embeddings (the flavor ties them)")


class SyncRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output reduce-scatter completes before the module returns (for the embedding,
    whose output the first block needs at once anyway). Its stock async form hands the first compiled block an
    AsyncCollectiveTensor, and a compiled graph's backward then skips that tensor's ``to_local`` node: the
    embedding's redistribute gets a plain-tensor gradient and fails (torch 2.13)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def apply_tp(model: nn.Module, mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard a Decoder (or a pipeline stage of one) over the 1-D ``tp`` mesh, in place."""
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = SyncRowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    else:  # a later pipeline stage: its input is this rank's slice of the sequence
        model.set_input_sequence_shards(mesh.size())
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
        root_plan["output"] = ColwiseParallel(input_layouts=Shard(1),
                                              output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                              use_local_output=not loss_parallel)
    if root_plan:
        parallelize_module(model, mesh, root_plan)
    for block in model.layers.values():
        local = block.residual_scale is None  # branch outputs as local tensors, else DTensors (see below)
        plan = {
            "attention_norm": SequenceParallel(),
            # (x, rope, mask, shared kv): only x is sequence-sharded; the rest are plain local tensors
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
            "ffn_norm": SequenceParallel(),
        }
        if not block.attention.computes_kv:  # KV sharing: this layer reuses its group's first layer's K/V
            del plan["attention.wk"], plan["attention.wv"]
        if isinstance(block.feed_forward, MoDE):
            # Each TP rank routes its own slice of the sequence (tokens are independent in a MoDE layer);
            # its parameters are sharded over data-parallel x TP ranks by FSDP instead (see fsdp.py).
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=local)
        else:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),))
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=local)
            if block.feed_forward.w3 is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
            if getattr(block.feed_forward, "returns_partial_sums", False):  # QAT: its own DTensor matmuls, so
                plan["feed_forward"] = PrepareModuleInputOutput(  # returns w2's partial sums: reduce-scatter
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), output_layouts=(Partial(),),
                    desired_output_layouts=(Shard(1),), use_local_output=local)
        for norm in ("q_norm", "k_norm"):
            if getattr(block.attention, norm) is not None:
                # Per-head norms see this rank's heads (dim 2); as replicated DTensors their gradients are summed.
                plan[f"attention.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, mesh, plan)
        if not local:
            _residual_stream_as_dtensor(block, mesh)


def _residual_stream_as_dtensor(block: nn.Module, mesh: DeviceMesh) -> None:
    """Residual scalars multiply each rank's slice of the sequence, so their gradients must be summed over
    the TP ranks: the block takes its residual stream as a sequence-sharded DTensor (its branches return
    DTensors too) and the scalars become replicated DTensors, whose gradients DTensor sums like the norms'."""
    block.residual_scale = nn.Parameter(DTensor.from_local(block.residual_scale.data, mesh, [Replicate()],
                                                           run_check=False))
    into = (Shard(1), None, None, None)  # (x, rope, mask, shared kv) in, (h, kv) out
    out = (Shard(1), None)
    parallelize_module(block, mesh, PrepareModuleInputOutput(
        input_layouts=into, desired_input_layouts=into, use_local_input=False,
        output_layouts=out, desired_output_layouts=out, use_local_output=True))


def enable_async_tp(mesh: DeviceMesh, compiled: bool, on_gpu: bool) -> None:
    """Let Inductor overlap TP's all-gathers and reduce-scatters with the matmuls (micro-pipelined TP over
    symmetric memory); it rewrites compiled graphs, so it needs ``training.compile`` and CUDA."""
    if not (compiled and on_gpu):
        raise ConfigError("parallelism.async_tp = true needs training.compile = true on CUDA GPUs")
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh.get_group().group_name)
