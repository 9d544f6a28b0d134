"""The optimizers of each model part (pipeline stages may hold several parts) behind one Stateful container:
AdamW for everything, or Muon for the blocks' matrices and AdamW for the rest.

Under muP (``model.parametrization = "mup"``) each parameter has a learning-rate multiplier chosen by its
clean FQN (``lr_scale``), so it is the same under any parallel layout; parameters with another multiplier
form param groups of their own, and ``set_lr`` gives each group the step's lr times its multiplier. The
multipliers come from the model's arguments, not from the checkpoint: a resumed run sets every group's lr
again before its first step, so it steps with exactly the lrs of the uninterrupted run.

Fused AdamW takes the clipping factor and the non-finite skip as device tensors (``grad_scale``,
``found_inf``: the kernel divides the gradients by the one and does nothing when the other is 1), so a step
needs no host read of the gradient norm and the GPU never waits for the host between steps."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_ext.config.job_config import OptimizerSection
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import is_hidden_matrix
from torchtitan_ext.parallel.compile import clean_fqn
from torchtitan_ext.parallel.grad_norm import clip_divisor, clip_grads_
from torchtitan_ext.train.muon import Muon


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """The blocks' weight matrices (and MoDE expert stacks); not embeddings, head, norms or routers."""
    fqn = clean_fqn(name)
    return p.ndim >= 2 and fqn.startswith("layers.") and ".router." not in fqn


def lr_scale(args: ModelArgs | None, name: str, p: torch.Tensor, muon: bool) -> float:
    """A parameter's learning-rate multiplier; 1 under the standard parametrization (or without ``args``).

    muP (Tensor Programs V) scales only the hidden matrices (``decoder.is_hidden_matrix``). With AdamW by
    1 / width_mult: Adam's update has entries of size lr at any width and lines up with the matrix's input,
    so its effect on the output grows with fan-in. The embedding (fan-in: the vocabulary), norms, residual
    scalars and the head keep the lr (the head's growing fan-in is offset by the output multiplier). With
    Muon (``muon``: this parameter is one of Muon's) by 1 / sqrt(width_mult): its update has every singular
    value 0.2 sqrt(max(fan_out, fan_in)) (``muon.muon_scale``), which grows like sqrt(width) when both fans
    grow with width, while muP wants the update's spectral norm to stay like sqrt(fan_out / fan_in), constant.
    AdamW and Muon couple weight decay to the lr, so the decay per step is scaled alike."""
    if args is None or args.parametrization != "mup" or not is_hidden_matrix(clean_fqn(name), p.ndim):
        return 1.0
    return args.width_mult ** -0.5 if muon else 1.0 / args.width_mult


def param_groups(model: nn.Module, weight_decay: float, args: ModelArgs | None, muon: bool) -> list[dict]:
    """AdamW's groups (without Muon's matrices under ``muon``): norms, biases and embeddings undecayed; an lr
    multiplier (``lr_scale``) other than 1 makes groups of its own after the two of the standard parametrization."""
    groups: dict[tuple[bool, float], list[torch.Tensor]] = {(True, 1.0): [], (False, 1.0): []}
    for name, p in model.named_parameters():
        if not p.requires_grad or muon and is_muon_param(name, p):
            continue
        decay = p.ndim >= 2 and "tok_embeddings" not in clean_fqn(name)
        groups.setdefault((decay, lr_scale(args, name, p, muon=False)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0}
            for (decay, _), params in groups.items()]


def _wants_triton(groups: list[dict], cfg: OptimizerSection) -> bool:
    if cfg.adamw_kernel == "triton" and not cfg.fused:
        raise ConfigError("optimizer.adamw_kernel = 'triton' needs optimizer.fused = true (it keeps the fused "
                          "kernel's device-side clipping and skip)")
    if cfg.adamw_kernel == "auto":
        on_gpu = any(p.is_cuda for group in groups for p in group["params"])
        return cfg.fused and on_gpu and importlib.util.find_spec("triton") is not None
    return cfg.adamw_kernel == "triton"


def adamw(groups: list[dict], cfg: OptimizerSection) -> torch.optim.AdamW:
    """torch's fused AdamW (CUDA and CPU both have the kernel), its foreach form when not ``fused``, or
    ``TritonAdamW`` (the same optimizer and state with a streaming kernel for large CUDA parameters)."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if _wants_triton(groups, cfg):
        try:
            from torchtitan_ext.train.triton_adamw import TritonAdamW
        except ImportError as e:
            raise ConfigError(f"optimizer.adamw_kernel = 'triton' needs triton (pip install "
                              f"'torchtitan_ext[gpu]'): {e}") from None
        return TritonAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, fused=cfg.fused, foreach=None if cfg.fused else True, **kwargs)


def build_part_optimizers(model: nn.Module, cfg: OptimizerSection, args: ModelArgs | None = None
                          ) -> list[torch.optim.Optimizer]:
    """AdamW alone, or Muon on the blocks' matrices plus AdamW on the rest, at the same learning rate."""
    groups = param_groups(model, cfg.weight_decay, args, muon=cfg.name == "muon")
    opts: list[torch.optim.Optimizer] = [adamw(groups, cfg)]
    if cfg.name == "muon":
        matrices = [p for n, p in model.named_parameters() if p.requires_grad and is_muon_param(n, p)]
        opts.append(Muon(matrices, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                         ns_steps=cfg.muon_ns_steps, weight_decay=cfg.weight_decay))
    return opts


class Optimizers:
    """The optimizers of every model part, stepped together; their state dict is keyed by parameter FQN so
    it reshards across layouts through torch.distributed.checkpoint. ``args``: the model's, for muP's lr
    multipliers (None: all 1)."""

    def __init__(self, parts: list[nn.Module], cfg: OptimizerSection, args: ModelArgs | None = None):
        self.parts = parts
        self.per_part = [build_part_optimizers(m, cfg, args) for m in parts]
        self.optimizers = [opt for opts in self.per_part for opt in opts]
        muon = cfg.name == "muon"
        self._lr_scales = {id(p): lr_scale(args, name, p, muon and is_muon_param(name, p))
                           for m in parts for name, p in m.named_parameters()}  # by id: groups share parameters

    def summary(self) -> str:
        """One line for the log: each optimizer and, for ``TritonAdamW``, the parameter tensors its kernel takes."""
        parts = []
        for opt in self.optimizers:
            params = [p for group in opt.param_groups for p in group["params"]]
            name = type(opt).__name__
            if hasattr(opt, "takes"):
                name += (f" (Triton kernel on {sum(map(opt.takes, params))} of {len(params)} parameter tensors, "
                         f"the local ones of >= {opt.min_numel:,} elements)")
            elif isinstance(opt, torch.optim.AdamW):
                name += " (torch's fused kernel)" if opt.defaults["fused"] else " (torch's foreach kernel)"
            parts.append(name)
        return "optimizer: " + " + ".join(parts)

    def set_lr(self, lr: float) -> None:
        """Every group's lr: ``lr`` times the group's multiplier (all of a group's parameters share it)."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * self._lr_scales[id(group["params"][0])] if group["params"] else lr

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
