"""AdamW per model part (pipeline stages may hold several parts) behind one Stateful container."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_ext.config.job_config import OptimizerSection
from torchtitan_ext.parallel.compile import clean_fqn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings are left undecayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "tok_embeddings" in clean_fqn(name):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Optimizers:
    """One AdamW per model part, stepped together; its state dict is keyed by parameter FQN so it
    reshards across layouts through torch.distributed.checkpoint."""

    def __init__(self, parts: list[nn.Module], cfg: OptimizerSection):
        fused = cfg.fused and torch.cuda.is_available()
        self.parts = parts
        self.optimizers = [
            torch.optim.AdamW(param_groups(m, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                              eps=cfg.eps, fused=fused, foreach=None if fused else True)
            for m in parts
        ]
        self.base_lr = cfg.lr

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        sd: dict = {}
        for m, opt in zip(self.parts, self.optimizers, strict=True):
            sd.update(get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for m, opt in zip(self.parts, self.optimizers, strict=True):
            set_optimizer_state_dict(m, opt, sd, options=StateDictOptions(flatten_optimizer_state_dict=True))
