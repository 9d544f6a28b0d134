"""The model converters: QAT, INT8-forward and float8 module swaps on the meta model, which the builder runs
before ``parallelize`` (TP and FSDP then shard the swapped modules' weights)."""

from __future__ import annotations

import torch.nn as nn

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.quant.float8 import convert_to_float8
from torchtitan_ext.quant.float8_config import check_float8_config
from torchtitan_ext.quant.float8_experts import check_float8_experts, convert_experts_to_float8
from torchtitan_ext.quant.int8 import apply_int8_forward
from torchtitan_ext.quant.qat import apply_qat


def convert_model(model: nn.Module, cfg: JobConfig) -> list[str]:
    """Apply every configured converter; returns log lines. Unsupported combinations raise ConfigError."""
    check_float8_config(cfg.float8, cfg.training.fused_linear_ce, cfg.parallelism.tp)
    check_float8_experts(cfg.float8, model.args)
    q, lines = cfg.quant, []
    if (q.qat != "none" or q.int8_forward) and cfg.float8.enabled:
        raise ConfigError("quant.qat / quant.int8_forward and float8.enabled are exclusive: pick one")
    if q.int8_forward:
        lines.append(f"quant: {apply_int8_forward(model)} block linears run their forward in int8")
    if q.qat != "none":
        if model.args.activation != "relu2":
            raise ConfigError("quant.qat needs squared-ReLU FFNs: set model.activation = 'relu2'")
        n = apply_qat(model, q.clamp, q.clamp_factor)
        how = f"dynamic, factor {q.clamp_factor}" if q.clamp == "dynamic" else "static [-4, 4]"
        lines.append(f"quant: QAT int8 on {n} FFNs (middle clamp {how})")
    if cfg.float8.enabled:
        convert_to_float8(model, cfg.float8, emulate=cfg.float8.emulate, log=lines.append)
    if cfg.float8.experts:
        swapped = convert_experts_to_float8(model, emulate=cfg.float8.emulate)
        lines.append(f"float8 experts: {len(swapped)} MoDE expert groups run float8 rowwise grouped GEMMs (token "
                     f"groups padded to 16 rows){' emulated' * cfg.float8.emulate}" if swapped else
                     "float8.experts = true: the model has no MoDE layers, nothing to convert")
        if swapped and cfg.training.compile:
            lines.append("float8 experts, compiled: the expert GEMMs run eagerly between the compiled graphs "
                         "(inside a graph they gave non-finite gradients)")
    return lines
