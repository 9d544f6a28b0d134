"""Expert parallelism's dispatch (``parallel/ep.py``) on 2 and 4 gloo processes: two MoDE layers, their experts
sharded over the ranks, give each rank's output and input / router gradients, and the experts' summed
gradients, of the same layers run in one process (float64), with experts nobody routes to and a rank that
receives no rows; with a shared expert (run while the rows travel); under activation checkpointing. Each
layer's forward reads the device once, the backward and the recomputation not at all."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.parallel.ep import apply_ep, recompute_contexts

N_EXPERTS, DIM = 8, 12
SHAPE = (2, 5, DIM)  # each rank's (batch, seq, dim)


def _layers(shared: bool) -> nn.Module:
    """Two MoDE layers in a ``layers`` dict (what ``apply_ep`` walks), identical in every process. Experts 6
    and 7 are never selected (their balancing bias), so at EP 4 rank 3 receives no rows."""
    args = ModelArgs(vocab_size=8, dim=DIM, n_heads=2, n_experts=N_EXPERTS, top_k=2, moe_hidden=10,
                     shared_expert=shared, bias_update_rate=0.01, aux_loss_coef=0.01, router_z_loss_coef=0.001)
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleDict()
    for i in range(2):
        block = nn.Module()
        block.feed_forward = MoDE(args).double()
        for p in block.feed_forward.parameters():
            nn.init.normal_(p, std=0.3)
        block.feed_forward.expert_bias[6:] = -10.0
        model.layers[str(i)] = block
    return model


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    return x, torch.randn(SHAPE, generator=gen, dtype=torch.float64)  # input, loss weights


def _forward(model: nn.Module, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    h = x
    for block in model.layers.values():
        layer = block.feed_forward
        h = checkpoint(layer, h, use_reentrant=False, context_fn=recompute_contexts) if checkpointed else layer(h)
    return h


VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (shared expert, checkpointed)


def _ep_worker(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    reads = {"forward": 0, "backward": 0}
    phase = ["forward"]
    plain_tolist = torch.Tensor.tolist

    def counted_tolist(self):  # host reads made by the EP dispatch
        if sys._getframe(1).f_code.co_filename.endswith("ep.py"):
            reads[phase[0]] += 1
        return plain_tolist(self)

    results = {}
    torch.Tensor.tolist = counted_tolist
    try:
        for shared, checkpointed in VARIANTS:
            model = _layers(shared)
            apply_ep(model, mesh, data_parallel_share=1)  # expert gradients: sums over the ranks' tokens
            reads.update(forward=0, backward=0)
            x, w = _data(rank)
            x.requires_grad_(True)
            phase[0] = "forward"
            out = _forward(model, x, checkpointed)
            phase[0] = "backward"
            (out * w).sum().backward()
            grads = {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                     for name, p in model.named_parameters()}
            results[shared, checkpointed] = {"out": out.detach(), "x_grad": x.grad, "grads": grads,
                                             "reads": dict(reads)}
    finally:
        torch.Tensor.tolist = plain_tolist
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layers_equal_one_process(world):
    """Every variant (shared expert or not, checkpointed or not) in one process group per world size."""
    got = run_distributed(_ep_worker, world)
    for shared, checkpointed in VARIANTS:
        _check(world, shared, [g[shared, checkpointed] for g in got])


def _check(world: int, shared: bool, got: list[dict]) -> None:
    ref_model = _layers(shared)
    refs = []
    for rank in range(world):  # each rank's tokens through the unsharded layers alone
        ref_model.zero_grad()
        x, w = _data(rank)
        x.requires_grad_(True)
        out = _forward(ref_model, x, checkpointed=False)
        (out * w).sum().backward()
        refs.append({"out": out.detach(), "x_grad": x.grad,
                     "grads": {n: p.grad.clone() for n, p in ref_model.named_parameters()}})
    n_local = N_EXPERTS // world
    for rank, g in enumerate(got):
        ref = refs[rank]
        torch.testing.assert_close(g["out"], ref["out"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g["x_grad"], ref["x_grad"], rtol=1e-10, atol=1e-12)
        for name, grad in ref["grads"].items():
            if ".experts." in name:  # this rank's experts: the gradient summed over every rank's tokens
                grad = sum(r["grads"][name] for r in refs)[rank * n_local:(rank + 1) * n_local]
            torch.testing.assert_close(g["grads"][name], grad, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {name}")
        # One host read per layer's forward (2 layers); none in the backward, recomputation included.
        assert g["reads"] == {"forward": 2, "backward": 0}, g["reads"]
    # The routing made the cases this test is for: experts 6 and 7 get no tokens (at EP 4: rank 3 no rows).
    for name in ("layers.0.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2"):
        summed = sum(r["grads"][name] for r in refs)
        assert torch.count_nonzero(summed[6:]) == 0 and torch.count_nonzero(summed[:6].flatten(1), dim=1).all()
