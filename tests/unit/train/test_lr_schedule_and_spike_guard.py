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
    """A spike read at step k cuts steps k+2 .. k+1+window (the loss is read one step late)."""
    g = SpikeGuard(factor=1.5, window=4, lr_scale=0.5)
    for step, loss in enumerate((2.0, 2.0, 2.0, 2.0), start=1):
        assert not g.observe(step, loss)
    assert [g.lr_factor(s) for s in range(1, 8)] == [1.0] * 7
    assert not g.observe(5, 2.9)                 # below 1.5 x mean(2,2,2,2) = 3.0
    assert g.observe(6, 3.5)                     # > 1.5 x mean(2,2,2,2.9) = 3.34
    assert [g.lr_factor(s) for s in range(6, 13)] == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0]
    for step in range(7, 12):
        g.observe(step, 2.0)
    assert g.spikes == 1
    assert g.observe(12, 9.0) and [g.lr_factor(s) for s in (13, 14, 17, 18)] == [1.0, 0.5, 0.5, 1.0]


def test_spike_guard_extends_a_running_cut():
    g = SpikeGuard(factor=1.5, window=3, lr_scale=0.5)
    for step, loss in enumerate((1.0, 1.0, 1.0, 5.0), start=1):
        g.observe(step, loss)                    # spike at 4: steps 6..8 cut
    assert g.observe(5, 9.0)                     # > 1.5 x mean(1, 1, 5): cut runs on to 5+1+3 = 9
    assert [g.lr_factor(s) for s in range(5, 11)] == [1.0, 0.5, 0.5, 0.5, 0.5, 1.0] and g.spikes == 2


def test_spike_guard_state_round_trip():
    g = SpikeGuard(window=3)
    for step, loss in enumerate((1.0, 1.0, 1.0, 5.0), start=1):
        g.observe(step, loss)
    h = SpikeGuard(window=3)
    h.load_state_dict(g.state_dict(), step=4)
    assert [h.lr_factor(s) for s in range(5, 10)] == [g.lr_factor(s) for s in range(5, 10)] == \
        [1.0, 0.5, 0.5, 0.5, 1.0]
    assert h.observe(5, 1.0) == g.observe(5, 1.0) and h.history == g.history


def test_spike_guard_loads_a_cut_saved_as_its_length():
    """Checkpoints written before cuts were step-numbered saved the remaining length."""
    h = SpikeGuard(window=3)
    h.load_state_dict({"history": [1.0, 1.0, 1.0], "cut_remaining": 2, "spikes": 1}, step=10)
    assert [h.lr_factor(s) for s in (10, 11, 12, 13)] == [1.0, 0.5, 0.5, 1.0]
