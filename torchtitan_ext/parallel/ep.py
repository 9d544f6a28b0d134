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
functional collective returns an ``AsyncCollectiveTensor``, and one handed to a compiled graph that was
still compiling (the combine, on a cold cache) was seen to wait for ever on CPU (gloo) while the other rank
went on (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass
class ChunkedRoute:
    """One layer's dispatch in ``chunks`` pieces: chunk c holds rows ceil(c n / C) .. ceil((c + 1) n / C) of
    every expert's n rows, so each chunk is spread over all experts (and ranks) like the whole batch."""

    send_index: torch.Tensor  # expert-sorted rows -> chunk-major rows (chunk, expert)
    send_inv: torch.Tensor
    send_splits: list[list[int]]  # [chunk][destination rank]
    recv_splits: list[list[int]]  # [chunk][source rank]
    orders: list[torch.Tensor]  # per chunk: received (source, local expert) rows -> (local expert, source)
    invs: list[torch.Tensor]
    local_counts: list[torch.Tensor]  # per chunk: rows per local expert after re-sorting


def plan_chunked_route(counts: torch.Tensor, ep: int, group: dist.ProcessGroup, chunks: int) -> ChunkedRoute:
    """Split each expert's rows into ``chunks`` pieces, exchange the (expert, chunk) counts with the ranks of
    ``group`` and read every chunk's splits with one host sync."""
    n_local = counts.numel() // ep
    edges = (counts[:, None] * torch.arange(chunks + 1, device=counts.device) + chunks - 1) // chunks
    per_chunk = edges.diff(dim=1).contiguous()  # (expert, chunk) rows
    received = torch.empty_like(per_chunk)
    dist.all_to_all_single(received, per_chunk, group=group)
    received = received.view(ep, n_local, chunks)  # [source rank, local expert, chunk] rows this rank receives
    send = per_chunk.view(ep, n_local, chunks).sum(dim=1).t().reshape(-1)
    splits = torch.cat([send, received.sum(dim=1).t().reshape(-1)]).tolist()  # the one sync
    send_splits = [splits[c * ep:(c + 1) * ep] for c in range(chunks)]
    recv_splits = [splits[(chunks + c) * ep:(chunks + c + 1) * ep] for c in range(chunks)]
    total = sum(map(sum, send_splits))
    orders, invs = [], []
    for c in range(chunks):
        block, rows = received[:, :, c], sum(recv_splits[c])
        orders.append(regroup_index(block, rows))
        invs.append(regroup_index(block.t(), rows))
    return ChunkedRoute(regroup_index(per_chunk, total), regroup_index(per_chunk.t(), total), send_splits,
                        recv_splits, orders, invs, list(received.sum(dim=0).unbind(dim=1)))


def _start_all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup
                      ) -> tuple[torch.Tensor, object, torch.Tensor]:
    """Start sending ``send[r]`` rows of ``x`` to rank r and receiving ``recv[r]`` from it: (the output, the
    c10d work to wait on before reading it, the input, kept alive until then)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return out, dist.all_to_all_single(out, x, recv, send, group=group, async_op=True), x


def _to_experts(rows: torch.Tensor, route: ChunkedRoute, group: dist.ProcessGroup) -> list[tuple]:
    """Start every chunk's all-to-all of expert-sorted ``rows`` (or their gradients) to the experts' ranks."""
    parts = rows[route.send_index].split([sum(s) for s in route.send_splits])
    return [_start_all_to_all(part, recv, send, group)
            for part, recv, send in zip(parts, route.recv_splits, route.send_splits, strict=True)]


def _back_from_experts(outbound: list[tuple], route: ChunkedRoute) -> torch.Tensor:
    """Wait for the chunks started back to this rank; their rows in expert-sorted order."""
    for _, work, _ in outbound:
        work.wait()
    return torch.cat([rows for rows, _, _ in outbound])[route.send_inv]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


class _PipelinedExperts(torch.autograd.Function):
    """Dispatch, experts and combine of one layer, chunk by chunk: every chunk's dispatch all-to-all is started
    at once, and chunk c's experts run while the rows of chunks c + 1... (and then the outputs of chunk c) travel.
    The backward runs in the same pipelined order. Each chunk's experts are a small autograd graph of their own
    (its saved tensors kept as they are: an activation-checkpointing recomputation runs the chunks again, its
    graph unused), differentiated with ``torch.autograd.grad`` in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, route: ChunkedRoute, compute: Callable, group: dist.ProcessGroup,
                *weights: torch.Tensor) -> torch.Tensor:
        inbound = _to_experts(x, route, group)
        leaves = [w.detach().requires_grad_(w.requires_grad) for w in weights]
        ins, outs, outbound = [], [], []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            for c, (rows, work, _) in enumerate(inbound):
                work.wait()
                rows.requires_grad_(True)
                y = compute(permute_rows(rows, route.orders[c], route.invs[c]), route.local_counts[c], *leaves)
                y = permute_rows(y, route.invs[c], route.orders[c])
                ins.append(rows)
                outs.append(y)
                outbound.append(_start_all_to_all(y.detach(), route.send_splits[c], route.recv_splits[c], group))
        ctx.state = (route, group, ins, outs, leaves)
        return _back_from_experts(outbound, route)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group, ins, outs, leaves = ctx.state
        del ctx.state
        inbound = _to_experts(grad, route, group)
        weight_grads = [torch.zeros_like(w) for w in leaves]
        outbound = []
        for c, (g, work, _) in enumerate(inbound):
            work.wait()
            row_grad, *grads = torch.autograd.grad(outs[c], [ins[c], *leaves], g, allow_unused=True)
            for total, part in zip(weight_grads, grads, strict=True):
                if part is not None:
                    total += part
            outbound.append(_start_all_to_all(row_grad, route.send_splits[c], route.recv_splits[c], group))
        return _back_from_experts(outbound, route), None, None, None, *weight_grads


