"""Squinch-compressed gradient collectives: a DDP all-reduce hook and an FSDP2 reduce-scatter.

Both send gradients as Squinch bytes (6 bytes per block of 8 values, see ``squinch.py``) and do every
reduction in float32 after decoding, so no low-precision arithmetic happens on the wire.

* DDP (:func:`register_squinch_ddp_hook`): a bucket's gradients are encoded and split into one chunk per
  rank; an all-to-all hands each rank the chunks it owns, which it decodes, sums and averages, re-encodes
  and all-gathers; everyone decodes the gathered bytes. Between two ranks one all-gather of the whole
  encoded bucket does the same with the same bytes on the link (``_compressed_all_reduce``).
* FSDP2 (:func:`apply_squinch_fsdp`): each rank encodes its whole unsharded gradient, an all-to-all sends
  every destination only the compressed chunk of its shard, and the destination decodes and sums the
  chunks in float32, then divides as FSDP's reduce op asks.
* HSDP's replicate dimension (:func:`install_squinch_replicate_hooks`): the model is sharded over
  ``dp_shard`` alone (native HSDP's all-reduce cannot be replaced, only followed: torch 2.11-2.13), and an
  FSDP2 all-reduce hook per module averages its reduce-scattered shard over ``dp_replicate`` in Squinch bytes
  (the DDP hook's all-reduce: one all-gather between two nodes), started as soon as that module's
  reduce-scatter is done, on FSDP's all-reduce stream, so it overlaps with the rest of the backward pass. The
  intra-node reduce-scatter stays FSDP's own unless :func:`apply_squinch_fsdp` is applied too.
  :class:`SquinchReplicateAllReduce` does the same average after the backward pass (the earlier,
  non-overlapped order, kept for comparison).
* The trainer's wiring (which of these a ``[comm]`` section installs, checkpointed residuals) lives in
  ``torchtitan_ext.parallel.compression``; this package holds the collectives only.

Error feedback (optional): the residual ``input - decode(encode(input))`` of a rank's own encoding is kept in
float32 and added to the next step's gradient before encoding, so compression error does not accumulate as a
bias over steps. Over more than two ranks the all-reduces encode twice (each rank's rows, then the owner's
average before the all-gather); the overlapped HSDP hooks keep a residual for each encoding: the owner's is added
to its next average of the same chunk (double error feedback, as in DoubleSqueeze), which bounds the summed error
of the gathered averages over any number of steps by one step's instead of letting it grow like a random walk.
The DDP hook keeps the rows' residual only (``_AllReduceState`` says why). Between two ranks there is one
encoding, and its residual alone bounds the summed error. A non-finite residual entry is reset to zero:
the step that produced it is skipped by the trainer's guard and must not poison later steps. The residuals are
rank-local; the checkpoint saves each rank's own
(``parallel.compression.GradientCompression.residual_state``).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the real types.
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from torchtitan_ext.comm.squinch import BLOCK, BLOCK_BYTES, decode, encode

try:  # FSDP2's comm interface is not exported from torch.distributed.fsdp (torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:
    _ReduceScatter = None
_ReduceScatterBase = _ReduceScatter if _ReduceScatter is not None else object

logger = logging.getLogger(__name__)


@dataclass
class CommStats:
    """Gradient bytes handed to the collectives since the last :meth:`reset` (one rank's view): ``bytes_sent``
    as passed (Squinch bytes, and gradients below ``min_numel`` as they are), ``bytes_uncompressed`` the same
    elements in the gradient's dtype."""

    bytes_sent: int = 0
    bytes_uncompressed: int = 0

    def add(self, sent: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        """Count one collective input ``sent`` that carries ``numel`` gradient values of ``dtype``."""
        self.bytes_sent += sent.numel() * sent.element_size()
        self.bytes_uncompressed += numel * dtype.itemsize

    def reset(self) -> None:
        self.bytes_sent = self.bytes_uncompressed = 0

    def as_dict(self) -> dict[str, int]:
        return {"comm/bytes_sent": self.bytes_sent, "comm/bytes_uncompressed": self.bytes_uncompressed}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_options(min_numel: int, stats: CommStats) -> None:
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
        raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
    if not isinstance(stats, CommStats):
        raise ValueError(f"stats must be a CommStats, got {type(stats).__name__}")


def _encode_rows(rows: torch.Tensor) -> torch.Tensor:
    """Encode each row of a (world, c) float32 tensor on its own: (world, 6 * ceil(c / 8)) bytes.

    Zero-padding every row to whole blocks makes one ``encode`` call produce exactly the bytes of
    ``encode(row)`` per row, since the padded zeros change neither a block's maximum nor its other values.
    """
    world, c = rows.shape
    padded_c = _round_up(c, BLOCK)
    if padded_c != c:
        rows = torch.nn.functional.pad(rows, (0, padded_c - c))
    return encode(rows.reshape(-1)).view(world, padded_c // BLOCK * BLOCK_BYTES)


def _decode_rows(encoded: torch.Tensor, c: int) -> torch.Tensor:
    """Inverse of :func:`_encode_rows`: (world, 6 * ceil(c / 8)) bytes to (world, c) float32."""
    world = encoded.shape[0]
    padded_c = _round_up(c, BLOCK)
    return decode(encoded.reshape(-1), world * padded_c).view(world, padded_c)[:, :c]


def _kept(residual: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``residual`` when it still fits ``like`` (same shape and device), else a fresh zero float32 residual."""
    if residual is None or residual.shape != like.shape or residual.device != like.device:
        return torch.zeros_like(like, dtype=torch.float32)
    return residual


def _finite(residual: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(residual), residual, torch.zeros_like(residual))


def _exchange_and_sum(rows: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype, stats: CommStats,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reduce-scatter of ``rows`` (world, c; float32, bf16 or fp16) in Squinch bytes, row d to rank d: this rank's
    float32 sum of the rows it received, and the new error-feedback residual (``None`` unless ``residual``, a
    float32 tensor, was given: then the rows are widened to float32 by the addition)."""
    if residual is not None:
        rows = rows + residual
    encoded = _encode_rows(rows)
    new_residual = None
    if residual is not None:  # this step's compression error, non-finite entries reset to zero
        new_residual = _finite(rows - _decode_rows(encoded, rows.shape[1]))
    received = torch.empty_like(encoded)
    stats.add(encoded, rows.numel(), dtype)
    dist.all_to_all_single(received, encoded, group=group)
    return _decode_rows(received, rows.shape[1]).sum(dim=0), new_residual


def _side_stream_context(device: torch.device, streams: dict[torch.device, torch.cuda.Stream]):
    """Run DDP hook work on a side CUDA stream so backward compute keeps running during communication."""
    if device.type != "cuda":
        return nullcontext()
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


@dataclass(eq=False)
class _AllReduceState:
    """Options and per-parameter error-feedback residuals of one compressed all-reduce (a DDP model's hook, or
    HSDP's replicate all-reduce)."""

    group: dist.ProcessGroup
    min_numel: int
    error_feedback: bool
    stats: CommStats
    # Keyed by parameter, not bucket: DDP rebuilds its buckets after the first iteration, and its first
    # iteration after a resume orders them differently again. So only the rows' residual is kept here: an owner's
    # residual belongs to chunk positions that such a reordering hands to other ranks (the overlapped HSDP
    # hooks, whose shards keep one layout, keep both).
    residuals: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict)


def _bucket_slices(bucket: dist.GradBucket) -> list[tuple[torch.Tensor, int, int]]:
    """(parameter, offset, numel) of every gradient inside the bucket's flat buffer."""
    buffer = bucket.buffer()
    slices = []
    for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
        if grad.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            raise RuntimeError("Squinch DDP hook: a bucket gradient is not a view of the bucket buffer "
                               "(sparse gradients are not supported)")
        slices.append((param, grad.storage_offset() - buffer.storage_offset(), grad.numel()))
    return slices


def _encodes_owned_average(world: int) -> bool:
    """Whether a compressed all-reduce over ``world`` ranks re-encodes each owner's average (an all-to-all then an
    all-gather, with an owner's residual under error feedback); two ranks encode once and all-gather."""
    return world > 2


def owned_chunk(numel: int, world: int) -> int:
    """Values per rank's chunk in a compressed all-reduce of ``numel`` values: whole blocks, so every rank
    owns complete blocks."""
    return _round_up(_round_up(numel, world) // world, BLOCK)


def _compressed_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, stats: CommStats, dtype: torch.dtype,
                           residual: torch.Tensor | None, owner_residual: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Average ``flat`` (float32, or bf16 / fp16 without a residual) over ``group`` in Squinch bytes; returns
    the float32 average and the new float32 residuals of this rank's rows and of its owned average (each
    ``None`` unless given: ``owner_residual`` has ``owned_chunk(flat.numel(), world)`` values).

    Every rank owns one chunk of whole blocks: an all-to-all hands it everyone's encoded copy of that chunk,
    which it decodes, sums in float32 and divides by the world size, re-encodes and all-gathers; every rank
    decodes the same gathered bytes, so all end with bit-identical averages.

    Two ranks (the replicas of a two-node job) take one all-gather of the whole encoded input instead: it puts
    the same bytes on the link as the all-to-all and the all-gather together (each rank sends its peer its
    values once), in one ring collective rather than two exchanges with a decode-sum-encode between them,
    and the average is encoded once, not twice. Every rank sums the same decoded rows in rank order, so the
    averages are still bit-identical. There is no owner's encoding, so ``owner_residual`` comes back ``None``."""
    world = group.size()
    n = flat.numel()
    if not _encodes_owned_average(world):
        return (*_gathered_all_reduce(flat, group, stats, dtype, residual), None)
    chunk = owned_chunk(n, world)
    rows = torch.nn.functional.pad(flat, (0, world * chunk - n)).view(world, chunk)
    if residual is not None:
        residual = torch.nn.functional.pad(residual, (0, world * chunk - n)).view(world, chunk)
    owned, residual = _exchange_and_sum(rows, group, dtype, stats, residual)
    average = owned / world  # average as DDP does
    if owner_residual is not None:
        average = average + owner_residual
    owned_encoded = _encode_rows(average.view(1, chunk))
    if owner_residual is not None:  # this step's error of the owner's encoding, non-finite entries reset
        owner_residual = _finite(average - _decode_rows(owned_encoded, chunk).view(-1))
    gathered = torch.empty((world, owned_encoded.shape[1]), dtype=torch.uint8, device=flat.device)
    stats.add(owned_encoded, chunk, dtype)
    _all_gather(gathered, owned_encoded, group)
    result = _decode_rows(gathered, chunk).reshape(-1)[:n]
    return result, None if residual is None else residual.reshape(-1)[:n], owner_residual


def _gathered_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, stats: CommStats, dtype: torch.dtype,
                         residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_compressed_all_reduce` as one all-gather of every rank's whole encoded input (see there)."""
    world, n = group.size(), flat.numel()
    if residual is not None:
        flat = flat + residual
    encoded = _encode_rows(flat.view(1, n))
    if residual is not None:  # this step's compression error, non-finite entries reset to zero
        residual = _finite(flat - _decode_rows(encoded, n).view(-1))
    gathered = torch.empty((world, encoded.shape[1]), dtype=torch.uint8, device=flat.device)
    stats.add(encoded, _round_up(n, BLOCK), dtype)
    _all_gather(gathered, encoded, group)
    return _decode_rows(gathered, n).sum(dim=0) / world, residual


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    # ``all_gather_single`` replaces the deprecated ``all_gather_into_tensor`` from torch 2.13 on.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def _average(grads: list[tuple[torch.Tensor, torch.Tensor]], state: _AllReduceState) -> list[torch.Tensor]:
    """Average each ``(key, gradient)`` over ``state.group``: gradients below ``min_numel`` together in one
    plain all-reduce, the others together in one Squinch all-reduce. Returns the averages in order;
    ``key`` (the parameter) names the gradient's error-feedback residual."""
    world = state.group.size()
    out: dict[int, torch.Tensor] = {}
    small = [i for i, (_, g) in enumerate(grads) if g.numel() < state.min_numel]
    large = [i for i, (_, g) in enumerate(grads) if g.numel() >= state.min_numel]
    if small:
        flat = torch.cat([grads[i][1].reshape(-1) for i in small])
        state.stats.add(flat, flat.numel(), flat.dtype)
        dist.all_reduce(flat, group=state.group)
        flat.div_(world)
        out.update(zip(small, flat.split([grads[i][1].numel() for i in small]), strict=True))
    if large:
        dtype = grads[large[0]][1].dtype
        flat = torch.cat([grads[i][1].reshape(-1) for i in large]).float()
        sizes = [grads[i][1].numel() for i in large]
        residual = None
        if state.error_feedback:
            residual = torch.cat([state.residuals.get(grads[i][0], flat.new_zeros(n))
                                  for i, n in zip(large, sizes, strict=True)])
        reduced, residual, _ = _compressed_all_reduce(flat, state.group, state.stats, dtype, residual)
        out.update(zip(large, reduced.split(sizes), strict=True))
        if residual is not None:
            for i, part in zip(large, residual.split(sizes), strict=True):
                state.residuals[grads[i][0]] = part
    return [out[i] for i in range(len(grads))]


def _squinch_ddp_hook(state: _AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compressed all-reduce of the large gradients, plain one of the small."""
    buffer = bucket.buffer()
    with _side_stream_context(buffer.device, state.streams):
        out = torch.empty_like(buffer)
        slices = _bucket_slices(bucket)
        averaged = _average([(p, buffer[o:o + n]) for p, o, n in slices], state)
        for (_, o, n), part in zip(slices, averaged, strict=True):
            out[o:o + n] = part
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buffer.device] if buffer.device.type == "cuda" else None)
        future.set_result(out)
    return future


class SquinchReplicateAllReduce:
    """HSDP's replicate all-reduce in Squinch bytes (see the module docstring): after the backward pass, every
    gradient shard averaged over ``group`` as the DDP hook does for a bucket. Replicas decode the same gathered
    bytes, so their gradients, and thus their parameters, stay identical."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, min_numel: int,
                 error_feedback: bool, stats: CommStats) -> None:
        _check_options(min_numel, stats)
        self.params = params
        self.state = _AllReduceState(group, min_numel, error_feedback, stats)

    @torch.no_grad()
    def __call__(self) -> None:
        local = [(p, p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                 for p in self.params if p.grad is not None]
        for (_, grad), averaged in zip(local, _average(local, self.state), strict=True):
            grad.copy_(averaged.view_as(grad))


@dataclass(eq=False)
class SquinchReplicateHook:
    """HSDP's replicate all-reduce in Squinch bytes, overlapped with the backward pass: an FSDP2 all-reduce hook
    (``FSDPModule.set_all_reduce_hook``) on a module sharded over ``dp_shard`` alone.

    FSDP2 calls it on its all-reduce stream with the module's reduce-scattered flat gradient shard as soon as
    that module's reduce-scatter is done, while autograd goes on with the earlier modules' backward; the hook
    averages the shard over ``group`` (the replicas) in place, before FSDP casts it and hands it to the
    parameters. A shard under ``min_numel`` goes through a plain all-reduce. One instance per FSDP module, so
    the error-feedback residuals (one float32 copy of this rank's shard, and one of the chunk it owns in the
    all-reduce) are kept per module and restart from zero when the shard's layout changes (a parameter got
    no gradient this step).
    """

    group: dist.ProcessGroup
    min_numel: int
    error_feedback: bool
    stats: CommStats
    residual: torch.Tensor | None = None
    owner_residual: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.is_cuda:  # FSDP may free it after a cast queued on this stream: keep it until then
            reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))
        world = self.group.size()
        if reduce_output.numel() < self.min_numel:
            self.stats.add(reduce_output, reduce_output.numel(), reduce_output.dtype)
            dist.all_reduce(reduce_output, group=self.group)
            reduce_output.div_(world)
            return
        flat = reduce_output.reshape(-1)  # bf16 stays bf16 until the encoder widens it (exactly)
        residual = owner_residual = None
        if self.error_feedback:
            residual = _kept(self.residual, flat)
            if _encodes_owned_average(world):
                owner_residual = _kept(self.owner_residual, flat.new_empty(owned_chunk(flat.numel(), world)))
        averaged, self.residual, self.owner_residual = _compressed_all_reduce(
            flat, self.group, self.stats, reduce_output.dtype, residual, owner_residual)
        reduce_output.copy_(averaged.view_as(reduce_output))


def install_squinch_replicate_hooks(model: nn.Module, group: dist.ProcessGroup, *, min_numel: int,
                                    error_feedback: bool, stats: CommStats) -> dict[str, SquinchReplicateHook]:
    """Install a :class:`SquinchReplicateHook` over ``group`` on every FSDP2 module inside ``model`` (``model``
    included), which must be sharded without a replicate dimension (``fully_shard`` on a 1-D mesh: the hook
    replaces native HSDP's all-reduce). Returns the hooks by their module's FQN in ``model``."""
    _check_options(min_numel, stats)
    if not hasattr(FSDPModule, "set_all_reduce_hook"):
        raise RuntimeError(f"Squinch on HSDP's replicate dimension needs FSDPModule.set_all_reduce_hook, "
                           f"missing in torch {torch.__version__}")
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    if not modules:
        raise ValueError("install_squinch_replicate_hooks: no FSDP2 module (fully_shard) found inside the model")
    for name, module in modules.items():
        if any(isinstance(p, DTensor) and p.device_mesh.ndim >= 2 and isinstance(p.placements[0], Replicate)
               for p in module.parameters(recurse=False)):
            raise ValueError(f"install_squinch_replicate_hooks: module {name or '<root>'} is native HSDP (its "
                             f"all-reduce would run uncompressed before the hook); shard it over dp_shard alone")
    hooks = {name: SquinchReplicateHook(group, min_numel, error_feedback, stats) for name in modules}
    for name, module in modules.items():
        module.set_all_reduce_hook(hooks[name])
    return hooks


def register_squinch_ddp_hook(model: DistributedDataParallel, process_group: dist.ProcessGroup | None, *,
                              min_numel: int, error_feedback: bool, stats: CommStats) -> _AllReduceState:
    """Make ``model``'s gradient all-reduce over ``process_group`` (``None``: the default group) go through
    Squinch, gradients below ``min_numel`` plain, averaged as DDP's own. Call before the first backward.
    Returns the hook's state (its residuals)."""
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"register_squinch_ddp_hook expects a DistributedDataParallel model, "
                         f"got {type(model).__name__}")
    _check_options(min_numel, stats)
    group = process_group if process_group is not None else dist.group.WORLD
    state = _AllReduceState(group, min_numel, error_feedback, stats)
    model.register_comm_hook(state, _squinch_ddp_hook)
    return state


def _apply_reduce_op(total: torch.Tensor, op: object, world: int) -> torch.Tensor:
    """Apply FSDP's reduce op to an already summed shard (the divide is the op's, nothing else)."""
    if op == ReduceOp.SUM:
        return total
    if op == ReduceOp.AVG:
        return total / world
    if op == ReduceOp.PREMUL_SUM:
        try:
            factor = op.factor
        except AttributeError as e:
            raise RuntimeError(f"Squinch reduce-scatter: torch {torch.__version__} does not expose the "
                               f"factor of a PREMUL_SUM reduce op (set_gradient_divide_factor)") from e
        return total * factor
    raise ValueError(f"Squinch reduce-scatter supports SUM, AVG and PREMUL_SUM reduce ops, got {op}")


@dataclass(eq=False)
class SquinchReduceScatter(_ReduceScatterBase):
    """FSDP2 custom reduce-scatter sending Squinch bytes through an all-to-all.

    One instance per FSDP module: FSDP hands it that module's flat gradient, laid out as ``world`` rows,
    row d being rank d's shard, so the error-feedback residual is kept per module. When the layout
    changes (a parameter got no gradient this step) the residual restarts from zero. Error feedback
    costs one float32 copy of the module's unsharded gradient per rank.

    The work runs synchronously on the calling stream: ``async_op`` is accepted for the interface, and
    the output is ready (stream-ordered) when the call returns, which returns ``None``. A gradient under
    ``min_numel`` goes through the plain reduce-scatter, whose ``Work`` is returned as FSDP expects.
    """

    min_numel: int
    error_feedback: bool
    stats: CommStats
    residual: torch.Tensor | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        if input_tensor.numel() < self.min_numel:
            self.stats.add(input_tensor, input_tensor.numel(), input_tensor.dtype)
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world = group.size()
        # Encoded as it comes (bf16 too: the encoder widens exactly), no float32 copy of the whole gradient.
        rows = input_tensor.view(world, -1)
        residual = _kept(self.residual, rows) if self.error_feedback else None
        total, self.residual = _exchange_and_sum(rows, group, input_tensor.dtype, self.stats, residual)
        output_tensor.copy_(_apply_reduce_op(total, op, world).view_as(output_tensor))
        return None


def apply_squinch_fsdp(model: nn.Module, *, min_numel: int, error_feedback: bool,
                       stats: CommStats) -> dict[str, SquinchReduceScatter]:
    """Install a :class:`SquinchReduceScatter` on every FSDP2 module inside ``model`` (``model`` included).

    ``min_numel`` applies to each module's whole flat gradient (FSDP2 hands the reduce-scatter one flat
    tensor per module). Call after ``fully_shard``; on HSDP only the reduce-scatter is compressed.
    Returns the installed reduce-scatters by their module's FQN in ``model`` (``""``: ``model`` itself).
    """
    _check_options(min_numel, stats)
    if _ReduceScatter is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"Squinch for FSDP2 needs FSDPModule.set_custom_reduce_scatter and the FSDP2 "
                           f"ReduceScatter interface, missing in torch {torch.__version__}")
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    if not modules:
        raise ValueError("apply_squinch_fsdp: no FSDP2 module (fully_shard) found inside the model")
    installed = {name: SquinchReduceScatter(min_numel, error_feedback, stats) for name in modules}
    for name, module in modules.items():
        module.set_custom_reduce_scatter(installed[name])
    # FSDP2 places HSDP parameters as (Replicate, Shard, ...) on its (replicate, shard) mesh.
    if any(isinstance(p, DTensor) and p.device_mesh.ndim >= 2 and isinstance(p.placements[0], Replicate)
           for m in modules.values() for p in m.parameters(recurse=False)):
        logger.warning("Squinch on HSDP: FSDP2 in torch %s has no custom all-reduce for the replicate "
                       "dimension, so that all-reduce stays uncompressed", torch.__version__)
    return installed
