"""INT8 training: the blocks' linear forward matmuls in int8 with per-tensor dynamic scales, backward in the
parameters' own precision (bf16 on GPU).

Forward: ``s_x = amax|x| / 127``, ``s_w = amax|w| / 127``, ``x_q = round(x / s_x)``, ``w_q = round(w / s_w)``
(int8), ``y = (x_q @ w_q^T) * s_x * s_w`` with an int32 accumulator: ``torch._int_mm`` on CUDA, and on CPU an
exact emulation (int8 products summed in float64, exact below 2^53, i.e. for any fan-in under 5 * 10^11).
Backward: ``dx = dy @ w``, ``dw = dy^T x`` from the unquantised tensors (a straight-through estimator).
Applied as a class swap of the blocks' ``nn.Linear`` modules on the meta model (names and parameters kept).

Under tensor parallelism the linears see DTensors: the scales are the absolute maxima of the whole tensors
(an all-reduce of the shards' maxima), the int8 matmul runs on the local shards, and the result is the
DTensor that the sharding implies, as torch's own sharded linear would give it: a column-parallel linear
(weight sharded by rows, input replicated) has its output sharded by columns, a row-parallel one (weight
and input sharded along the features) a partial sum that the TP plan reduces.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

QMAX = 127


def quantize_per_tensor(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scale) with ``x ~= values * scale``; ``amax``: the absolute maximum to scale by
    (default: ``x``'s own)."""
    amax = x.detach().abs().amax() if amax is None else amax
    scale = (amax.float() / QMAX).clamp_min(1e-12)
    return torch.round(x.detach().float() / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact int32 result of int8 ``a (M, K) @ b_t (K, N)``: ``torch._int_mm`` where it runs (CUDA, M > 16,
    K and N multiples of 8), else an exact float64 emulation."""
    m, k = a.shape
    n = b_t.shape[1]
    if a.is_cuda and m > 16 and k % 8 == 0 and n % 8 == 0:
        return torch._int_mm(a, b_t)
    return (a.double() @ b_t.double()).to(torch.int32)


def _local_int8_linear(x: torch.Tensor, weight: torch.Tensor, x_amax: torch.Tensor | None = None,
                       w_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T`` through int8 (scales from the given absolute maxima, default the tensors' own)."""
    xq, sx = quantize_per_tensor(x, x_amax)
    wq, sw = quantize_per_tensor(weight, w_amax)
    acc = int8_matmul(xq.reshape(-1, x.shape[-1]), wq.t().contiguous())
    return (acc.float() * (sx * sw)).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _sharded_int8_linear(x: DTensor, weight: DTensor) -> DTensor:
    """The int8 forward of a tensor-parallel linear (1-D mesh): global scales, local matmul."""
    (wp,), (xp,) = weight.placements, x.placements
    features_sharded = xp.is_shard() and xp.dim % x.ndim == x.ndim - 1
    if wp.is_shard(0) and xp.is_replicate():
        out_placement = Shard(x.ndim - 1)  # column-parallel
    elif wp.is_shard(1) and features_sharded:
        out_placement = Partial()  # row-parallel
    else:
        raise NotImplementedError(f"int8 forward: input {x.placements} with weight {weight.placements}")
    amax = [t.detach().abs().amax().full_tensor() for t in (x, weight)]  # over every shard
    out = _local_int8_linear(x.to_local(), weight.to_local(), *amax)
    return DTensor.from_local(out, weight.device_mesh, [out_placement], run_check=False)


class _Int8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        if isinstance(weight, DTensor):
            return _sharded_int8_linear(x, weight)
        return _local_int8_linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors  # DTensors under TP: these products are then sharded matmuls themselves
        grad = grad.to(x.dtype)
        grad_x = grad @ weight.to(x.dtype)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w.to(weight.dtype)


class Int8Linear(nn.Linear):
    """``nn.Linear`` (no bias) whose forward matmul runs in int8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Int8LinearFn.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def apply_int8_forward(model: nn.Module) -> int:
    """Turn every ``nn.Linear`` inside the blocks (attention, dense FFNs; not routers or the head) into an
    Int8Linear; returns how many."""
    n = 0
    for block in model.layers.values():
        for name, module in block.named_modules():
            if type(module) is nn.Linear and not name.endswith("router"):
                module.__class__ = Int8Linear
                n += 1
    return n


def reference_int8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 reference of the int8 forward (tests): quantise, multiply in float64, rescale."""
    xq, sx = quantize_per_tensor(x)
    wq, sw = quantize_per_tensor(weight)
    return F.linear(xq.double(), wq.double()) * sx.double() * sw.double()
