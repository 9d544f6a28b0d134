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
    domain_loads = torch.stack([layer.domain_load for _, layer in layers])
    if group is not None:
        dist.all_reduce(domain_loads, group=group)
    aux, z = [], []
    for (name, layer), load, domain_load in zip(layers, loads.double(), domain_loads, strict=True):
        metrics[f"moe/{name}/imbalance"] = (load.max() / load.mean().clamp(min=1)).item()
        metrics[f"moe/{name}/min_share"] = (load.min() / load.sum().clamp(min=1)).item()
        if layer.last_aux_loss is not None:
            aux.append(layer.last_aux_loss)
            z.append(layer.last_z_loss)
        layer.domain_load.zero_()
        for d in torch.nonzero(domain_load.sum(dim=1)).flatten().tolist():
            share = domain_load[d].double() / domain_load[d].sum()
            metrics[f"moe/{name}/domain{d}_top_expert_share"] = share.max().item()
            metrics[f"moe/{name}/domain{d}_top_expert"] = float(share.argmax())
    if aux:
        # Each rank's losses are its share of its sequences' (``MoDE.balancing_loss``): their mean over the
        # group is the whole sequences' (averaged over the data-parallel ranks' batches).
        losses = torch.stack([torch.stack(aux), torch.stack(z)]).double()
        if group is not None:
            dist.all_reduce(losses, group=group)
            losses /= dist.get_world_size(group)
        metrics["moe/aux_loss"], metrics["moe/router_z_loss"] = losses.mean(dim=1).tolist()
    return metrics
