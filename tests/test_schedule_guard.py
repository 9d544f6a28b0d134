"""LR schedules against hand-computed values; the loss-spike guard's trigger and LR cut."""

from __future__ import annotations

import math

import pytest

from torchtitan_ext.config.job_config import LRSchedulerSection
from torchtitan_ext.train.lr_schedule import lr_multiplier
from torchtitan_ext.train.spike_guard import SpikeGuard


def test_warmup_cosine():
    cfg = LRSchedulerSection(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(1, 110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(10, 110, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, 110, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(110, 110, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("shape, mid", [
    ("linear", 1 - 0.9 * 0.5),
    ("cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))),
])
def test_warmup_stable_decay(shape, mid):
    cfg = LRSchedulerSection(name="wsd", warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2,
                             decay_shape=shape)
    assert lr_multiplier(5, 100, cfg) == pytest.approx(0.5)
    assert lr_multiplier(50, 100, cfg) == 1.0
    assert lr_multiplier(80, 100, cfg) == 1.0          # decay starts after step 80 (last 20 steps)
    assert lr_multiplier(90, 100, cfg) == pytest.approx(mid)
    assert lr_multiplier(100, 100, cfg) == pytest.approx(0.1)


def test_spike_guard_halves_lr_for_window_steps():
    g = SpikeGuard(factor=1.5, window=4, lr_scale=0.5)
    for loss in (2.0, 2.0, 2.0, 2.0):
        assert not g.observe(loss)
    assert g.lr_factor == 1.0
    assert not g.observe(2.9)                    # below 1.5 x mean(2,2,2,2) = 3.0
    assert g.observe(3.5)                        # > 1.5 x mean(2,2,2,2.9) = 3.34
    assert [g.lr_factor for _ in range(1)] == [0.5]
    for _ in range(3):
        g.observe(2.0)
        assert g.lr_factor == 0.5
    g.observe(2.0)
    assert g.lr_factor == 1.0 and g.spikes == 1


def test_spike_guard_state_round_trip():
    g = SpikeGuard(window=3)
    for loss in (1.0, 1.0, 1.0, 5.0):
        g.observe(loss)
    h = SpikeGuard(window=3)
    h.load_state_dict(g.state_dict())
    assert h.lr_factor == g.lr_factor == 0.5
    assert h.observe(1.0) == g.observe(1.0) and h.cut_remaining == g.cut_remaining