class PipelinedDispatch:
    """``GroupedExperts.dispatcher`` under expert parallelism with ``chunks`` > 1 (``_PipelinedExperts``)."""

    def __init__(self, mesh: DeviceMesh, chunks: int):
        self.mesh, self.chunks = mesh, chunks

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, group = self.mesh.size(), self.mesh.get_group()
        route = _routed(lambda: plan_chunked_route(counts, ep, group, self.chunks))
        if x.shape[0] != route.send_index.numel():
            raise RuntimeError(f"expert parallelism: {x.shape[0]} routed rows, but the route sends "
                               f"{route.send_index.numel()} (a recomputation that routed differently?)")
        return _PipelinedExperts.apply(x, route, experts.compute, group, *experts.local_weights())


class _RouteTape:
    """The routes of one checkpointed call, recorded by its forward and replayed by its recomputation."""

    def __init__(self):
        self.routes: list[Route] = []
        self.replay_at: int | None = None

    def next_route(self, plan: Callable[[], Route | ChunkedRoute]) -> Route | ChunkedRoute:
        if self.replay_at is None:
            route = plan()
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


def _routed(plan: Callable[[], Route | ChunkedRoute]) -> Route | ChunkedRoute:
    """``plan()``, or inside an activation-checkpointing recomputation the route its forward recorded."""
    tape = _ACTIVE_TAPE.get()
    return plan() if tape is None else tape.next_route(plan)


def recompute_contexts() -> tuple[_TapeContext, _TapeContext]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) around a block with EP experts: its
    recomputation reuses the forward's split sizes and indices (no count exchange, no host sync)."""
    tape = _RouteTape()
    return _TapeContext(tape, replay=False), _TapeContext(tape, replay=True)


def _dispatch(module: GroupedExperts, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    x, counts = inputs
    ep, group = mesh.size(), mesh.get_group()
    route = _routed(lambda: plan_route(counts, ep, group))
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


def apply_ep(model: nn.Module, mesh: DeviceMesh, data_parallel_share: int, chunks: int = 1) -> None:
    """Shard every MoDE layer's experts over ``mesh`` (FSDP then shards them on their own mesh).

    ``chunks`` > 1: the pipelined dispatch (``PipelinedDispatch``), each layer's rows moved in that many
    chunks overlapped with the experts; 1: one all-to-all each way, overlapped with the shared expert if any.

    ``mesh`` is the ``ep`` ranks, or under TP the ``ep x tp`` ranks (each TP rank routes its own slice of
    the sequence, so TP ranks hold experts too). An expert's gradient sums the tokens of the whole mesh, of
    which ``data_parallel_share`` (= ep) data-parallel ranks' worth FSDP then averages again: it is scaled
    by 1 / ep."""
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoDE):
            module = block.feed_forward.experts
            if chunks > 1:
                distribute_module(module, mesh, _shard_experts)
                module.dispatcher = PipelinedDispatch(mesh, chunks)
            else:
                distribute_module(module, mesh, _shard_experts, _dispatch, _combine)
                module.overlaps_side_work = True
            module.grad_scale = 1.0 / data_parallel_share
