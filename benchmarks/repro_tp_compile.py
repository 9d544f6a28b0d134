"""Minimal reproduction: a compiled function's backward loses the autograd edge of an AsyncCollectiveTensor input.

Run: ``torchrun --nproc_per_node 2 benchmarks/repro_tp_compile.py`` (CPU, gloo). Plain torch only.

A DTensor redistributed with ``async_op=True`` and turned local gives an ``AsyncCollectiveTensor``; that is what
tensor parallelism's RowwiseParallel hands to the next module (our embedding -> first transformer block).
Eagerly, its gradient flows back through ``to_local`` (which wraps it into a DTensor again) and the redistribute.
Through ``torch.compile`` the gradient reaches the redistribute's backward as a plain tensor and it fails with
``AttributeError: 'Tensor' object has no attribute '_local_tensor'`` (torch 2.13.0, CPU). Waiting for the
collective eagerly (``async_op=False``) or copying the tensor first works: that is the route in parallel/tp.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard


def run(compiled: bool, async_op: bool) -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(4, 8, requires_grad=True)
    local = DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Shard(0)], async_op=async_op).to_local()
    w = torch.randn(8, requires_grad=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t * w).sum()

    try:
        (torch.compile(f, fullgraph=True) if compiled else f)(local).backward()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the point is to print which combination fails
        return f"FAILS: {type(e).__name__}: {str(e).splitlines()[0]}"


def main() -> None:
    dist.init_process_group("gloo")
    for compiled, async_op in ((False, True), (True, False), (True, True)):
        result = run(compiled, async_op)
        if dist.get_rank() == 0:
            print(f"torch {torch.__version__}  compiled={compiled!s:5}  async_op={async_op!s:5}  {result}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
