"""The dense feed-forward network of a block (also MoDE's shared expert)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_ext.ops.kernels import gated_activation
from torchtitan_ext.ops.projections import project


class FeedForward(nn.Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` or squared ReLU ``w2(relu(w1 x)^2)``."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", fused: bool = False,
                 fused_projections: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if activation == "swiglu" else None
        self.fused_kernels = fused  # training.kernels = "triton": one Triton pass for the activation
        self.fused_projections = fused_projections  # w1 and w3 as one GEMM (ops.projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            h = self.w1(x)
            return self.w2(gated_activation(h, None) if self.fused_kernels else F.relu(h).square())
        gate, up = project(x, (self.w1, self.w3), self.fused_projections)
        return self.w2(gated_activation(gate, up) if self.fused_kernels else F.silu(gate) * up)
