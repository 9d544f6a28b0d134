"""A CUDA out-of-memory error as the one line the user acts on: where the job was (building, a step,
evaluation, a checkpoint save), the allocator's peak against the card, the planner's predicted peak for this
layout, and the changes the planner expects to fit."""

from __future__ import annotations

import logging
import traceback

import torch

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import OutOfDeviceMemory
from torchtitan_ext.plan.fit import fitting_changes, predicted_peak_bytes

log = logging.getLogger(__name__)
GIB = 1 << 30


def oom_stage(error: BaseException, step: int | None) -> str:
    """Where the error rose: the build (no step yet), or evaluation / a checkpoint save / a training step,
    told from the functions on its traceback."""
    if step is None:
        return "while building the run (model, optimizer, resume)"
    frames = traceback.extract_tb(error.__traceback__)
    names = {(frame.filename.replace("\\", "/").rsplit("/", 2)[-2:][0], frame.name) for frame in frames}
    if any(name == "evaluate" for _, name in names):
        return f"in evaluation after step {step}"
    if any(folder == "checkpoint" for folder, _ in names):
        return f"while saving the checkpoint of step {step}"
    return f"in training step {step}"


def _planner_figures(cfg: JobConfig, world_size: int, capacity: int) -> tuple[float | None, list[str]]:
    """(predicted peak bytes or None, the changes that would fit); the planner's, when it can model the
    layout."""
    try:
        return predicted_peak_bytes(cfg, world_size), fitting_changes(cfg, world_size, capacity)
    except Exception as e:  # the message must come whatever the planner makes of this layout
        log.debug(f"planner could not model this layout: {e}")
        return None, []


def out_of_memory(error: BaseException, cfg: JobConfig, step: int | None, world_size: int) -> OutOfDeviceMemory:
    """The one-line error for a CUDA out-of-memory ``error`` raised at ``step`` (None: before training)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    peak = torch.cuda.max_memory_allocated(device) if device is not None else 0
    capacity = torch.cuda.get_device_properties(device).total_memory if device is not None else 0
    predicted, fits = _planner_figures(cfg, world_size, capacity)
    ac = cfg.activation_checkpoint
    parts = [f"CUDA out of memory {oom_stage(error, step)}: allocator peak {peak / GIB:.1f} GiB of "
             f"{capacity / GIB:.1f} GiB",
             f"planner's predicted peak {predicted / GIB:.1f} GiB" if predicted else "no planner estimate",
             f"layout: local batch {cfg.training.local_batch_size} x seq {cfg.training.seq_len}, "
             f"activation_checkpoint.mode {ac.mode}" + (f" (selective_every {ac.selective_every})"
                                                       if ac.mode == "selective" else "")
             + f", parallelism.cp {cfg.parallelism.cp}"]
    if not fits:  # the generic knobs, lightest first
        fits = [f"--{key} {value}" for key, value, applies in (
            ("activation_checkpoint.mode", "full", ac.mode != "full"),
            ("training.fused_linear_ce", "true", not cfg.training.fused_linear_ce),
            ("training.local_batch_size", max(1, cfg.training.local_batch_size // 2),
             cfg.training.local_batch_size > 1),
            ("parallelism.cp", 2 * cfg.parallelism.cp, world_size > 1)) if applies]
    parts.append("would fit: " + (" or ".join(fits) if fits else "a larger card or more GPUs"))
    parts.append("nothing saved was touched")
    return OutOfDeviceMemory("; ".join(parts))
