"""Linears that read the same input (a block's q / k / v, the SwiGLU's w1 / w3) as one GEMM over their
concatenated weights: one larger GEMM runs closer to the card's peak than two or three narrow ones, and a
float8 GEMM casts the shared input once. The parameters stay separate (checkpoints, optimizers, muP and the
Hugging Face mapping see the same tensors); the concatenation is a copy of the weights per forward and its
gradient is a split.

Which module types fuse is a registry: plain ``nn.Linear`` here, torchao's ``Float8Linear`` registered by
``quant/float8.py`` when it converts a model. A group fuses only when its modules are all of one registered
type, bias-free, with plain (not DTensor) weights and, for a registered type, compatible settings; any other
group (tensor parallelism, fake-quantised or mixed linears) runs its linears one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# module type -> (can these modules share one GEMM?, x and the concatenated weight -> the joint output)
Fusion = tuple[Callable[[Sequence[nn.Module]], bool], Callable[[Sequence[nn.Module], torch.Tensor, torch.Tensor],
                                                                torch.Tensor]]
_FUSIONS: dict[type, Fusion] = {}


def register_fusion(module_type: type, compatible: Callable[[Sequence[nn.Module]], bool],
                    matmul: Callable[[Sequence[nn.Module], torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Let groups of ``module_type`` run as one GEMM: ``matmul(modules, x, weight)`` computes what the modules'
    forwards would, concatenated along the last dimension, from their concatenated ``weight``."""
    _FUSIONS[module_type] = (compatible, matmul)


def _plain_matmul(modules: Sequence[nn.Module], x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


register_fusion(nn.Linear, lambda modules: True, _plain_matmul)


def fusion_for(modules: Sequence[nn.Module]) -> Fusion | None:
    """The fusion that runs ``modules`` as one GEMM, or None when they must run one by one."""
    kind = type(modules[0])
    fusion = _FUSIONS.get(kind)
    if fusion is None or any(type(m) is not kind for m in modules):
        return None
    if any(m.bias is not None or isinstance(m.weight, DTensor) or type(m.weight) not in (torch.Tensor, nn.Parameter)
           for m in modules):
        return None
    return fusion if fusion[0](modules) else None


def project(x: torch.Tensor, modules: Sequence[nn.Module], fused: bool) -> list[torch.Tensor]:
    """Each module applied to ``x``; ``fused``: as one GEMM where ``fusion_for`` allows it."""
    fusion = fusion_for(modules) if fused else None
    if fusion is None:
        return [m(x) for m in modules]
    weight = torch.cat([m.weight for m in modules])
    return list(fusion[1](modules, x, weight).split([m.weight.shape[0] for m in modules], dim=-1))
