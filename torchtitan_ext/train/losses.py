"""Next-token cross-entropy with the optional z-loss on the output logits (PaLM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean over tokens of CE, plus ``z_loss * logsumexp(logits)^2`` which keeps the softmax normaliser
    near 1 and the logits from drifting. Computed in float32."""
    logits = logits.flatten(0, -2).float()
    loss = F.cross_entropy(logits, labels.flatten())
    if z_loss > 0:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return loss
