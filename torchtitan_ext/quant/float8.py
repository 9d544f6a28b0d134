"""FP8 training of the dense linears through ``torchao.float8``, applied to the meta-device model before TP,
activation checkpointing, compile and FSDP (so those wrap ``Float8Linear`` modules, as torchao expects).

Recipes (``[float8] recipe``): ``tensorwise`` (one dynamic scale per tensor, cuBLAS FP8 GEMMs; the fastest,
and the only one whose weights FSDP2 can all-gather in float8),
``rowwise`` (one scale per row, power-of-two scales, CUTLASS rowwise GEMMs; more accurate, slower) and
``rowwise_with_gw_hp`` (rowwise, with the weight gradient computed in bf16) and ``blockwise`` (DeepSeek-V3's
block scales: 1 x 128 activation and gradient blocks, 128 x 128 weight blocks, e4m3 throughout; swapped in
by ``quant/float8_blockwise.py`` over torchao's prototype kernels; Hopper only, no TP, in/out features
multiples of 512).

Which linears stay in bf16 (``float8_module_filter``): the FQNs listed in ``filter_fqns`` (the output head by
default: its logits feed the loss and it is a large share of the error; ``include_output`` converts it anyway,
and under TP each rank then casts its own vocabulary shard of the head, with the tensorwise scale a global
amax over the shards; compiled, the head is its own graph), MoDE routers (an FP8 rounding can flip a top-k
choice, and the GEMM is tiny), and any linear whose in/out features are below ``min_dim`` or not
divisible by 16 (``torch._scaled_mm`` needs multiples of 16; small GEMMs lose more to the casts than the FP8
GEMM saves); for ``blockwise``, not divisible by 512 (4 scale blocks: cuBLAS computes other contractions
wrong, ``quant/float8_blockwise.py``).

MoDE experts stay in bf16 unless ``float8.experts = true``: then ``quant/float8_experts.py`` swaps each
``GroupedExperts`` for ``Float8GroupedExperts`` (same parameters), whose grouped GEMMs run through torchao
0.17's prototype float8 rowwise grouped GEMM (``torch._scaled_grouped_mm``). That kernel needs every expert's
token group to be a multiple of 16 rows and torchao's own padding is not implemented in 0.17, so the module
pads MoDE's dropless groups itself, inside the experts (see that module).

torchao / torch pairing (torchao is an optional dependency: ``pip install -e '.[gpu]'``):
torchao 0.17.0 (the wheel carried in ``.whl/``) trains float8 with torch 2.11 on GPUs, and
imports, converts and runs emulated float8 with torch 2.13 (CPU, this project's tests); its ``__init__``
loads its compiled kernels only for torch >= 2.11 (the float8 training path itself is Python and Triton).
Older torchao releases were built against older torch (0.15.x against 2.9.1 / 2.10, per torchao's own
compatibility table), below this project's torch 2.11 floor. torch 2.14 with torchao 0.17: unknown, untested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.mode import GroupedExperts
from torchtitan_ext.quant.float8_blockwise import (
    BLOCK,
    CONTRACTION_MULTIPLE,
    BlockwiseFloat8Linear,
    convert_to_blockwise,
)
from torchtitan_ext.quant.float8_config import check_float8_config
from torchtitan_ext.quant.float8_experts import Float8GroupedExperts

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
_CAP = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
INSTALL_HINT = "pip install -e '.[gpu]' (or: pip install torchao)"


def _torchao_float8() -> ModuleType:
    """``torchao.float8``, or a one-line ConfigError with the install command."""
    try:
        return importlib.import_module("torchao.float8")
    except Exception as e:  # not installed, or built for another torch and failing at import
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ConfigError(f"float8.enabled = true needs torchao, which cannot be imported ({reason}); "
                          f"{INSTALL_HINT}") from None


def check_float8_supported(cfg: Float8Section, device: torch.device, fused_linear_ce: bool = False,
                           tp: int = 1) -> None:
    """Refuse, before any work starts, a float8 setup that cannot run here (``check_float8_config``, then the
    device and torchao); a no-op when FP8 is off. ``float8.emulate`` skips the device checks (every recipe and
    the float8 experts have an emulated path in plain torch) but still needs torchao."""
    check_float8_config(cfg, fused_linear_ce, tp)
    if not cfg.enabled:
        return
    if cfg.emulate:  # high-precision GEMMs of float8-rounded operands: plain torch on any device
        _torchao_float8()
        return
    if device.type != "cuda":
        raise ConfigError(f"float8.enabled = true needs a CUDA GPU of compute capability >= {_CAP} (H100, "
                          f"L40S, RTX 4090 ...); this job runs on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(f"float8.enabled = true needs compute capability >= {_CAP}; "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]} (no FP8 "
                          f"tensor cores)")
    _torchao_float8()
    if cfg.recipe == "blockwise":
        _check_blockwise(device)


def _check_blockwise(device: torch.device) -> None:
    """The block-scaled kernels: compute capability 9.0 (cuBLAS's block-scaled FP8 GEMMs and torchao's
    prototype are Hopper-only) and torchao's prototype importable (it needs Triton)."""
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < (9, 0):
        raise ConfigError(f"float8.recipe = 'blockwise' needs compute capability >= 9.0 (Hopper); "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    try:
        importlib.import_module("torchao.prototype.blockwise_fp8_training.linear")
    except Exception as e:
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ConfigError(f"float8.recipe = 'blockwise' needs torchao.prototype.blockwise_fp8_training, which "
                          f"cannot be imported ({reason})") from None


def _skip_reason(cfg: Float8Section, module: nn.Module, fqn: str) -> str | None:
    """Why the linear ``fqn`` stays in bf16, or None when it becomes a Float8Linear."""
    hit = next((f for f in cfg.filter_fqns if f in fqn), None)
    if hit is not None and not (cfg.include_output and fqn == "output"):
        return f"filter_fqns entry {hit!r}"
    if any(part.startswith("router") for part in fqn.split(".")):
        return "MoDE router"
    multiple = BLOCK if cfg.recipe == "blockwise" else 16  # scale blocks / torch._scaled_mm's alignment
    for name in ("in_features", "out_features"):
        size = getattr(module, name)
        if size < cfg.min_dim:
            return f"{name} {size} < min_dim {cfg.min_dim}"
        if size % multiple:
            return f"{name} {size} not divisible by {multiple}" + (" (blockwise)" if multiple == BLOCK else "")
        if multiple == BLOCK and size % CONTRACTION_MULTIPLE:
            return f"{name} {size} not divisible by {CONTRACTION_MULTIPLE} (blockwise)"
    return None


def float8_module_filter(cfg: Float8Section) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: True for the ``nn.Linear`` modules that become Float8Linear."""
    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and _skip_reason(cfg, module, fqn) is None
    return keep


def _linear_config(f8: ModuleType, cfg: Float8Section, emulate: bool) -> Float8LinearConfig:
    """The Float8LinearConfig of ``cfg.recipe``; ``emulate`` runs the FP8 GEMMs in high precision (tests)."""
    if cfg.recipe == "tensorwise":
        return f8.Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
                                     emulate=emulate)
    config = f8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert_to_float8(model: nn.Module, cfg: Float8Section, *, emulate: bool = False,
                      log: Callable[[str], None] | None = None) -> list[str]:
    """Swap the filter's linears for torchao ``Float8Linear`` (``BlockwiseFloat8Linear`` for the blockwise
    recipe) in place; returns their FQNs.

    Call it on the unsharded (meta-device) model before any other parallelism. Skipped linears and the
    MoDE experts (bf16, see the module docstring) are reported through ``log`` (default: this module's
    logger at INFO).
    """
    f8 = _torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    log = log or logger.info
    skipped = {fqn: _skip_reason(cfg, m, fqn) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    skipped = {fqn: why for fqn, why in skipped.items() if why is not None}
    if cfg.recipe == "blockwise":
        converted = convert_to_blockwise(model, float8_module_filter(cfg), emulate=emulate)
    else:
        f8.convert_to_float8_training(model, module_filter_fn=float8_module_filter(cfg),
                                      config=_linear_config(f8, cfg, emulate))
        converted = [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
    log(f"float8 {cfg.recipe}: {len(converted)} linears converted, {len(skipped)} kept in bf16"
        + " (emulated: high-precision GEMMs of float8-rounded operands)" * emulate
        + "".join(f"\n  bf16: {fqn} ({why})" for fqn, why in skipped.items()))
    experts = [fqn for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if experts and not cfg.experts:
        log(f"float8: {len(experts)} MoDE expert groups stay in bf16 (float8.experts = true runs their grouped "
            f"GEMMs in float8 rowwise)")
    return converted


def _plain_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # nn.Linear.forward itself is in Dynamo's skip list: a head compiled in place would find no frame to trace
    return F.linear(x, module.weight, module.bias)


@contextlib.contextmanager
def high_precision_forward(model_parts: list[nn.Module]) -> Iterator[None]:
    """Inside, every float8 linear and float8 expert group runs the plain forward (``F.linear``,
    ``GroupedExperts.forward``) on its own weights: the trained model as the eval tool, generation and exported
    checkpoints see it, without the float8 rounding of training (``float8.high_precision_eval``). The
    modules' hooks (FSDP's unshard) still run; compiled, the validation graph is traced with the plain
    forward (it is a graph of its own: no_grad, eval mode)."""
    from torchao.float8.float8_linear import Float8Linear

    swapped = []
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, (Float8Linear, BlockwiseFloat8Linear)):
                module.forward = types.MethodType(_plain_linear, module)
            elif isinstance(module, Float8GroupedExperts):
                module.forward = types.MethodType(GroupedExperts.forward, module)
            else:
                continue
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """After the optimizer step: one fused amax all-reduce for every float8 weight that FSDP all-gathers
    in float8, instead of one per weight at its next all-gather."""
    f8 = _torchao_float8()
    for part in model_parts:
        f8.precompute_float8_dynamic_scale_for_fsdp(part)
