"""What the float8 tests share: whether torchao's float8 imports here, an initialised decoder, and a short
training loop on one batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torchtitan_ext.models.decoder import Decoder, fill_param_

try:
    import torchao.float8  # noqa: F401

    TORCHAO_ERROR = None
except Exception as e:  # ImportError, or a torchao built for another torch failing at import
    TORCHAO_ERROR = f"torchao.float8 does not import here: {type(e).__name__}: {e}"

needs_torchao = pytest.mark.skipif(TORCHAO_ERROR is not None, reason=str(TORCHAO_ERROR))


def init_decoder(model: Decoder, seed: int, device: str = "cpu") -> Decoder:
    """``model`` with the trainer's initialisation (its init plan, seeded) and its buffers on ``device``."""
    plan = model.init_plan()
    for name, p in model.named_parameters():
        fill_param_(name, p.data, *plan[name], seed)
    model.init_buffers(torch.device(device))
    return model


def train_losses(model: nn.Module, tokens: torch.Tensor, steps: int, lr: float = 3e-3) -> list[float]:
    """The next-token losses of ``steps`` AdamW steps on the one batch ``tokens``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
