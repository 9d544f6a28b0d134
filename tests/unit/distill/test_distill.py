"""Gumbel top-k distillation in one process: sampling and soft targets by hand, unbiasedness by Monte Carlo, the
sparse loss against the dense soft cross-entropy in float64 (one process and TP2 on gloo)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_distributed

from torchtitan_ext.distill.gumbel import (
    dense_soft_cross_entropy,
    sample_topk,
    soft_targets,
    sparse_soft_cross_entropy,
    target_weights,
)


def test_sample_topk_by_hand():
    lp = torch.log_softmax(torch.tensor([[2.0, 0.5, -1.0, 1.0, 0.0]]), -1)
    gen = torch.Generator().manual_seed(7)
    tokens, kept, thr = sample_topk(lp, 2, generator=gen)
    e = torch.empty_like(lp).exponential_(generator=torch.Generator().manual_seed(7))
    noisy = (lp - e.log())[0].tolist()
    order = sorted(range(5), key=lambda v: -noisy[v])
    assert tokens[0].tolist() == order[:2]
    assert kept[0].tolist() == pytest.approx([lp[0, v].item() for v in order[:2]])
    assert thr[0].tolist() == pytest.approx([noisy[order[1]], noisy[order[2]]])  # ranks 2 and 3
    with pytest.raises(ValueError):
        sample_topk(lp, 5)


def test_soft_targets_by_hand():
    tokens = torch.tensor([[3, 1]])
    lp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    thr = torch.tensor([[-0.3, 0.4]])
    # k' = 1: tau = thresholds[0]
    q = 1 - math.exp(-math.exp(math.log(0.5) + 0.3))
    dense = soft_targets(tokens, lp, thr, 1, 5, normalize=False, dtype=torch.float64)
    assert dense[0].tolist() == pytest.approx([0, 0, 0, 0.5 / q, 0])
    assert soft_targets(tokens, lp, thr, 1, 5, dtype=torch.float64)[0].tolist() == pytest.approx([0, 0, 0, 1, 0])
    # k' = 2: tau = thresholds[1]
    q3, q1 = (1 - math.exp(-math.exp(math.log(p) - 0.4)) for p in (0.5, 0.2))
    t = soft_targets(tokens, lp, thr, 2, 5, normalize=False, dtype=torch.float64)[0]
    assert t.tolist() == pytest.approx([0, 0.2 / q1, 0, 0.5 / q3, 0])
    n = soft_targets(tokens, lp, thr, 2, 5, dtype=torch.float64)[0]
    assert n.sum().item() == pytest.approx(1.0)
    assert n[3].item() / n[1].item() == pytest.approx((0.5 / q3) / (0.2 / q1))


@pytest.mark.parametrize("k", [1, 3])
def test_unnormalised_targets_average_to_teacher(k):
    torch.manual_seed(0)
    p = torch.softmax(torch.tensor([1.5, 0.3, -0.5, 0.9, -2.0, 0.0, -1.0, 0.2], dtype=torch.float64), -1)
    n = 200_000
    lp = p.log().expand(n, -1).contiguous()
    tokens, kept, thr = sample_topk(lp, k, generator=torch.Generator().manual_seed(1))
    mean = soft_targets(tokens, kept, thr, k, 8, normalize=False, dtype=torch.float64).mean(0)
    # standard error of a mean of T(v) <= sqrt(p / Q_min) / sqrt(n); 0.01 absolute is > 4 sigma here
    assert torch.allclose(mean, p, atol=0.01), (mean, p)
    # a biased estimator (clean probabilities, no 1/Q correction) is visibly off for the kept-rarely tokens
    naive = torch.zeros(n, 8, dtype=torch.float64).scatter_(-1, tokens, kept.double().exp()).mean(0)
    assert (naive - p).abs().max() > 0.05


def _case(seed: int = 0, vocab: int = 12, k: int = 4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, vocab, dtype=torch.float64, generator=g)
    teacher = torch.log_softmax(torch.randn(3, 5, vocab, dtype=torch.float64, generator=g) * 2, -1)
    tokens, kept, thr = sample_topk(teacher, k, generator=g)
    return logits, tokens, kept, thr


@pytest.mark.parametrize("normalize", [True, False])
def test_sparse_equals_dense_float64(normalize):
    logits, tokens, kept, thr = _case()
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    sparse = sparse_soft_cross_entropy(a, tokens, target_weights(kept, thr, 3, normalize))
    dense = dense_soft_cross_entropy(b, soft_targets(tokens, kept, thr, 3, 12, normalize, torch.float64))
    sparse.backward()
    dense.backward()
    assert sparse.dtype == torch.float64
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def _tp2_sparse(rank: int, world: int) -> tuple[float, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    logits, tokens, kept, thr = _case(vocab=13)  # uneven shards: 7 + 6
    local = logits[..., rank * 7:(rank + 1) * 7].clone().requires_grad_()
    sharded = DTensor.from_local(local, mesh, [Shard(-1)], shape=logits.shape, stride=logits.stride())
    loss = sparse_soft_cross_entropy(sharded, tokens, target_weights(kept, thr))
    loss.backward()
    return loss.item(), local.grad


def test_sparse_equals_dense_under_tp2():
    logits, tokens, kept, thr = _case(vocab=13)
    ref = logits.clone().requires_grad_()
    dense = dense_soft_cross_entropy(ref, soft_targets(tokens, kept, thr, 4, 13, True, torch.float64))
    dense.backward()
    for rank, (loss, grad) in enumerate(run_distributed(_tp2_sparse, 2)):
        assert loss == pytest.approx(dense.item(), rel=1e-12)
        torch.testing.assert_close(grad, ref.grad[..., rank * 7:(rank + 1) * 7], rtol=1e-10, atol=1e-12)
