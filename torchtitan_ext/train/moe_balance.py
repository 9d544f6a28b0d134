"""Expert load across data-parallel ranks: the auxiliary-loss-free bias update and the load metrics."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.parallel.compile import clean_fqn


def mode_layers(parts: list[nn.Module]) -> list[tuple[str, MoDE]]:
    return [(clean_fqn(name).removesuffix(".feed_forward"), m) for part in parts
            for name, m in part.named_modules() if isinstance(m, MoDE)]


def set_token_domains(parts: list[nn.Module], domains: torch.Tensor | None) -> None:
    for _, layer in mode_layers(parts):
        layer.token_domains = domains


@torch.no_grad()
def balance_experts(parts: list[nn.Module], group: dist.ProcessGroup | None, report: bool) -> dict[str, float]:
    """Sum each MoDE layer's routed load over the data-parallel ``group``, step the routing bias of layers
    that use auxiliary-loss-free balancing, and (when ``report``) return the metrics:
    ``moe/<layer>/imbalance`` (max / mean tokens per expert), the aux and z losses (the layers' mean, averaged
    over ``group``), and per-domain expert usage. Loads are reset; without bias updates they accumulate until
    the next report. All layers' counters travel in one all-reduce (three when reporting: the per-domain loads
    and the balancing losses), not one per layer."""
    metrics: dict[str, float] = {}
    layers = [(name, layer) for name, layer in mode_layers(parts) if report or layer.bias_update_rate > 0]
    if not layers:
        return metrics
    loads = torch.stack([layer.load for _, layer in layers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    for (_, layer), load in zip(layers, loads, strict=True):
        if layer.bias_update_rate > 0:
            layer.update_bias(load)
        layer.load.zero_()
    if not report:
        return metrics
    domain_loads = torch.stack([layer.domain_load for _, layer in layers]).double()  # (layers, domains, experts)
    if group is not None:
        dist.all_reduce(domain_loads, group=group)
    with_losses = [layer for _, layer in layers if layer.last_aux_loss is not None]
    losses = torch.stack([torch.stack([layer.last_aux_loss for layer in with_losses]),
                          torch.stack([layer.last_z_loss for layer in with_losses])]).double() \
        if with_losses else loads.new_zeros(2, 0).double()
    if with_losses and group is not None:
        # Each rank's losses are its share of its sequences' (``MoDE.balancing_loss``): their mean over the
        # group is the whole sequences' (averaged over the data-parallel ranks' batches).
        dist.all_reduce(losses, group=group)
        losses /= dist.get_world_size(group)
    for _, layer in layers:
        layer.domain_load.zero_()
    loads = loads.double()
    domain_tokens = domain_loads.sum(dim=-1)  # (layers, domains)
    top_share, top_expert = (domain_loads / domain_tokens.clamp(min=1).unsqueeze(-1)).max(dim=-1)
    figures = [loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1),
               loads.min(dim=1).values / loads.sum(dim=1).clamp(min=1),
               domain_tokens, top_share, top_expert.double(), losses.mean(dim=1)]
    # Everything in one device-to-host transfer: a read per value would wait on the device each time.
    host = torch.cat([f.flatten() for f in figures]).cpu().split([f.numel() for f in figures])
    imbalance, min_share, tokens, share, expert, mean_losses = (
        h.view_as(f).tolist() for h, f in zip(host, figures, strict=True))
    for i, (name, _) in enumerate(layers):
        metrics[f"moe/{name}/imbalance"], metrics[f"moe/{name}/min_share"] = imbalance[i], min_share[i]
        for dom, count in enumerate(tokens[i]):
            if count > 0:
                metrics[f"moe/{name}/domain{dom}_top_expert_share"] = share[i][dom]
                metrics[f"moe/{name}/domain{dom}_top_expert"] = expert[i][dom]
    if with_losses:
        metrics["moe/aux_loss"], metrics["moe/router_z_loss"] = mean_losses
    return metrics
