"""What the trainer's out-of-memory boundary says: the planner's predicted peak for the job's exact layout, and
the changes of one or two knobs (activation checkpointing, the fused cross-entropy, the local batch, the context
parallel degree) that the planner predicts would fit, cheapest first. Both answer from the config alone (meta
device, no GPU) and never raise: a layout the planner cannot model gives None / [].
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.plan.estimate import plan
from torchtitan_ext.plan.search import Hardware, step_time

MAX_CHANGES = 3
CP_FACTORS = (2, 4, 8, 16)  # the context parallel degree times these, smallest first


@dataclasses.dataclass(frozen=True)
class _Change:
    """One or two knobs' new settings: the override strings that give them, and per config section the values."""
    overrides: tuple[str, ...]
    values: tuple[tuple[str, dict], ...]

    @property
    def knobs(self) -> set[str]:
        """The keys it sets (the two activation checkpointing changes share ``--activation_checkpoint.mode``)."""
        return {override.split()[0] for override in self.overrides}

    def __add__(self, other: _Change) -> _Change:
        return _Change(self.overrides + other.overrides, self.values + other.values)

    def apply(self, cfg: JobConfig) -> JobConfig:
        for section, values in self.values:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})
        return cfg


def predicted_peak_bytes(cfg: JobConfig, world_size: int) -> int | None:
    """The planner's predicted peak memory per GPU (with its allocator slack) of ``cfg`` on ``world_size`` ranks,
    or None where it cannot plan that layout."""
    try:
        return int(plan(cfg, world_size).peak)
    except Exception:  # noqa: BLE001 - called from an error path: an unplannable layout has no prediction
        return None


def fitting_changes(cfg: JobConfig, world_size: int, capacity_bytes: float) -> list[str]:
    """At most MAX_CHANGES override strings (e.g. ``--activation_checkpoint.mode full``, or two knobs in one
    string) whose predicted peak fits ``capacity_bytes`` per GPU, the fastest predicted (tokens per second per
    GPU) first. Single changes are tried first, pairs of different knobs only when none of those fits; [] when
    nothing tried fits or the layout cannot be planned."""
    try:
        singles = list(_single_changes(cfg, world_size))
        fits = _fitting(cfg, singles, world_size, capacity_bytes)
        if not fits:
            pairs = [a + b for a, b in itertools.combinations(singles, 2) if not a.knobs & b.knobs]
            fits = _fitting(cfg, pairs, world_size, capacity_bytes)
        return [" ".join(c.overrides) for c in fits[:MAX_CHANGES]]
    except Exception:  # noqa: BLE001 - called from an error path: no advice rather than a second error
        return []


def _single_changes(cfg: JobConfig, world: int) -> Iterator[_Change]:
    """Each knob moved one way that lowers memory: lighter activation checkpointing, the fused cross-entropy,
    each smaller local batch that keeps the global batch whole, a higher context parallel degree (taking its
    ranks from dp_shard where that is fixed)."""
    ac, t, par = cfg.activation_checkpoint, cfg.training, cfg.parallelism
    if ac.mode == "none" or (ac.mode == "selective" and ac.selective_every > 0):
        yield _Change(("--activation_checkpoint.mode selective", "--activation_checkpoint.selective_every 0"),
                      (("activation_checkpoint", {"mode": "selective", "selective_every": 0}),))
    if ac.mode != "full":
        yield _Change(("--activation_checkpoint.mode full",), (("activation_checkpoint", {"mode": "full"}),))
    if not t.fused_linear_ce:
        yield _Change(("--training.fused_linear_ce true",), (("training", {"fused_linear_ce": True}),))
    for batch in range(t.local_batch_size - 1, 0, -1):
        if t.local_batch_size % batch == 0:
            yield _Change((f"--training.local_batch_size {batch}",), (("training", {"local_batch_size": batch}),))
    for factor in CP_FACTORS:
        cp = par.cp * factor
        if world % cp:
            break
        if par.dp_shard == -1:
            yield _Change((f"--parallelism.cp {cp}",), (("parallelism", {"cp": cp}),))
        elif par.dp_shard % factor == 0:
            shard = par.dp_shard // factor
            yield _Change((f"--parallelism.cp {cp}", f"--parallelism.dp_shard {shard}"),
                          (("parallelism", {"cp": cp, "dp_shard": shard}),))


def _fitting(cfg: JobConfig, changes: list[_Change], world: int, capacity: float) -> list[_Change]:
    """The changes whose plan fits ``capacity``, fastest first; those the planner refuses are left out."""
    scored = []
    hw = Hardware()
    for change in changes:
        changed = change.apply(cfg)
        try:
            p = plan(changed, world)
        except Exception:  # noqa: BLE001 - a change the trainer's checks refuse is no advice
            continue
        if p.peak <= capacity:
            scored.append((-step_time(changed, p, hw).tokens_per_gpu_s, p.peak, change))
    scored.sort(key=lambda s: (s[0], s[1]))
    return [change for _, _, change in scored]
