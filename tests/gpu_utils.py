"""What the GPU tests share."""

from __future__ import annotations

import torch


def poison_cuda_cache() -> None:
    """Leave NaN in the caching allocator's free blocks, as a training step leaves old values: an output block
    that a kernel never wrote (say, an empty group's weight gradient) would then read as NaN."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in [1 << 28] + [1 << 16] * 256]
    del blocks
