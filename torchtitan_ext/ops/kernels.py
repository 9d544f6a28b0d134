"""``training.kernels``: the blocks' fused Triton kernels or plain torch, chosen per module before compile.

Modules carry a ``fused_kernels`` flag set from their ``ComputeOptions`` (default off); the Triton modules
are imported only when a flagged module runs, so a torch-only install never needs Triton. Under tensor
parallelism the residual stream and norms (and the QK-norm weights) are DTensors, which the custom ops do not
take: there only the FFN activation (on each rank's local hidden columns) is fused.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn


def check_kernels(name: str, device: torch.device) -> str | None:
    """Why ``training.kernels = name`` cannot run here, or None."""
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "training.kernels = 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1 to emulate it on CPU)"
    return None


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, norm: nn.RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    from torchtitan_ext.ops.fused_norm import add_rms_norm as fused

    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return fused(x, y, norm.weight, eps)


def gated_activation(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU ``silu(a) * b``, or squared ReLU of ``a`` when ``b`` is None."""
    from torchtitan_ext.ops.activations import relu2_fwd, swiglu_fwd

    return relu2_fwd(a) if b is None else swiglu_fwd(a, b)


def qk_norm_rope(x: torch.Tensor, norm: nn.RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from torchtitan_ext.ops.qk_norm_rope import qk_norm_rope as fused

    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return fused(x, norm.weight, cos if cos.ndim == 3 else cos[None], sin if sin.ndim == 3 else sin[None], eps)
