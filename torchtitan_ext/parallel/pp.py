"""Pipeline parallelism with ``torch.distributed.pipelining``.

The meta-device Decoder is cut by layers into ``pp x virtual_stages`` stages; a stage is a Decoder that
keeps its layers (with their original FQNs, so checkpoints load under any layout), the embedding on the
first stage and the norm and head on the last. Interleaved schedules give rank r the stages r, r + pp, ...;
ZBV gives it r and 2 pp - 1 - r (a "V"), so rank 0 holds both the first and the last stage.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.utils.checkpoint import GraphExecGroup

from torchtitan_ext.errors import ConfigError

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "InterleavedZeroBubble": ScheduleInterleavedZeroBubble, "ZBVZeroBubble": ScheduleZBVZeroBubble}
SINGLE_STAGE = ("GPipe", "1F1B")


def layer_ranges(n_layers: int, n_stages: int, split_points: list[str]) -> list[range]:
    """Layers of each stage: from explicit ``layers.N`` split points, or balanced (extra layers go to the
    stages after the first, which also carries the embedding)."""
    if split_points:
        if len(split_points) != n_stages - 1:
            raise ConfigError(f"parallelism.pp_split_points has {len(split_points)} entries; {n_stages} stages "
                              f"need {n_stages - 1}")
        try:
            firsts = [int(p.removeprefix("layers.")) for p in split_points]
        except ValueError:
            raise ConfigError(f"parallelism.pp_split_points = {split_points}: expected names like "
                              "\"layers.8\"") from None
        bounds = [0, *firsts, n_layers]
        if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ConfigError(f"parallelism.pp_split_points = {split_points}: expected increasing layers "
                              f"between 1 and {n_layers - 1}")
    elif n_layers < n_stages:
        raise ConfigError(f"model has {n_layers} layers, fewer than the {n_stages} pipeline stages asked for "
                          "(parallelism.pp x pp_virtual_stages)")
    else:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if 0 < i <= extra else 0) for i in range(n_stages)]
        bounds = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def check_schedule(schedule: str, virtual: int, microbatches: int, pp: int, local_batch: int,
                   op_level_sac: bool = False, compiled: bool = False) -> None:
    """ConfigError (one line) for a schedule the job cannot run. ``op_level_sac``: the blocks use op-level
    selective activation checkpointing, whose saved values serve one backward pass only, while the zero-bubble
    schedules run each stage's backward in two (input gradients, then weight gradients). ``compiled``: the
    blocks are compiled (training.compile), which torch's zero-bubble schedules refuse for the same split."""
    if schedule in ZERO_BUBBLE and compiled:
        raise ConfigError(f"parallelism.pp_schedule = {schedule!r} splits each stage's backward into input and "
                          f"weight gradients, which torch does not support for compiled blocks; set "
                          f"training.compile = false or use 1F1B / Interleaved1F1B")
    if schedule in ZERO_BUBBLE and op_level_sac:
        raise ConfigError(f"parallelism.pp_schedule = {schedule!r} runs each stage's backward in two passes, which "
                          f"op-level selective activation checkpointing (activation_checkpoint.mode = 'selective', "
                          f"selective_every = 0) cannot replay; use activation_checkpoint.mode = 'full' or 'none', "
                          f"selective_every > 0, or a 1F1B schedule")
    if schedule in SINGLE_STAGE and virtual != 1:
        raise ConfigError(f"parallelism.pp_schedule = {schedule!r} runs one stage per rank; set "
                          f"pp_virtual_stages = 1 (got {virtual}) or use Interleaved1F1B")
    if schedule == "ZBVZeroBubble" and virtual != 2:
        raise ConfigError(f"parallelism.pp_schedule = 'ZBVZeroBubble' needs pp_virtual_stages = 2 (got {virtual})")
    if local_batch % microbatches:
        raise ConfigError(f"training.local_batch_size = {local_batch} is not divisible by "
                          f"parallelism.pp_microbatches = {microbatches}")
    if microbatches < pp:
        raise ConfigError(f"parallelism.pp_microbatches = {microbatches} is fewer than pp = {pp}: the pipeline "
                          "would never fill")


def split_stages(model: nn.Module, pp_rank: int, pp: int, virtual: int, schedule: str,
                 split_points: list[str]) -> list[tuple[int, nn.Module]]:
    """(stage id, stage module) for this rank, cut from a meta-device Decoder."""
    if model.output is None:
        raise ConfigError("pipeline parallelism needs untied embeddings (the flavor ties them)")
    n_stages = pp * virtual
    ranges = layer_ranges(len(model.layers), n_stages, split_points)
    stages = []
    for sid in stage_ids(pp_rank, pp, virtual, schedule):
        stage = copy.deepcopy(model)
        for name in list(stage.layers):
            if int(name) not in ranges[sid]:
                del stage.layers[name]
        if sid != 0:
            stage.tok_embeddings = None
        if sid != n_stages - 1:
            stage.norm = stage.output = None
        stages.append((sid, stage))
    return stages


class ArgCarrier(nn.Module):
    """A stage that takes the micro-batch's per-token arguments after the hidden states and hands them on with
    its output: ``torch.distributed.pipelining`` passes arguments to the first stage only, and they must be
    split into micro-batches with the tokens. ``masked``: the visibility (start, limit) and the positions;
    else the positions alone (context parallelism's global RoPE positions). The integer tensors get no
    gradient."""

    def __init__(self, stage: nn.Module, last: bool, masked: bool):
        super().__init__()
        self.stage, self.last, self.masked = stage, last, masked

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        if self.masked:
            start, limit, positions = carried
            out = self.stage(x, visibility=(start, limit), positions=positions)
        else:
            (positions,) = carried
            out = self.stage(x, positions=positions)
        return out if self.last else (out, *carried)


class Stage(PipelineStage):
    """A pipeline stage whose weight-gradient pass recomputes each checkpointed block once.

    Zero-bubble schedules split a stage's backward into an input-gradient pass and a weight-gradient pass;
    torch runs the latter as one ``autograd.grad`` per parameter group (a block has nine: four attention
    projections, three FFN matrices, two norms). Non-reentrant checkpointing recomputes a block for each of
    those calls and keeps the recomputed tensors the others need until the pass ends: 11 runs of a block per
    micro-batch instead of 3, and a peak memory far above the schedule's own. Under one ``GraphExecGroup`` the
    calls share one recomputation; they touch disjoint weights, which the group requires."""

    def backward_weight_one_chunk(self, *args, **kwargs):
        with GraphExecGroup():
            return super().backward_weight_one_chunk(*args, **kwargs)


def build_schedule(stages: list[tuple[int, nn.Module]], n_stages: int, device: torch.device, group,
                   schedule: str, microbatches: int, loss_fn: Callable, carry: str = "none"):
    """The schedule driving this rank's (already parallelized and materialised) stages; ``carry``: what the
    stages take and pass on after the hidden states: ``"mask"`` (start, limit, positions), ``"positions"``
    or ``"none"``."""
    if carry != "none":
        stages = [(sid, ArgCarrier(m, sid == n_stages - 1, carry == "mask")) for sid, m in stages]
    pipe = [Stage(m, sid, n_stages, device, group=group) for sid, m in stages]
    try:
        return SCHEDULES[schedule](pipe[0] if schedule in SINGLE_STAGE else pipe, n_microbatches=microbatches,
                                   loss_fn=loss_fn)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"parallelism.pp_schedule = {schedule!r}: {e}") from None
