"""torch.compile per transformer block: small graphs compile fast and are reused by identical blocks."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_ext.models.mode import MoDE


def apply_compile(model: nn.Module, experts_in_graph: bool, tensor_parallel: bool, compile_head: bool = False,
                  eager_attention: bool = False) -> None:
    """Compile each block as one graph (``fullgraph``), except MoDE blocks when ``experts_in_graph`` is
    false: their experts run eagerly between compiled graphs (see ``_compile_around_experts``).

    ``eager_attention``: each block's attention runs eagerly between the block's graphs, its QK-norm and RoPE
    compiled on their own (context parallel ring attention: its point-to-point transfers do not trace, and a
    graph broken inside the attention would hand its projections' views on to the next graph, whose replay of
    those views gives corrupt shapes).

    ``compile_head``: compile the output head too, in place (its parameter names stay). For a float8 head:
    eagerly, torchao's amax, scale and cast of the (tokens x vocabulary) logit gradient are separate kernels
    that cost more than the float8 GEMM saves; compiled, they fuse.

    Under tensor parallelism the AOTAutograd cache is turned off: its key is the forward graph, which TP ranks
    share while a rank's backward can differ from its peer's, so with a warm cache a rank of a compiled MoDE
    model can load a backward graph that is not its own and compute wrong gradients from the second step on.
    Inductor's own kernel cache stays on."""
    if tensor_parallel:
        torch._functorch.config.enable_autograd_cache = False
    for name, block in list(model.layers.items()):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if isinstance(inner.feed_forward, MoDE) and not experts_in_graph:
            _compile_around_experts(inner)
        else:
            if eager_attention and tensor_parallel:
                _compile_around_attention(inner)
                continue
            if eager_attention:
                inner.attention.forward = torch.compiler.disable(inner.attention.forward)
                inner.attention.norm_and_rotate = torch.compile(inner.attention.norm_and_rotate, fullgraph=True)
            model.layers[name] = torch.compile(block, fullgraph=not eager_attention)
    if compile_head and getattr(model, "output", None) is not None:
        model.output.compile(fullgraph=True)


def _compile_around_attention(block: nn.Module) -> None:
    """Compile a block's parts around an eager attention one by one (its norms, the attention's QK-norm and
    RoPE, the feed-forward): under tensor parallelism a block graph broken at the attention hands a
    sequence-parallel DTensor's backward a plain-tensor gradient, so the block stays eager and every graph is
    whole."""
    block.attention_norm.compile(fullgraph=True)
    block.attention.norm_and_rotate = torch.compile(block.attention.norm_and_rotate, fullgraph=True)
    block.ffn_norm.compile(fullgraph=True)
    block.feed_forward.compile(fullgraph=True)


def _compile_around_experts(block: nn.Module) -> None:
    """Compile a MoDE block's first half (norms, attention, residual add), its routing and its combine; the
    experts (grouped GEMMs, SwiGLU) and whatever expert parallelism wraps around them (all-to-all, host-read
    split sizes) stay eager.

    The experts cannot sit inside a graph under expert parallelism (the all-to-all's split sizes are read on
    the host), when they or their MoDE layer are an FSDP unit of their own (FSDP's hooks run eagerly), on
    CPU (the grouped-GEMM fallback loops over groups whose sizes are data), or in float8 (inside the graph
    torchao's float8 grouped GEMMs give non-finite gradient norms on some steps). Their SwiGLU is not compiled
    either: its row count differs by rank and step (a recompile each time), and compiling it gained nothing
    measurable. Compiled methods keep every parameter's name; few, large graphs keep the host ahead of the
    GPU."""
    block.attend = torch.compile(block.attend, fullgraph=True)
    moe = block.feed_forward
    moe.dispatch_tokens = torch.compile(moe.dispatch_tokens, fullgraph=True)
    moe.combine_outputs = torch.compile(moe.combine_outputs, fullgraph=True)


def clean_fqn(name: str) -> str:
    """A parameter's name as the plain model knows it, without wrapper prefixes (compile, AC, DDP)."""
    parts = [p for p in name.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module")]
    return ".".join(parts).removeprefix("module.")
