"""Expert parallelism: each MoDE layer's experts are split over the ``ep`` mesh (DTensor ``Shard(0)`` on
the expert dimension); tokens travel to the rank holding their expert and back by all-to-all.

Dispatch: the MoDE layer hands its expert-sorted token copies and per-expert counts to ``GroupedExperts``;
the counts are exchanged first (so each rank knows how many rows it will receive from each peer for each
of its experts), then the rows, which arrive ordered by (source rank, local expert) and are re-sorted by
local expert for the grouped GEMM. Combine reverses both steps. The all-to-alls are differentiable, so
gradients flow back to the router and to the tokens' ranks.

The row all-to-alls are plain c10d calls inside an autograd Function, not functional collectives: a
functional collective returns an ``AsyncCollectiveTensor``, and one handed to a compiled graph that was
still compiling (the combine, on a cold cache) was seen to wait for ever on CPU (gloo) while the other rank
went on (benchmarks/RESULTS.md). The experts consume the rows at once, so there was no overlap to lose.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from torchtitan_ext.models.mode import GroupedExperts, MoDE, inverse_permutation, permute_rows


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group`` (``send`` rows to each, ``recv`` rows from each); the
    backward sends the gradient rows back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (recv, send), group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        recv, send = ctx.splits
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=ctx.group)
        return out, None, None, None


def _dispatch(module: GroupedExperts, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    x, counts = inputs
    ep, group = mesh.size(), mesh.get_group()
    n_local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] row counts
    received = received.view(ep, n_local)
    send_splits = counts.view(ep, n_local).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    x = _AllToAll.apply(x, recv_splits, send_splits, group)
    block = torch.repeat_interleave(torch.arange(ep * n_local, device=x.device), received.flatten())
    order = (block % n_local).argsort(stable=True)  # (source, expert) -> (expert, source)
    inv = inverse_permutation(order)
    module._ep_route = (order, inv, send_splits, recv_splits)
    return permute_rows(x, order, inv), received.sum(dim=0)


def _combine(module: GroupedExperts, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    order, inv, send_splits, recv_splits = module._ep_route
    module._ep_route = None
    unsorted = permute_rows(out, inv, order)
    return _AllToAll.apply(unsorted, send_splits, recv_splits, mesh.get_group())


def check_ep(n_experts: int, ep: int, tp: int = 1) -> None:
    if n_experts == 0:
        raise ValueError(f"parallelism.ep = {ep} needs a MoDE model (model.n_experts > 0)")
    if n_experts % (ep * tp):
        shards = f"ep x tp = {ep} x {tp}" if tp > 1 else f"ep = {ep}"
        raise ValueError(f"parallelism.{shards} does not divide model.n_experts = {n_experts} (under tensor "
                         f"parallelism the experts are sharded over the ep x tp ranks)")


def apply_ep(model: nn.Module, mesh: DeviceMesh, data_parallel_share: int) -> None:
    """Shard every MoDE layer's experts over ``mesh`` (FSDP then shards them on their own mesh).

    ``mesh`` is the ``ep`` ranks, or under TP the ``ep x tp`` ranks (each TP rank routes its own slice of
    the sequence, so TP ranks hold experts too). An expert's gradient sums the tokens of the whole mesh, of
    which ``data_parallel_share`` (= ep) data-parallel ranks' worth FSDP then averages again: it is scaled
    by 1 / ep."""
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoDE):
            module = block.feed_forward.experts
            distribute_module(module, mesh, _shard_experts, _dispatch, _combine)
            module.grad_scale = 1.0 / data_parallel_share
