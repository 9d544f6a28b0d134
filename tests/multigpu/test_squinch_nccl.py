"""Squinch's overlapped HSDP replicate all-reduce on real GPUs (NCCL): the per-module all-reduce hooks run on
FSDP2's all-reduce stream while the backward goes on, which gloo on CPU (``tests/integration/
test_squinch_comm.py``) cannot exercise.

* ``test_overlapped_gradients_within_bound``: HSDP dp_replicate 2 x dp_shard N/2 (N = 4 GPUs, or 2), a stack
  of linears each its own FSDP module, float32 and bf16 reduce: every gradient of the compressed run lies
  within Squinch's error bound of uncompressed native HSDP (the exact mean), and both replicas of a shard
  hold bit-identical gradients. The bound (see the gloo test): each replica's shard is encoded once (error
  <= 0.0738 of its block's max) and the mean of the decoded shards once more, so the total stays under
  0.0738 (2 + 0.0738) max|shard| (plus the reduce dtype's rounding, which native HSDP also has).
* ``test_trainer_loss_after_20_steps``: the trainer, HSDP with Squinch vs without, 20 steps of the tier's
  small job at lr 3e-4: each step's loss within 3% and the last 5 steps' mean within 1.5%.
"""

from __future__ import annotations

import os
import sys
import tempfile

import nccl_utils as nu
import pytest
import torch

pytestmark = pytest.mark.multigpu

SQUINCH_REL_BOUND = 0.0738
WIDTH, DEPTH, BATCH = 512, 6, 64


def _spawned(rank: int, world: int, port: int, out_dir: str, reduce_dtype: torch.dtype) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        torch.save(_grads_per_mode(rank, world, reduce_dtype), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(DEPTH)]
    return torch.nn.Sequential(*layers).cuda()


def _grads_per_mode(rank: int, world: int, reduce_dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """Full gradients (CPU, float64) after one step: native HSDP and overlapped Squinch, plus what each replica
    handed to the replicate reduction (its shard group's mean of local gradients), for the bound."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchtitan_ext.comm.compressed_collectives import CommStats, install_squinch_replicate_hooks

    mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    out = {}
    for mode in ("native", "squinch"):
        model = _model()
        for module in [*model, model]:
            fully_shard(module, mesh=mesh if mode == "native" else mesh["dp_shard"], mp_policy=mp)
        if mode == "squinch":
            install_squinch_replicate_hooks(model, mesh["dp_replicate"].get_group(), min_numel=1024,
                                            error_feedback=True, stats=CommStats())
        model(x).float().square().mean().backward()
        out[mode] = {n: p.grad.full_tensor().double().cpu() for n, p in model.named_parameters()}
    local = _model().to(torch.bfloat16)  # the same bf16 forward as FSDP's, no data parallelism
    local(x.to(torch.bfloat16)).float().square().mean().backward()
    out["local"] = {n: p.grad.double().cpu() for n, p in local.named_parameters()}
    return out


def _run_nccl(world: int, reduce_dtype: torch.dtype) -> list[dict]:
    from dist_utils import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        torch.multiprocessing.start_processes(_spawned, args=(world, free_port(), out_dir, reduce_dtype),
                                              nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.mark.skipif(nu.ON_CPU > 0, reason="NCCL only")
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlapped_gradients_within_bound(reduce_dtype: torch.dtype) -> None:
    world = 4 if nu.GPUS >= 4 else 2
    results = _run_nccl(world, reduce_dtype)
    shards = world // 2
    rounding = 2 ** -7 if reduce_dtype == torch.bfloat16 else 1e-5  # the reduce dtype's, relative to max|g|
    for name in results[0]["native"]:
        replicas = [torch.stack([results[r * shards + s]["local"][name] for s in range(shards)]).mean(0)
                    for r in range(2)]
        biggest = max(g.abs().max().item() for g in replicas)
        bound = (SQUINCH_REL_BOUND * (2 + SQUINCH_REL_BOUND) + 4 * rounding) * biggest
        for rank in range(world):
            native, squinch = results[rank]["native"][name], results[rank]["squinch"][name]
            error = (squinch - native).abs().max().item()
            assert error <= bound, f"{name} rank {rank}: {error:.3e} > bound {bound:.3e}"
            assert torch.equal(squinch, results[0]["squinch"][name]), f"{name}: replicas disagree"
        assert not torch.equal(results[0]["squinch"][name], results[0]["native"][name]), "not compressed"


def test_trainer_loss_after_20_steps(tmp_path) -> None:
    world = 4 if nu.GPUS >= 4 else 2
    # lr 3e-4, not the tier's 3e-3: at 3e-3 the job's loss spikes (step 6 on 4 H200s), and a spike turns the
    # compression's noise into a 40% difference at one step; the faults bed's lr keeps the trajectory smooth.
    layout = ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", str(world // 2),
              "--training.local_batch_size", str(nu.GLOBAL_BATCH // world), "--optimizer.lr", "3e-4"]
    pool = nu.JobPool()
    try:
        plain = pool.run(tmp_path / "plain", world, *layout)
        squinch = pool.run(tmp_path / "squinch", world, *layout, "--comm.gradient_compression", "squinch",
                           "--comm.error_feedback", "true")
        plain_dump, squinch_dump = plain.result(), squinch.result()
    finally:
        pool.shutdown()
    log = nu.log_tail(squinch_dump, chars=10**6)
    assert "Squinch on the all-reduce over dp_replicate = 2 (per module, overlapped" in log
    ref, got = nu.losses(plain_dump), nu.losses(squinch_dump)
    assert sorted(ref) == sorted(got) == list(range(1, 21))
    diffs = nu.rel_diffs(ref, got)
    print(f"squinch vs plain, step 20: {got[20]:.4f} vs {ref[20]:.4f}; largest step difference "
          f"{max(diffs.values()):.2%}", file=sys.stderr)
    assert diffs[1] <= 1e-3, "same weights and data: the first loss must match"
    assert ref[20] < 0.95 * ref[1], f"the plain run barely learns ({ref[1]:.3f} -> {ref[20]:.3f}): nothing compared"
    assert max(diffs.values()) <= 0.03, diffs
    last = [16, 17, 18, 19, 20]
    assert abs(sum(got[s] for s in last) - sum(ref[s] for s in last)) <= 0.015 * sum(ref[s] for s in last)
