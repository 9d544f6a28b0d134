"""``training.deterministic``: bitwise-reproducible runs for debugging, at a cost in speed.

Deterministic kernels only (an op without one raises instead of silently varying), cuDNN without
autotuning, cuBLAS with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts,
so this runs before the trainer touches CUDA), and every generator seeded. Weights and data order already
depend only on ``job.seed`` (parallel/init.py, data/loader.py); this covers the kernels and any random op.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"


def make_deterministic(seed: int) -> None:
    """Call before any CUDA work."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
