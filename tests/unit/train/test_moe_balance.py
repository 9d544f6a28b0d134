"""The MoDE load metrics a logged step reports (``train/moe_balance.py``), against values worked by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.train.moe_balance import balance_experts


def _layers() -> nn.Module:
    args = ModelArgs(vocab_size=8, dim=8, n_heads=2, n_experts=4, top_k=2, moe_hidden=8)
    parts = nn.Module()
    parts.layers = nn.ModuleDict({"0": nn.Module(), "1": nn.Module()})
    for block in parts.layers.values():
        block.feed_forward = MoDE(args)
    return parts


def test_reported_metrics_equal_the_hand_computed_ones_and_the_counters_reset():
    parts = _layers()
    first, second = (parts.layers[k].feed_forward for k in ("0", "1"))
    first.load.copy_(torch.tensor([6, 2, 0, 0]))
    second.load.copy_(torch.tensor([2, 2, 2, 2]))
    first.domain_load[3] = torch.tensor([1, 5, 0, 2])  # domain 3: 8 copies, expert 1 the top one
    second.domain_load[0] = torch.tensor([4, 0, 0, 0])
    first.last_aux_loss, first.last_z_loss = torch.tensor(1.5), torch.tensor(0.25)
    second.last_aux_loss, second.last_z_loss = torch.tensor(0.5), torch.tensor(0.75)

    metrics = balance_experts([parts], None, report=True)

    assert metrics == {
        "moe/layers.0/imbalance": pytest.approx(6 / 2), "moe/layers.0/min_share": 0.0,
        "moe/layers.0/domain3_top_expert_share": pytest.approx(5 / 8), "moe/layers.0/domain3_top_expert": 1.0,
        "moe/layers.1/imbalance": 1.0, "moe/layers.1/min_share": pytest.approx(0.25),
        "moe/layers.1/domain0_top_expert_share": 1.0, "moe/layers.1/domain0_top_expert": 0.0,
        "moe/aux_loss": pytest.approx(1.0), "moe/router_z_loss": pytest.approx(0.5)}
    assert list(metrics)[:4] == ["moe/layers.0/imbalance", "moe/layers.0/min_share",
                                 "moe/layers.0/domain3_top_expert_share", "moe/layers.0/domain3_top_expert"]
    for layer in (first, second):
        assert not layer.load.any() and not layer.domain_load.any()
    assert balance_experts([parts], None, report=False) == {}
