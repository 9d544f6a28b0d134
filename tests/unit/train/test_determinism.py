"""training.deterministic's switches: make_deterministic sets every one."""

from __future__ import annotations

import torch


def test_make_deterministic_sets_every_switch(monkeypatch):
    from torchtitan_ext.train.determinism import make_deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    try:
        make_deterministic(7)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.equal(torch.rand(3), (torch.manual_seed(7), torch.rand(3))[1])
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]
