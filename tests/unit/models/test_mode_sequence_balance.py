"""MoDE's balancing loss over whole sequences when ranks route parts of them (context / sequence parallel):
the ranks' shares, summed over 2 gloo processes by ``parallel/sequence_balance.py``, give one process's loss
and router-logit gradients in float64."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import run_distributed

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.parallel.sequence_balance import apply_sequence_balancing

N_EXPERTS, TOKENS = 8, 64


def _layer() -> MoDE:
    return MoDE(ModelArgs(vocab_size=8, dim=16, n_heads=2, n_experts=N_EXPERTS, top_k=2, moe_hidden=8,
                          aux_loss_coef=0.1, router_z_loss_coef=0.01))


def _counts(logits: torch.Tensor) -> torch.Tensor:
    return torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=N_EXPERTS)


def _router_logits() -> torch.Tensor:
    """Float64 router logits whose two halves prefer different experts (the first half experts 0 and 1, the
    second 4 and 5): a per-half Switch loss then differs from the whole's."""
    logits = torch.randn(TOKENS, N_EXPERTS, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[: TOKENS // 2, :2] += 1.5
    logits[TOKENS // 2:, 4:6] += 1.5
    return logits


def _loss_and_grad(layer: MoDE, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits.clone().requires_grad_()
    loss = layer.balancing_loss(logits, _counts(logits))
    loss.backward()
    return loss.detach(), logits.grad, torch.stack([layer.last_aux_loss, layer.last_z_loss])


def _rank_share(rank: int, world_size: int, logits: torch.Tensor):
    layer = _layer()
    apply_sequence_balancing(layer, [dist.group.WORLD])
    return _loss_and_grad(layer, logits.chunk(world_size)[rank])


def test_ranks_shares_of_the_sequence_are_its_balancing_loss():
    logits = _router_logits()
    whole, whole_grad, whole_terms = _loss_and_grad(_layer(), logits)
    local = [_loss_and_grad(_layer(), half)[0] for half in logits.chunk(2)]
    assert abs(sum(local) / 2 - whole) > 1e-3 * whole  # the halves' own Switch losses miss the whole's
    shares = run_distributed(_rank_share, 2, logits)
    # The trainer averages the CP ranks' gradients: the mean of the shares is the loss being differentiated.
    torch.testing.assert_close(sum(s[0] for s in shares) / 2, whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.cat([s[1] for s in shares]) / 2, whole_grad, rtol=1e-10, atol=1e-15)
    # The metrics (the Switch and z terms): their mean over the ranks is the whole sequence's.
    torch.testing.assert_close(sum(s[2] for s in shares) / 2, whole_terms, rtol=1e-12, atol=0)
