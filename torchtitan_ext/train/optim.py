"""The optimizers of each model part (pipeline stages may hold several parts) behind one Stateful container:
AdamW for everything, or Muon for the blocks' matrices and AdamW for the rest.

Fused AdamW takes the clipping factor and the non-finite skip as device tensors (``grad_scale``,
``found_inf``: the kernel divides the gradients by the one and does nothing when the other is 1), so a step
needs no host read of the gradient norm and the GPU never waits for the host between steps."""

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
from torchtitan_ext.parallel.grad_norm import clip_divisor, clip_grads_
from torchtitan_ext.train.muon import Muon


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """The blocks' weight matrices (and MoDE expert stacks); not embeddings, head, norms or routers."""
    fqn = clean_fqn(name)
    return p.ndim >= 2 and fqn.startswith("layers.") and ".router." not in fqn


def param_groups(model: nn.Module, weight_decay: float, exclude=lambda name, p: False) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings are left undecayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or exclude(name, p):
            continue
        if p.ndim < 2 or "tok_embeddings" in clean_fqn(name):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_part_optimizers(model: nn.Module, cfg: OptimizerSection) -> list[torch.optim.Optimizer]:
    """AdamW alone, or Muon on the blocks' matrices plus AdamW on the rest (same learning rate)."""
    fused = cfg.fused  # CUDA and CPU both have the fused kernel
    exclude = is_muon_param if cfg.name == "muon" else (lambda name, p: False)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(param_groups(model, cfg.weight_decay, exclude), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                          eps=cfg.eps, fused=fused, foreach=None if fused else True)]
    if cfg.name == "muon":
        matrices = [p for n, p in model.named_parameters() if p.requires_grad and is_muon_param(n, p)]
        opts.append(Muon(matrices, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                         ns_steps=cfg.muon_ns_steps, weight_decay=cfg.weight_decay))
    return opts


class Optimizers:
    """The optimizers of every model part, stepped together; their state dict is keyed by parameter FQN so
    it reshards across layouts through torch.distributed.checkpoint."""

    def __init__(self, parts: list[nn.Module], cfg: OptimizerSection):
        self.parts = parts
        self.per_part = [build_part_optimizers(m, cfg) for m in parts]
        self.optimizers = [opt for opts in self.per_part for opt in opts]
        self.base_lr = cfg.lr

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    @property
    def skips_on_device(self) -> bool:
        """Every optimizer is fused AdamW: clipping and the non-finite skip ride in its kernel."""
        return all(isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] for opt in self.optimizers)

    @torch.no_grad()
    def step(self, params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` by the global ``norm`` and apply the update, unless the norm is not finite.
        Returns the skip flag (a float32 device scalar, 1 when skipped). Fused AdamW decides on the device;
        other optimizers (Muon, unfused AdamW) need the flag on the host first."""
        skipped = (~torch.isfinite(norm)).float()
        if self.skips_on_device:
            scale = clip_divisor(norm, max_norm) if max_norm > 0 else None
            for opt in self.optimizers:
                opt.grad_scale, opt.found_inf = scale, skipped
                opt.step()
                opt.grad_scale, opt.found_inf = None, None
        elif not skipped.item():
            if max_norm > 0:
                clip_grads_(params, norm, max_norm)
            for opt in self.optimizers:
                opt.step()
        return skipped

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        sd: dict = {}
        for m, opts in zip(self.parts, self.per_part, strict=True):
            sd.update(get_optimizer_state_dict(m, opts, options=StateDictOptions(flatten_optimizer_state_dict=True)))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for m, opts in zip(self.parts, self.per_part, strict=True):
            set_optimizer_state_dict(m, opts, sd, options=StateDictOptions(flatten_optimizer_state_dict=True))
