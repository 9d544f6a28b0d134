"""The student side of distillation in the trainer: the sidecars the loader opens, and the mixed loss.

Under pipeline parallelism the soft targets ride with the labels: ``pack`` joins labels, kept tokens and
target weights into one float64 tensor (every value exact: ids below 2^53, float32 weights), which the
schedule splits into micro-batches like plain labels and hands to the last stage's loss, where ``unpack``
separates them again. Not supported, with one line each: ``training.fused_linear_ce`` (the model returns
hidden states, the soft loss needs the logits), and loaders other than the plain shard stream
(``data.domains``, ``data.packing = 'bfd'``: their windows are not the fixed shard windows the sidecars
are aligned with).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.distill.gumbel import sparse_soft_cross_entropy, target_weights
from torchtitan_ext.distill.sidecar import SidecarError, SidecarSet
from torchtitan_ext.errors import ConfigError


def sidecar_factory(cfg: JobConfig) -> Callable[[object], SidecarSet] | None:
    """The ``sidecars`` argument of ``data.registry.build_loaders``: None without ``distill.path``; else a
    function the plain shard stream calls with itself to open the sidecars aligned with its windows (other
    loaders never call it, and ``Distillation`` then refuses them)."""
    if not cfg.distill.path:
        return None
    if cfg.training.fused_linear_ce:
        raise ConfigError("distill.path: not supported with training.fused_linear_ce (the soft loss needs the "
                          "logits, which the fused head never materialises)")
    path = cfg.distill.path

    def open_sidecars(loader) -> SidecarSet:
        try:
            return SidecarSet(path, loader.shards, loader.tokens, loader.seq_len)
        except SidecarError as e:
            raise ConfigError(f"distill.path: {e}") from None
    return open_sidecars


class Distillation:
    """``loss = (1 - alpha) * hard CE + alpha * soft CE`` against the sidecars' Gumbel top-k targets."""

    def __init__(self, cfg: JobConfig, loader, vocab_size: int, micro_batches: int = 1):
        """``loader``: the training loader built with ``sidecars=sidecar_factory(cfg)``; ``micro_batches``: soft
        losses computed per ``set_batch`` (the pipeline's micro-batches, else 1); ``sidecar_factory`` has already
        refused ``training.fused_linear_ce``."""
        d = cfg.distill
        side = getattr(loader, "sidecars", None)
        if side is None:
            raise ConfigError("distill.path: needs a plain shard stream (no data.domains, data.packing = 'concat'): "
                              "the sidecars line up with the shards' fixed windows")
        if side.vocab > vocab_size:
            raise ConfigError(f"distill.path: teacher vocabulary {side.vocab} > the student's {vocab_size}")
        if d.k > side.k:
            raise ConfigError(f"distill.k = {d.k} exceeds the sidecars' k = {side.k}")
        self.k, self.alpha, self.normalize = d.k or side.k, d.alpha, d.normalize
        self.teacher: tuple[torch.Tensor, torch.Tensor] | None = None
        self._soft: list[torch.Tensor] = []
        self._micro_batches, self._batch_start = micro_batches, 0

    def set_batch(self, teacher: tuple[torch.Tensor, ...], device: torch.device) -> None:
        """The current micro-batch's (tokens, weights) on ``device``; weights computed in float64."""
        self._keep_batch_losses()
        self._batch_start = len(self._soft)
        tokens, log_probs, thresholds = teacher
        weights = target_weights(log_probs, thresholds, self.k, self.normalize).float()
        self.teacher = tokens[..., :self.k].to(device), weights.to(device)

    def pack(self, labels: torch.Tensor) -> torch.Tensor:
        """(batch, seq, 1 + 2k) float64: labels, kept tokens, weights of the current micro-batch (pipelining)."""
        tokens, weights = self.teacher
        return torch.cat([labels[..., None].double(), tokens.double(), weights.double()], dim=-1)

    def unpack(self, target: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(labels, (tokens, weights)) from ``pack``'s tensor; plain labels (evaluation) give (labels, None)."""
        if target.ndim == 2:
            return target, None
        return target[..., 0].long(), (target[..., 1:1 + self.k].long(), target[..., 1 + self.k:].float())

    def mix(self, hard: torch.Tensor, logits: torch.Tensor,
            teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``(1 - alpha) * hard + alpha * soft`` against ``teacher`` (default: the batch of ``set_batch``)."""
        tokens, weights = self.teacher if teacher is None else teacher
        if isinstance(hard, DTensor):  # loss parallel: a replicated loss; its local value has the same gradient
            hard = hard.to_local()
        soft = sparse_soft_cross_entropy(logits, tokens, weights)
        self._soft.append(soft.detach())
        return (1 - self.alpha) * hard + self.alpha * soft

    def _keep_batch_losses(self) -> None:
        """Keep the current batch's newest ``micro_batches`` soft losses: on their first step torch's (>= 2.13)
        pipeline schedules call the loss once more, on uninitialised activations, to infer gradient shapes."""
        del self._soft[self._batch_start:len(self._soft) - self._micro_batches]

    def metrics(self) -> dict[str, float]:
        """Mean soft cross-entropy to the teacher since the last call (this rank's micro-batches): with
        normalised targets, the KL to the teacher's top-k plus its entropy, logged even when alpha = 0."""
        self._keep_batch_losses()
        self._batch_start = 0
        if not self._soft:
            return {}
        value = torch.stack(self._soft).mean()
        self._soft = []
        return {"distill/soft_ce": value.item()}
