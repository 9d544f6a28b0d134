"""Which fused kernel ``F.scaled_dot_product_attention`` uses. On Hopper, cuDNN's attention is faster
than FlashAttention-2 for bf16 training shapes, so ``auto`` tries it first there."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Each backend falls back to the ones after it.
_FALLBACKS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_ORDER = {name: _FALLBACKS[i:] for i, name in enumerate(("cudnn", "flash", "efficient", "math"))}


def attention_backend(name: str, device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which SDPA prefers the named backend (falling back in order when it cannot run)."""
    if device.type != "cuda" or name == "torch":
        return contextlib.nullcontext()
    if name == "auto":
        name = "cudnn" if torch.cuda.get_device_capability(device) >= (9, 0) else "flash"
    return sdpa_kernel(_ORDER[name], set_priority=True)
