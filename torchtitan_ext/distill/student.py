"""The student side of distillation in the trainer: sidecars attached to the loader, and the mixed loss."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.config.loader import ConfigError
from torchtitan_ext.distill.gumbel import sparse_soft_cross_entropy, target_weights
from torchtitan_ext.distill.sidecar import SidecarError, SidecarSet


class Distillation:
    """``loss = (1 - alpha) * hard CE + alpha * soft CE`` against the sidecars' Gumbel top-k targets."""

    def __init__(self, cfg: JobConfig, loader, vocab_size: int, pipelined: bool):
        d = cfg.distill
        from torchtitan_ext.data.loader import TokenDataLoader
        if pipelined or cfg.training.fused_linear_ce:
            raise ConfigError("distill.path: not supported with pipeline parallelism or training.fused_linear_ce")
        if type(loader) is not TokenDataLoader:
            raise ConfigError("distill.path: needs a plain shard stream (no data.domains, data.packing = 'concat')")
        try:
            loader.sidecars = SidecarSet(d.path, loader.shards, loader.tokens, loader.seq_len)
        except SidecarError as e:
            raise ConfigError(f"distill.path: {e}") from None
        side = loader.sidecars
        if side.vocab > vocab_size:
            raise ConfigError(f"distill.path: teacher vocabulary {side.vocab} > the student's {vocab_size}")
        if d.k > side.k:
            raise ConfigError(f"distill.k = {d.k} exceeds the sidecars' k = {side.k}")
        self.k, self.alpha, self.normalize = d.k or side.k, d.alpha, d.normalize
        self.teacher: tuple[torch.Tensor, torch.Tensor] | None = None
        self._soft: list[torch.Tensor] = []

    def set_batch(self, teacher: tuple[torch.Tensor, ...], device: torch.device) -> None:
        """The current micro-batch's (tokens, weights) on ``device``; weights computed in float64."""
        tokens, log_probs, thresholds = teacher
        weights = target_weights(log_probs, thresholds, self.k, self.normalize).float()
        self.teacher = tokens[..., :self.k].to(device), weights.to(device)

    def mix(self, hard: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tokens, weights = self.teacher
        if isinstance(hard, DTensor):  # loss parallel: a replicated loss; its local value has the same gradient
            hard = hard.to_local()
        soft = sparse_soft_cross_entropy(logits, tokens, weights)
        self._soft.append(soft.detach())
        return (1 - self.alpha) * hard + self.alpha * soft

    def metrics(self) -> dict[str, float]:
        """Mean soft cross-entropy to the teacher since the last call (this rank's micro-batches): with
        normalised targets, the KL to the teacher's top-k plus its entropy, logged even when alpha = 0."""
        if not self._soft:
            return {}
        value = torch.stack(self._soft).mean()
        self._soft = []
        return {"distill/soft_ce": value.item()}
