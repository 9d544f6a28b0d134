"""The trainer's side of visibility masks, attention / output Z-regularisation and KV sharing: checks the
options against the layout (one line each), feeds the model its (start, limit) and positions, sets the
regularisers' coefficients and scale, and collects the per-layer attention LSE metric."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_ext.data.documents import Documents
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.decoder import Attention, Decoder
from torchtitan_ext.ops.zreg import output_z_term
from torchtitan_ext.parallel.pp import layer_ranges


def check_kv_share_split(n_layers: int, n_stages: int, split_points: list[str], group: int) -> None:
    """Every pipeline stage must start a KV-sharing group: a consumer never sits in another stage than its
    producer. Every rank checks every stage, so all refuse together."""
    for stage in layer_ranges(n_layers, n_stages, split_points):
        if stage.start % group:
            raise ConfigError(f"model.kv_share = 'interleaved' (groups of {group}): a pipeline stage starts at "
                              f"layer {stage.start}, separating it from the layer that computes its K/V; choose "
                              f"parallelism.pp_split_points at multiples of {group}")


def pipeline_mask_args(inputs: torch.Tensor, model_kwargs: dict) -> tuple[torch.Tensor, ...]:
    """What the first pipeline stage takes after the tokens (``parallel.pp.ArgCarrier``): (start, limit,
    positions) with a visibility mask, else (positions,) (context parallelism); positions 0, 1, ... when the
    batch has none (the same RoPE values as the tables)."""
    positions = model_kwargs.get("positions")
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    if "visibility" not in model_kwargs:
        return (positions.contiguous(),)
    start, limit = model_kwargs["visibility"]
    return start, limit, positions.contiguous()


class AttentionFeatures:
    def __init__(self, cfg, dims, parts: list[nn.Module], n_layers: int, documents: Documents | None):
        """``documents``: the data layer's helper for data.attention = "document" (``DataBundle.documents``,
        already given to the loaders); batches without visibility get theirs from it."""
        t, d = cfg.training, cfg.data
        self.output_z_reg = t.output_z_reg
        if d.position_reset and d.attention == "causal":
            raise ConfigError("data.position_reset = true needs data.attention = 'document' or 'tree'")
        if t.output_z_reg > 0 and t.fused_linear_ce:
            raise ConfigError("training.output_z_reg needs the logits; it does not combine with "
                              "training.fused_linear_ce yet")
        args = next((m.args for part in parts for m in part.modules() if isinstance(m, Decoder)), None)
        if args is not None and args.kv_share != "none" and dims.pp > 1:  # the resolved model, not the keys
            p = cfg.parallelism
            check_kv_share_split(n_layers, dims.pp * p.pp_virtual_stages, p.pp_split_points, args.kv_share_group)
        self.documents = documents if d.attention == "document" else None
        self.attentions = {f"{name}": m for part in parts for name, m in part.named_modules()
                           if isinstance(m, Attention)}
        self.decoders = [m for part in parts for m in part.modules() if isinstance(m, Decoder)]
        self.cp_group = dims.submesh("cp").get_group() if dims.cp > 1 else None  # ranks with parts of one sequence
        self.record_lse(False)

    def model_kwargs(self, batch, device: torch.device) -> dict:
        """``visibility`` / ``positions`` for ``Decoder.forward``."""
        vis, pos = batch.visibility, batch.positions
        if self.documents is None and vis is None:
            return {}
        if vis is None:  # a loader that packs whole documents: every window starts with a document
            vis, pos = self.documents.batch(batch.inputs)
        out = {"visibility": (vis[0].to(device), vis[1].to(device))}
        if pos is not None:
            out["positions"] = pos.to(device)
        return out

    def output_term(self, logits: torch.Tensor) -> torch.Tensor | float:
        """Zero in value; its gradient is output Z-reg's."""
        return output_z_term(logits, self.output_z_reg) if self.output_z_reg > 0 else 0.0

    def record_lse(self, on: bool) -> None:
        """Record each layer's mean LSE in the coming step (a log step)."""
        for m in self.decoders:
            m.record_attention_lse(on)

    def metrics(self) -> dict[str, float]:
        """``attn/lse/<layer>``: the mean log-sum-exp of the attention logits, from the last micro-batch (under
        context parallelism averaged over the CP ranks, which hold equal parts of its sequences)."""
        recorded = {f"attn/lse/{name.split('layers.')[-1].split('.')[0]}": m.lse_mean
                    for name, m in self.attentions.items() if m.lse_mean is not None}
        if self.cp_group is not None and recorded:
            means = torch.stack(list(recorded.values()))
            dist.all_reduce(means, op=dist.ReduceOp.AVG, group=self.cp_group)
            recorded = dict(zip(recorded, means.unbind(), strict=True))
        self.record_lse(False)
        return {key: float(value) for key, value in recorded.items()}
