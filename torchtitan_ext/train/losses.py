"""Next-token cross-entropy with the optional z-loss on the output logits (PaLM)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_ext.config.loader import ConfigError
from torchtitan_ext.ops.linear_cross_entropy import linear_cross_entropy


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean over tokens of CE, plus ``z_loss * logsumexp(logits)^2`` which keeps the softmax normaliser
    near 1 and the logits from drifting. Computed in float32."""
    logits = logits.flatten(0, -2).float()
    loss = F.cross_entropy(logits, labels.flatten())
    if z_loss > 0:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return loss


def fused_head_loss(parts: list[nn.Module], dims, chunk: int, softcap: float) -> Callable:
    """A loss ``(hidden, labels, z_loss)`` applying the model's head (or tied embedding) in token chunks
    (``ops/linear_cross_entropy.py``); switches the model to return hidden states. Refuses the layouts it
    does not cover with one line."""
    if dims.pp > 1 or dims.tp > 1 or dims.ddp_enabled:
        raise ConfigError("training.fused_linear_ce runs with FSDP/HSDP or one process; not with pp > 1, tp > 1 "
                          "or parallelism.dp_mode = 'ddp'")
    model = parts[0]
    model.return_hidden = True

    def loss(hidden: torch.Tensor, labels: torch.Tensor, z_loss: float) -> torch.Tensor:
        head = model.output.weight if model.output is not None else model.tok_embeddings.weight
        return linear_cross_entropy(hidden, head, labels, z_loss, softcap, chunk)

    return loss
