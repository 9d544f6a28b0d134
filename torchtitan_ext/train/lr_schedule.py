"""Learning-rate multipliers as pure functions of the step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math

from torchtitan_ext.config.job_config import LRSchedulerSection


def lr_multiplier(step: int, total_steps: int, cfg: LRSchedulerSection) -> float:
    """Multiplier of the peak LR at 1-based ``step``: linear warmup, then cosine to ``min_lr_ratio``,
    warmup-stable-decay (flat, then a linear or cosine warm-down over ``decay_fraction`` of the steps),
    or constant."""
    if step <= cfg.warmup_steps:
        return step / max(cfg.warmup_steps, 1)
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        progress = min((step - cfg.warmup_steps) / max(total_steps - cfg.warmup_steps, 1), 1.0)
    else:
        decay_steps = int(round(cfg.decay_fraction * total_steps))
        decay_start = total_steps - decay_steps
        if step <= decay_start or decay_steps == 0:
            return 1.0
        progress = min((step - decay_start) / decay_steps, 1.0)
        if cfg.decay_shape == "linear":
            return 1.0 - (1 - floor) * progress
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
