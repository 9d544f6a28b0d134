"""Context parallelism on real GPUs (NCCL) against one GPU: CP 2 and CP 4, ring and all-to-all, compiled,
float32, the tier's small job (nccl_utils.JOB: 8 heads, 4 K/V heads, seq 256, so cp 4 cuts it into 8 chunks
and all-to-all repeats no K/V head); FSDP 2 x CP 2; and a checkpoint saved under CP 4 resumed under CP 2.

The jobs start together in one pool (nccl_utils.JobPool); the tests compare what they logged. Not yet run
on GPUs; the bounds are the tier's float32 ones (nccl_utils.FLOAT32_TOL)."""

from __future__ import annotations

from concurrent.futures import Future

import nccl_utils as nu
import pytest

pytestmark = pytest.mark.multigpu

TOL = nu.FLOAT32_TOL
CKPT_AT_10 = ["--checkpoint.enabled", "true", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "0"]


def _cp(cp: int, scheme: str, dp_shard: int = 1) -> list[str]:
    return ["--parallelism.cp", str(cp), "--parallelism.cp_scheme", scheme, "--parallelism.dp_shard", str(dp_shard),
            "--training.local_batch_size", str(nu.GLOBAL_BATCH // dp_shard)]


LAYOUTS = {f"cp{cp}_{scheme}": (cp, _cp(cp, scheme)) for cp in (2, 4) for scheme in ("ring", "alltoall")}
LAYOUTS["fsdp2_cp2_ring"] = (4, _cp(2, "ring", dp_shard=2))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Future]:
    root = tmp_path_factory.mktemp("cp_nccl")
    pool = nu.JobPool()
    futures = {"one": pool.run(root / "one", 1, *nu.COMPILE)}
    for name, (nproc, overrides) in LAYOUTS.items():
        if nproc <= nu.GPUS:
            extra = CKPT_AT_10 if name == "cp4_ring" else []
            futures[name] = pool.run(root / name, nproc, *nu.COMPILE, *overrides, *extra)
    if "cp4_ring" in futures:
        def resume(gpus: list[int]):
            dump = root / "resume_cp2"
            nu.seed_checkpoint(futures["cp4_ring"].result(), dump, 10)
            nu.run_trainer(dump, 2, *nu.COMPILE, *_cp(2, "ring"), *CKPT_AT_10, gpus=gpus)
            return dump
        futures["resume_cp2"] = pool.submit(2, resume, after=[futures["cp4_ring"]], name="resume_cp2")
    yield futures
    pool.shutdown()


@pytest.mark.parametrize("layout", [pytest.param(n, marks=nu.needs_gpus(LAYOUTS[n][0])) for n in LAYOUTS])
def test_cp_layout_matches_one_gpu(jobs, layout):
    nu.assert_close_losses(layout, jobs["one"].result(), jobs[layout].result(), **TOL)


@nu.needs_gpus(4)
def test_cp4_checkpoint_resumes_at_cp2(jobs):
    """Saved at step 10 under CP 4, resumed to step 20 under CP 2: the CP 4 run's steps 11-20."""
    nu.assert_close_losses("resume_cp2", jobs["cp4_ring"].result(), jobs["resume_cp2"].result(),
                           steps=list(range(11, 21)), **TOL)
