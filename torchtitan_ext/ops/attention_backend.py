"""Which fused attention kernel runs. On Hopper cuDNN's attention is faster than FlashAttention-2 for bf16
training shapes, so ``auto`` tries it first there. ``causal_kernel`` names the kernel the decoder's causal
attention calls directly (it returns the log-sum-exp with the output); ``attention_backend`` is the SDPA
preference for every other call."""

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


def causal_kernel(name: str, device: torch.device) -> str:
    """The decoder's causal kernel for ``training.attention_backend`` = ``name`` (``ops.attention``): "cudnn"
    or "flash" called directly on CUDA, "sdpa" (SDPA's own choice, no LSE) for the other backends and on CPU,
    where the attention core always takes torch's fused CPU kernel."""
    if device.type != "cuda" or name not in ("auto", "cudnn", "flash"):
        return "sdpa"
    if name == "auto":
        return "cudnn" if torch.cuda.get_device_capability(device) >= (9, 0) else "flash"
    return name
