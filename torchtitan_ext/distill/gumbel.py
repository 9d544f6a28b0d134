"""Gumbel top-k subsampling of a teacher's distribution, and the unbiased sparse soft targets it gives.

Sampling: perturb the teacher's log-probabilities with Gumbel noise ``g = -log(E)``, ``E ~ Exponential(1)``,
and keep the k+1 largest noisy values. The first k tokens are kept with their clean log-probabilities; the
thresholds are the noisy values ranked 2..k+1 (``thresholds[i]`` is the (i+2)-th largest noisy value).

Soft targets from the first k' <= k kept tokens: with ``tau = thresholds[k'-1]`` (the (k'+1)-th noisy value),
a kept token's inclusion probability given the others is ``Q(v) = 1 - exp(-exp(log p_v - tau))`` and its
target ``T(v) = p_v / Q(v)``; every other token gets 0. Unnormalised, ``E[T(v)] = p_v`` for every v, so the
sparse soft cross-entropy is an unbiased estimate of the dense one. ``Q`` is computed in float64 as
``log1p(-exp(-exp(log p_v - tau)))``, which stays accurate when ``Q`` is tiny or close to 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def sample_topk(log_probs: torch.Tensor, k: int, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens int64, clean log-probs float32, thresholds float32), each (..., k), from log-probs (..., V)."""
    if not 1 <= k < log_probs.shape[-1]:
        raise ValueError(f"k = {k}: expected between 1 and vocabulary - 1 = {log_probs.shape[-1] - 1}")
    lp = log_probs.float()
    e = torch.empty_like(lp).exponential_(generator=generator)
    noisy = lp - e.log()
    top_vals, top_idx = noisy.topk(k + 1, dim=-1)
    tokens = top_idx[..., :k]
    return tokens, lp.gather(-1, tokens), top_vals[..., 1:]


def target_weights(log_probs: torch.Tensor, thresholds: torch.Tensor, k: int | None = None,
                   normalize: bool = True) -> torch.Tensor:
    """float64 (..., k') targets ``T`` of the first k' = k (default: all) kept tokens."""
    k = log_probs.shape[-1] if k is None else k
    if not 1 <= k <= log_probs.shape[-1]:
        raise ValueError(f"k = {k}: expected between 1 and the sidecar's k = {log_probs.shape[-1]}")
    lp = log_probs[..., :k].double()
    tau = thresholds[..., k - 1:k].double()
    log_q = torch.log1p(-torch.exp(-torch.exp(lp - tau)))
    t = torch.exp(lp - log_q)
    return t / t.sum(-1, keepdim=True) if normalize else t


def soft_targets(tokens: torch.Tensor, log_probs: torch.Tensor, thresholds: torch.Tensor, k: int,
                 vocab_size: int, normalize: bool = True, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense (..., vocab_size) targets from the first k kept tokens (tests and small vocabularies)."""
    t = target_weights(log_probs, thresholds, k, normalize)
    out = torch.zeros(*tokens.shape[:-1], vocab_size, dtype=torch.float64, device=tokens.device)
    return out.scatter_(-1, tokens[..., :k].long(), t).to(dtype)


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) of per-shard partials whose result, and so its gradient, is the same on every rank:
    the backward passes the gradient through unchanged (an all-reduced backward would count it tp times)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64: the tests' references)."""
    return x if x.dtype == torch.float64 else x.float()


def _vocab_sharded(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and any(
        isinstance(p, Shard) and p.dim % logits.ndim == logits.ndim - 1 for p in logits.placements)


def sparse_soft_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``-sum_i weights_i * log_softmax(logits)[tokens_i]``, without a dense target.

    ``logits`` (..., V) may be a DTensor sharded over the vocabulary (TP's loss-parallel logits, 1-D mesh):
    each rank takes its slice's logsumexp and the gathered logits of the tokens it owns, and two all-reduces
    combine them. ``tokens`` may hold more kept tokens than ``weights`` (k' < k): the first k' are used.
    Computed in float32 (float64 inputs stay float64).
    """
    tokens = tokens[..., :weights.shape[-1]]
    if not _vocab_sharded(logits):
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logp = torch.log_softmax(_upcast(logits), dim=-1)
        return -(weights.to(logp.dtype) * logp.gather(-1, tokens.long())).sum(-1).mean()
    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise ValueError("sparse_soft_cross_entropy: vocabulary-sharded logits need a 1-D mesh")
    group, rank, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    local = _upcast(logits.to_local())
    vocab = logits.shape[-1]
    per = -(-vocab // world)  # torch's Shard: ceil-sized chunks, the last may be shorter
    lo = rank * per
    m = local.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = _SumOverShards.apply((local - m).exp().sum(-1, keepdim=True), group)
    lse = sum_exp.log() + m
    idx = tokens.long() - lo
    mine = (idx >= 0) & (idx < local.shape[-1])
    picked = local.gather(-1, idx.clamp(0, max(local.shape[-1] - 1, 0))) * mine
    picked = _SumOverShards.apply(picked, group)
    return (weights.to(local.dtype) * (lse - picked)).sum(-1).mean()


def dense_soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reference: mean over positions of ``-sum_v targets_v * log_softmax(logits)_v`` (tests)."""
    return -(targets * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
