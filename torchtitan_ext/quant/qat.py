"""Quantisation-aware training of squared-ReLU feed-forward networks: symmetric int8 fake quantisation with a
straight-through estimator on the FFN input, its weights and its hidden activation ("middle").

``w2(relu(w1 x)^2)`` becomes ``fq(w2)(fq_out(relu(fq_in(fq(w1) fq(x)))^2))``: the input and the weights use a
dynamic per-tensor scale (their absolute maximum), the middle a fixed range that is clamped first:

- ``clamp = "static"``: the published constant, ``limit_in = 4`` before the activation and its square,
  ``limit_out = 16``, after it.
- ``clamp = "dynamic"``: ``limit_in = clamp_factor * rms(w1) * sqrt(fan_in)``, ``limit_out = limit_in^2``.
  For an RMS-normalised input (``|x|^2 = fan_in``) and weights of RMS ``r``, each projected value has a
  standard deviation of about ``r * sqrt(fan_in)``, so the limit is ``clamp_factor`` standard deviations of
  the middle input and follows the weights' scale as they grow or shrink during training. The default,
  ``clamp_factor = 4``, clips 0.006% of Gaussian values while a step of the 8-bit grid stays 4 / 127 of a
  standard deviation (and 16 / 127 of its square after the activation). Of the factors 1 to 16, 4 gives the
  FFN output the lowest relative RMS error, the same at any scale of ``w1``: below 3 clipping dominates, above
  6 the coarse grid of the squared middle does. The static clamp's error grows as ``w1`` moves away from its
  initial scale: 10x smaller, every middle value rounds to zero.

The straight-through estimator passes the gradient unchanged inside the clamp range and zeroes it outside.
Applied as a module swap (``apply_qat``) on the meta model before TP and FSDP, like quant/float8.py; the
parameters keep their names, so checkpoints load with or without QAT.

Under tensor parallelism the FFN computes on DTensors (``w1`` sharded by rows, ``w2`` by columns, the input
replicated; see parallel/tp.py): the absolute maxima and ``rms(w1)`` are reductions over the whole DTensor,
so every rank quantises with the same scales as one process would, and the output is a partial sum that
the TP plan reduce-scatters.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_ext.models.ffn import FeedForward

QMAX = 127  # symmetric int8: [-127, 127]


def fake_quant(x: torch.Tensor, limit: torch.Tensor | float) -> torch.Tensor:
    """Clamp to [-limit, limit], round to the grid of step ``limit / QMAX``; straight-through gradient
    inside the range, zero outside."""
    limit = torch.as_tensor(limit, dtype=x.dtype, device=x.device).detach().clamp_min(1e-12)
    clamped = torch.maximum(torch.minimum(x, limit), -limit)
    scale = limit / QMAX
    q = torch.round(clamped / scale) * scale
    return clamped + (q - clamped).detach()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A reduction's value over the whole tensor: a DTensor's (all-reduced over its mesh) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def fake_quant_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor dynamic scale: the limit is the tensor's absolute maximum (nothing is clipped); for a
    sharded DTensor the maximum over all shards."""
    return fake_quant(x, _whole(x.detach().abs().amax()))


def clamp_limits(w_in: torch.Tensor, clamp: str, clamp_factor: float) -> tuple[torch.Tensor | float, ...]:
    """(limit_in, limit_out) of the middle for ``w_in`` (hidden, fan_in)."""
    if clamp == "static":
        return 4.0, 16.0
    mean_square = _whole(w_in.detach().float().pow(2).mean())  # over all shards of a DTensor
    limit_in = clamp_factor * mean_square.sqrt() * math.sqrt(w_in.shape[-1])
    return limit_in, limit_in * limit_in


class QATFeedForward(nn.Module):
    """A squared-ReLU FeedForward with fake-quantised input, weights and middle (same parameter names)."""

    def __init__(self, ffn: FeedForward, clamp: str, clamp_factor: float):
        super().__init__()
        if ffn.w3 is not None:
            raise ValueError("QAT needs squared-ReLU FFNs (model activation 'relu2'), not SwiGLU")
        self.w1, self.w2, self.w3 = ffn.w1, ffn.w2, None
        # It computes on the DTensor weights itself and returns w2's partial sums (the TP plan reads this).
        self.returns_partial_sums = True
        self.clamp, self.clamp_factor = clamp, clamp_factor

    def middle(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(middle input before quantisation, quantised middle output): for the tests' measurements."""
        w1 = self.w1.weight
        h = F.linear(fake_quant_absmax(x), fake_quant_absmax(w1))
        limit_in, limit_out = clamp_limits(w1, self.clamp, self.clamp_factor)
        return h, fake_quant(F.relu(fake_quant(h, limit_in)).square(), limit_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.middle(x)[1], fake_quant_absmax(self.w2.weight))


def apply_qat(model: nn.Module, clamp: str, clamp_factor: float) -> int:
    """Swap every dense FeedForward of the model's blocks for a QATFeedForward; returns how many."""
    swapped = 0
    for block in model.layers.values():
        if isinstance(block.feed_forward, FeedForward):
            block.feed_forward = QATFeedForward(block.feed_forward, clamp, clamp_factor)
            swapped += 1
    return swapped
