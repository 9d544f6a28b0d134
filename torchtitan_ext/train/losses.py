"""Next-token cross-entropy with the optional z-loss on the output logits (PaLM)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from torchtitan_ext.errors import ConfigError
from torchtitan_ext.ops.linear_cross_entropy import linear_cross_entropy, vocab_parallel_linear_cross_entropy


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
    (``ops/linear_cross_entropy.py``); the model returns hidden states (``ComputeOptions.return_hidden``).
    Under TP the head's rows (the vocabulary) stay split: each rank gathers the sequence-sharded hidden states
    and scores its slice of the vocabulary (the vocabulary-parallel form). Refuses the layouts it does not
    cover with one line."""
    if dims.pp > 1 or dims.ddp_enabled:
        raise ConfigError("training.fused_linear_ce runs with FSDP/HSDP, TP or one process; not with pp > 1 or "
                          "parallelism.dp_mode = 'ddp'")
    model = parts[0]
    head_module = model.output if model.output is not None else model.tok_embeddings
    tp_group = dims.submesh("tp").get_group() if dims.tp > 1 else None  # TP checked that tp divides the vocab

    def loss(hidden: torch.Tensor, labels: torch.Tensor, z_loss: float) -> torch.Tensor:
        head = head_module.weight
        if tp_group is None:
            return linear_cross_entropy(hidden, head, labels, z_loss, softcap, chunk)
        # The kernel sums the hidden gradient over the TP group itself, so it is a replicated gradient here.
        full = hidden.redistribute(placements=[Replicate()]).to_local() if isinstance(hidden, DTensor) else hidden
        return vocab_parallel_linear_cross_entropy(full, head.to_local(), labels, tp_group, z_loss, softcap, chunk)

    return loss
