"""``torchtitan_ext.plan.predicted_peak_bytes`` and ``fitting_changes``, what the trainer's out-of-memory line
quotes: the planner's peak for the exact layout, and override strings that the planner predicts fit, fastest
first, never an error."""

from __future__ import annotations

import dataclasses
import time

import pytest

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.plan import fitting_changes, predicted_peak_bytes
from torchtitan_ext.plan.estimate import GIB, plan
from torchtitan_ext.plan.search import Hardware, step_time

LONG_1B = ["--config", "train_configs/debug.toml", "--data.tokenizer", "byte", "--training.compile", "true",
           "--model.flavor", "1b", "--training.local_batch_size", "1", "--training.seq_len", "131072"]
LONG_8B = ["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--training.seq_len", "131072",
           "--training.local_batch_size", "1", "--parallelism.dp_shard", "-1"]


def _applied(argv: list[str], change: str):
    return parse_args([*argv, *change.split()])


def _tokens_per_gpu_s(cfg, world: int) -> float:
    return step_time(cfg, plan(cfg, world), Hardware()).tokens_per_gpu_s


def test_predicted_peak_is_the_plans():
    cfg = parse_args(LONG_1B)
    assert predicted_peak_bytes(cfg, 1) == int(plan(cfg, 1).peak)
    assert predicted_peak_bytes(parse_args([*LONG_8B, "--parallelism.cp", "8"]), 8) == int(
        plan(parse_args([*LONG_8B, "--parallelism.cp", "8"]), 8).peak)


@pytest.mark.parametrize("argv,world", [
    (["--parallelism.dp_shard", "3"], 4),  # degrees that do not make the world
    (["--parallelism.cp", "3"], 4),  # cp not dividing it
])
def test_unplannable_layout_gives_none_and_no_changes(argv, world):
    cfg = parse_args([*LONG_1B, *argv])
    assert predicted_peak_bytes(cfg, world) is None
    assert fitting_changes(cfg, world, 80 * GIB) == []
    broken = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, flavor="no-such-flavor"))
    assert predicted_peak_bytes(broken, 1) is None and fitting_changes(broken, 1, 80 * GIB) == []


def test_1b_at_128k_without_ac_on_one_h200():
    """Without checkpointing the 1b shape at 128k does not fit 139 GiB; op-level selective AC does (it recomputes
    less than full AC: first), then full AC."""
    cfg = parse_args(LONG_1B)
    assert predicted_peak_bytes(cfg, 1) > 139 * GIB
    changes = fitting_changes(cfg, 1, 139 * GIB)
    assert changes == ["--activation_checkpoint.mode selective --activation_checkpoint.selective_every 0",
                       "--activation_checkpoint.mode full"]
    for change in changes:
        assert plan(_applied(LONG_1B, change), 1).peak <= 139 * GIB


def test_changes_are_fastest_first_and_each_fits():
    """llama3_8b at 128k on 8 H200s (FSDP 8, no AC): each change returned fits 139 GiB, they are ordered by
    predicted tokens/s per GPU, a CP degree is among them and the smaller CP degrees, which do not fit, are not."""
    cfg, budget = parse_args(LONG_8B), 139 * GIB
    assert predicted_peak_bytes(cfg, 8) > budget
    changes = fitting_changes(cfg, 8, budget)
    assert 1 <= len(changes) <= 3
    cfgs = [_applied(LONG_8B, c) for c in changes]
    assert all(plan(c, 8).peak <= budget for c in cfgs)
    speeds = [_tokens_per_gpu_s(c, 8) for c in cfgs]
    assert speeds == sorted(speeds, reverse=True)
    cps = [c for c in changes if c.startswith("--parallelism.cp ")]
    assert cps, changes
    degree = int(cps[0].split()[1])
    assert degree > 2
    for smaller in (d for d in (2, 4) if d < degree):
        assert plan(parse_args([*LONG_8B, "--parallelism.cp", str(smaller)]), 8).peak > budget


def test_two_knobs_when_no_single_one_fits():
    """At 40 GiB no single change fits the 1b at 128k (full AC alone keeps the 128k-token logits); full AC with
    the fused cross-entropy does."""
    cfg = parse_args(LONG_1B)
    full = _applied(LONG_1B, "--activation_checkpoint.mode full")
    assert plan(full, 1).peak > 40 * GIB
    changes = fitting_changes(cfg, 1, 40 * GIB)
    assert "--activation_checkpoint.mode full --training.fused_linear_ce true" in changes
    for change in changes:
        assert len(change.split()) >= 4 and plan(_applied(LONG_1B, change), 1).peak <= 40 * GIB


def test_nothing_fits_gives_no_changes():
    assert fitting_changes(parse_args(LONG_1B), 1, 1 * GIB) == []


def test_fast_once_the_model_is_known():
    """The out-of-memory boundary calls both once; after the first plan of a model (its meta-device parameter
    count, cached) each answers in well under a second."""
    cfg = parse_args(LONG_8B)
    predicted_peak_bytes(cfg, 8)
    start = time.perf_counter()
    predicted_peak_bytes(cfg, 8)
    fitting_changes(cfg, 8, 80 * GIB)
    assert time.perf_counter() - start < 1.0
