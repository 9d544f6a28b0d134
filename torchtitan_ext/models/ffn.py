"""The dense feed-forward network of a block (also MoDE's shared expert)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_ext.ops.kernels import gated_activation


class FeedForward(nn.Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` or squared ReLU ``w2(relu(w1 x)^2)``."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", fused: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if activation == "swiglu" else None
        self.fused_kernels = fused  # training.kernels = "triton": one Triton pass for the activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            return self.w2(gated_activation(self.w1(x), None if self.w3 is None else self.w3(x)))
        if self.w3 is None:
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
