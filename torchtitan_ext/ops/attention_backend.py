"""Which fused attention kernel runs. On Hopper cuDNN's attention is faster than FlashAttention-2 for bf16
training shapes, so ``auto`` tries it first there. ``causal_kernel`` names the kernel the decoder's causal
attention calls directly (it returns the log-sum-exp with the output); ``attention_backend`` is the SDPA
preference for every other call."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan_ext.errors import ConfigError

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


# The largest score matrix the math backend may materialise per attention call: beyond it a long sequence would
# spend its memory on (batch x heads x seq x seq) scores that the fused kernels never hold.
MATH_SCORES_LIMIT_BYTES = 1 << 30


def check_math_backend(name: str, device: torch.device, batch: int, heads: int, seq_len: int) -> None:
    """One line refusing ``training.attention_backend = "math"`` on CUDA where its scores would exceed
    MATH_SCORES_LIMIT_BYTES (float32 scores of the local batch and the rank's heads)."""
    scores = 4 * batch * heads * seq_len * seq_len
    if device.type == "cuda" and name == "math" and scores > MATH_SCORES_LIMIT_BYTES:
        raise ConfigError(f"training.attention_backend = 'math' materialises the attention scores, "
                          f"{scores / (1 << 30):.1f} GiB per layer at local_batch_size {batch} x seq_len {seq_len} "
                          f"x {heads} heads (at most {MATH_SCORES_LIMIT_BYTES >> 30} GiB); use auto, cudnn, flash "
                          "or efficient, which never hold them")
