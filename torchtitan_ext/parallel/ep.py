"""Expert parallelism: each MoDE layer's experts are split over the ``ep`` mesh (DTensor ``Shard(0)`` on
the expert dimension); tokens travel to the rank holding their expert and back by all-to-all.

Dispatch: the MoDE layer hands its expert-sorted token copies and per-expert counts to ``GroupedExperts``.
Experts are sharded contiguously (rank r holds experts r * n_local ...), so the expert-sorted copies are
already grouped by destination rank: they go out as they are. The counts are exchanged first (an
all-to-all of E integers, so each rank knows how many rows it receives from each peer for each of its
experts), then the rows, which arrive ordered by (source rank, local expert) and are re-sorted by local
expert for the grouped GEMM with one gather. Combine reverses both steps. The all-to-alls are
differentiable, so gradients flow back to the router and to the tokens' ranks.

Host syncs: one per layer's forward. The all-to-all of the rows needs its split sizes on the host, so the
send and receive splits are read together in one ``.tolist()``; nothing else reads the device (the
re-sorting index is computed arithmetically from the [source, local expert] count matrix: cumsums and a
``searchsorted``, no ``repeat_interleave`` without an output size, no argsort). The backward reuses the
forward's splits and indices, and so does an activation-checkpointing recomputation when the block is
checkpointed with ``recompute_contexts`` as its ``context_fn`` (``parallel/activation_checkpoint.py`` does
this for MoDE blocks): the recomputed forward replays the routes recorded by the original one instead of
exchanging the counts and reading them again.

Overlap: with a shared expert, ``MoDE`` hands its computation to ``GroupedExperts.side_work``, and the
dispatch runs it on the GPU while the rows' all-to-all is in flight (the all-to-all is started
asynchronously and waited on before the received rows are used).

The row all-to-alls are plain c10d calls inside autograd Functions, not functional collectives: a
functional collective returns an ``AsyncCollectiveTensor``, and one handed to a compiled graph that is still
compiling (the combine, on a cold cache) can leave its rank waiting for ever on gloo while the other rank goes
on.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from torchtitan_ext.models.mode import GroupedExperts, MoDE, permute_rows


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group`` (``send`` rows to each, ``recv`` rows from each); the
    backward sends the gradient rows back the same way. With a ``pending`` list the forward only starts
    the exchange and appends its c10d work: the output must not be read before ``_Wait`` has run."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup,
                pending: list | None) -> torch.Tensor:
        ctx.splits, ctx.group = (recv, send), group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, send = ctx.splits
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=ctx.group)
        return out, None, None, None, None


class _Wait(torch.autograd.Function):
    """Identity that first waits for the c10d works in ``pending`` (an all-to-all started by ``_AllToAll``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: list) -> torch.Tensor:
        while pending:
            pending.pop().wait()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows that lie in blocks ordered row-major over ``counts`` (a, b) (block (i, j) holds counts[i, j]
    rows; ``total`` rows in all, known on the host) -> the gather index ``idx`` such that ``rows[idx]``
    lists the blocks column-major ((0, j), (1, j), ... for j = 0, 1, ...), each block's rows in order.

    Computed arithmetically, without a host read: an output row in column-major block ``c`` comes from
    the start of that block in the row-major input plus its offset inside the block."""
    a, b = counts.shape
    flat = counts.reshape(-1)
    row_start = (flat.cumsum(0) - flat).view(a, b).t().reshape(-1)  # input start of each block, column-major
    col = counts.t().reshape(-1)
    col_end = col.cumsum(0)
    pos = torch.arange(total, device=counts.device, dtype=col_end.dtype)
    block = torch.searchsorted(col_end, pos, right=True)  # empty blocks are skipped: their end equals the next start
    return pos + (row_start - (col_end - col))[block]


@dataclass
class Route:
    """One layer's dispatch: split sizes (host) and the received rows' re-sorting (device)."""

    send_splits: list[int]
    recv_splits: list[int]
    order: torch.Tensor  # received (source, local expert) rows -> (local expert, source) order
    inv: torch.Tensor
    local_counts: torch.Tensor  # rows per local expert after re-sorting


def plan_route(counts: torch.Tensor, ep: int, group: dist.ProcessGroup) -> Route:
    """Exchange the per-expert counts with the ranks of ``group`` and read both splits with one host sync."""
    n_local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, n_local)  # [source rank, local expert] rows this rank receives
    splits = torch.cat([counts.view(ep, n_local).sum(dim=1), received.sum(dim=1)]).tolist()  # the one sync
    send_splits, recv_splits = splits[:ep], splits[ep:]
    total = sum(recv_splits)
    order = regroup_index(received, total)
    inv = regroup_index(received.t(), total)
    return Route(send_splits, recv_splits, order, inv, received.sum(dim=0))


class _RouteTape:
    """The routes of one checkpointed call, recorded by its forward and replayed by its recomputation."""

    def __init__(self):
        self.routes: list[Route] = []
        self.replay_at: int | None = None

    def next_route(self, counts: torch.Tensor, ep: int, group: dist.ProcessGroup) -> Route:
        if self.replay_at is None:
            route = plan_route(counts, ep, group)
            self.routes.append(route)
            return route
        route = self.routes[self.replay_at]
        self.replay_at += 1
        return route


# The tape of the checkpointed call running now (its forward, or its recomputation in the backward's thread).
_ACTIVE_TAPE: ContextVar[_RouteTape | None] = ContextVar("ep_route_tape", default=None)


class _TapeContext:
    def __init__(self, tape: _RouteTape, replay: bool):
        self.tape, self.replay = tape, replay

    def __enter__(self):
        self.token = _ACTIVE_TAPE.set(self.tape)
        self.tape.replay_at = 0 if self.replay else None

    def __exit__(self, *exc):
        _ACTIVE_TAPE.reset(self.token)
        self.tape.replay_at = None


def recompute_contexts() -> tuple[_TapeContext, _TapeContext]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) around a block with EP experts: its
    recomputation reuses the forward's split sizes and indices (no count exchange, no host sync)."""
    tape = _RouteTape()
    return _TapeContext(tape, replay=False), _TapeContext(tape, replay=True)


def _dispatch(module: GroupedExperts, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    x, counts = inputs
    ep, group = mesh.size(), mesh.get_group()
    tape = _ACTIVE_TAPE.get()
    route = plan_route(counts, ep, group) if tape is None else tape.next_route(counts, ep, group)
    if x.shape[0] != sum(route.send_splits):
        raise RuntimeError(f"expert parallelism: {x.shape[0]} routed rows, but the route sends "
                           f"{sum(route.send_splits)} (a recomputation that routed differently?)")
    side_work, module.side_work = module.side_work, None
    pending = [] if side_work is not None else None
    x = _AllToAll.apply(x, route.recv_splits, route.send_splits, group, pending)
    if side_work is not None:  # e.g. the shared expert, computed while the rows travel
        module.side_result = side_work()
        x = _Wait.apply(x, pending)
    module._ep_route = route
    return permute_rows(x, route.order, route.inv), route.local_counts


def _combine(module: GroupedExperts, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    route, module._ep_route = module._ep_route, None
    unsorted = permute_rows(out, route.inv, route.order)
    return _AllToAll.apply(unsorted, route.send_splits, route.recv_splits, mesh.get_group(), None)


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
            module.overlaps_side_work = True
