"""Run a function in N real gloo processes on CPU and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # FSDP2 on gloo may abort at exit without this barrier
    finally:
        dist.destroy_process_group()
    # The result is saved: leave without interpreter teardown, as the trainer does. A C++ thread destroyed at
    # exit aborted a finished rank in CI ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes.

    ``fn`` must be a module-level function. Returns the per-rank return values, rank order. Ranks still running
    after ``timeout`` seconds (a collective that never completes) are killed and the call fails naming ``fn``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size,
            join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"{fn.__name__} on {world_size} gloo processes did not finish in {timeout:.0f} s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
