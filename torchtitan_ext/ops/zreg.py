"""Gradient-only regularisers: a "virtual" loss whose gradient joins the backward pass while the value the
trainer reports stays that of the real loss (Character.ai's attention / output Z-regularisation)."""

from __future__ import annotations

import torch


class _AddVirtualGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, virtual: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def add_virtual_loss(out: torch.Tensor, virtual: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity on ``out``; in backward it also back-propagates the scalar ``virtual`` with weight ``scale``
    (the main loss's 1 / micro-batches, so the virtual loss is averaged exactly like the real one). ``out``
    must lie on the path to the loss (the attention output), so the gradient arrives during the attention
    backward, also in pipeline stages that never see the loss."""
    return _AddVirtualGrad.apply(out, virtual.float(), scale)


def attention_z_virtual(lse: torch.Tensor, coef: float, n_heads: int, n_layers: int) -> torch.Tensor:
    """``coef * sum(lse^2) / (heads * layers)`` averaged over the (batch, seq) query tokens; lse is
    (batch, local heads, seq)."""
    b, _, t = lse.shape
    return lse.float().pow(2).sum() * (coef / (n_heads * n_layers * b * t))


def output_z_term(logits: torch.Tensor, coef: float) -> torch.Tensor:
    """A zero-valued term to add to the loss whose gradient is that of ``coef * mean(logsumexp(logits)^2)``:
    ``x - x.detach()`` is exactly 0 in value, so the reported loss does not change."""
    z = torch.logsumexp(logits.flatten(0, -2).float(), dim=-1).pow(2).mean() * coef
    return z - z.detach()
