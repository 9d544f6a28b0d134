"""AdamW whose update of each large parameter is one Triton kernel streaming its four tensors once.

Why: torch's fused AdamW (a multi-tensor-apply kernel) moves its 28 bytes per float32 parameter well below
the card's HBM bandwidth, and the optimizer step is bound by those bytes. MoE models hold many parameters for
few active ones, so the optimizer is a large fixed share of their step.

``TritonAdamW`` is ``torch.optim.AdamW`` (same arguments, param groups and state: ``step``, ``exp_avg``,
``exp_avg_sq``, so checkpoints move freely between the two) whose ``step`` runs the kernel on every CUDA
parameter of at least ``MIN_NUMEL`` elements and torch's fused kernel on the rest (small tensors are
launch-bound), and on tensor subclasses (float8 weights: their storage is not theirs to stream). It keeps
the fused kernel's device-side clipping and skip: ``grad_scale`` divides the gradients, ``found_inf`` (1.0)
leaves parameters, moments and step counts unchanged, with no host read. Unlike torch's kernel it does not
write the divided gradients back (4 bytes a parameter saved); nothing reads them after the step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

MIN_NUMEL = 1 << 20  # smaller tensors go to torch's fused kernel: one launch for all of them
BLOCK = 1024  # elements per program: measured faster than 4096


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, skip_ptr, n, lr, beta1, beta2, eps,
                  decay_factor, log2_beta1, log2_beta2, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(tl.load(skip_ptr) == 0, n, 0)  # a skipped step reads and writes nothing
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = p * decay_factor
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def adamw_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: torch.Tensor | None, found_inf: torch.Tensor, block: int = BLOCK) -> None:
    """One AdamW update of contiguous float32 ``p``, ``m``, ``v`` in place from ``g`` (any float dtype), at the
    (already incremented) float32 device scalar ``step``: torch's fused AdamW formula, in float32."""
    grid = (triton.cdiv(p.numel(), block),)
    _adamw_kernel[grid](p, g, m, v, step, grad_scale if grad_scale is not None else found_inf, found_inf,
                        p.numel(), lr, beta1, beta2, eps, 1.0 - lr * weight_decay,
                        math.log2(beta1) if beta1 > 0 else -math.inf, math.log2(beta2) if beta2 > 0 else -math.inf,
                        HAS_SCALE=grad_scale is not None, BLOCK=block, num_warps=8)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass holding its data elsewhere


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, without ``to_local``'s autograd wrapper (tens of microseconds a call, paid for
    every parameter, gradient and moment at every step)."""
    return t._local_tensor if isinstance(t, DTensor) else t


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` whose large CUDA float32 parameters step through ``adamw_update_``.
    ``min_numel``: the smallest parameter (local elements) the kernel takes; ``kernel_on_cpu``: run the kernel
    on CPU tensors too (tests, under ``TRITON_INTERPRET=1``)."""

    def __init__(self, params, *, min_numel: int = MIN_NUMEL, kernel_on_cpu: bool = False, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        if any(group["amsgrad"] or group["maximize"] for group in self.param_groups):
            raise ValueError("TritonAdamW: amsgrad and maximize are not supported")
        self.min_numel, self.kernel_on_cpu = min_numel, kernel_on_cpu

    def takes(self, p: torch.Tensor) -> bool:
        """Whether the kernel updates ``p`` (when it has a plain contiguous gradient)."""
        local = _local(p)
        return (local.numel() >= self.min_numel and local.dtype == torch.float32 and type(local) in _PLAIN
                and local.is_contiguous() and (local.is_cuda or self.kernel_on_cpu))

    def _streams(self, p: torch.Tensor) -> bool:
        if p.grad is None or not self.takes(p):
            return False
        grad = _local(p.grad)
        moments = [_local(self.state[p][k]) for k in ("exp_avg", "exp_avg_sq")] if self.state.get(p) else []
        return type(grad) in _PLAIN and grad.is_contiguous() and all(  # moments as loaded from a checkpoint
            type(m) in _PLAIN and m.is_contiguous() and m.dtype == torch.float32 for m in moments)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW.step: closures are not supported")
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        saved = [group["params"] for group in self.param_groups]
        streamed: list[tuple[dict, list[torch.Tensor]]] = []
        for group in self.param_groups:  # torch's kernel steps the rest
            flags = [self._streams(p) for p in group["params"]]
            streamed.append((group, [p for p, mine in zip(group["params"], flags, strict=True) if mine]))
            group["params"] = [p for p, mine in zip(group["params"], flags, strict=True) if not mine]
        try:
            super().step()
        finally:
            for group, params in zip(self.param_groups, saved, strict=True):
                group["params"] = params
        for group, params in streamed:
            self._stream_group(group, params, grad_scale, found_inf)

    def _stream_group(self, group: dict, params: list[torch.Tensor], grad_scale: torch.Tensor | None,
                      found_inf: torch.Tensor | None) -> None:
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        steps = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps.append(state["step"])
        skip = found_inf if found_inf is not None else torch.zeros((), device=steps[0].device)
        torch._foreach_add_(steps, 1.0)
        for p, step in zip(params, steps, strict=True):
            state = self.state[p]
            adamw_update_(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), step,
                          lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                          grad_scale=_local(grad_scale) if grad_scale is not None else None, found_inf=skip)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
