"""Every layout on real GPUs (NCCL), against one GPU: FSDP, HSDP, TP, PP with each schedule, TP x PP,
FSDP x TP (x PP), FSDP x TP with op-level selective AC, compiled (the zero-bubble schedules eager), float32,
20 steps; float8 with float8 all-gather; a DCP checkpoint saved at 4 GPUs resumed at 2 and 1; one rank killed,
torchrun restarts the job, which resumes with the same losses.

All the module's jobs start together in one pool (nccl_utils.JobPool: several small jobs share each GPU),
only those the selected tests need; the tests then compare what the jobs logged. Expected: three to four
minutes on 4 H100s (not yet measured). A test needing more GPUs than the machine has skips, naming the count.

Tolerances (float32, deterministic kernels; nccl_utils.JOB says why not bf16; nccl_utils.FLOAT32_TOL gives the
measured basis): every layout sums in its own order, so its losses agree with one GPU's to float32 rounding over the
first steps, and within looser bounds over the whole run, where the job's loss spikes amplify the rounding.
``test_tolerance_rejects_other_data`` shows the early bound rejects a run that saw other data. A restart on the
layout it was killed on agrees to SAME_LAYOUT_RTOL at every step. Set ``MULTIGPU_REPORT=FILE`` for each
comparison's largest differences as JSON lines (and each job's wall time).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import time
from concurrent.futures import Future
from pathlib import Path

import nccl_utils as nu
import pytest

pytestmark = pytest.mark.multigpu

SAME_LAYOUT_RTOL = 1e-4
TOL = nu.FLOAT32_TOL
# Not measured yet on the GPUs: step 1 only is held tight; bf16 trajectories drift apart (nccl_utils.JOB).
FLOAT8_TOL = {"early_steps": 1, "early_rtol": 1e-2, "early_grad_norm_rtol": 6e-2, "loss_rtol": 0.5, "mean_rtol": 0.1}


def _layout(nproc: int, dp_shard: int = 1, tp: int = 1, pp: int = 1, dp_replicate: int = 1,
            schedule: str = "1F1B", virtual: int = 1, microbatches: int = 0) -> tuple[int, list[str]]:
    """Overrides for a layout with the reference's global batch."""
    return nproc, ["--parallelism.dp_shard", str(dp_shard), "--parallelism.dp_replicate", str(dp_replicate),
                   "--parallelism.tp", str(tp), "--parallelism.pp", str(pp), "--parallelism.pp_schedule", schedule,
                   "--parallelism.pp_virtual_stages", str(virtual), "--parallelism.pp_microbatches",
                   str(microbatches), "--training.local_batch_size", str(nu.GLOBAL_BATCH // (dp_shard * dp_replicate))]


PP2 = {"gpipe": ("GPipe", 1), "1f1b": ("1F1B", 1), "interleaved1f1b": ("Interleaved1F1B", 2),
       "interleaved_zb": ("InterleavedZeroBubble", 2), "zbv": ("ZBVZeroBubble", 2)}
LAYOUTS = {
    "fsdp2": _layout(2, dp_shard=2),
    "fsdp4": _layout(4, dp_shard=4),
    "hsdp2x2": _layout(4, dp_shard=2, dp_replicate=2),
    "tp2": _layout(2, tp=2),
    "tp4": _layout(4, tp=4),
    **{f"pp2_{key}": _layout(2, pp=2, schedule=s, virtual=v, microbatches=4) for key, (s, v) in PP2.items()},
    "fsdp2_tp2": _layout(4, dp_shard=2, tp=2),
    "fsdp2_pp2": _layout(4, dp_shard=2, pp=2, microbatches=4),
    "tp2_pp2": _layout(4, tp=2, pp=2, microbatches=4),
    "fsdp2_tp2_pp2": _layout(8, dp_shard=2, tp=2, pp=2, microbatches=2),
    # op-level selective AC under TP: its policy keeps the reduce-scatters' outputs (parallel/activation_checkpoint.py)
    "fsdp2_tp2_selective_ac": (4, [*_layout(4, dp_shard=2, tp=2)[1], "--activation_checkpoint.mode", "selective"]),
    # ZBV over checkpointed blocks: its weight pass recomputes each block once (parallel/pp.py Stage)
    "pp2_zbv_full_ac": (2, [*_layout(2, pp=2, schedule="ZBVZeroBubble", virtual=2, microbatches=4)[1],
                            "--activation_checkpoint.mode", "full"]),
}

# The zero-bubble schedules refuse compiled blocks (parallel.pp.check_schedule): they run eager against the
# compiled reference (float32: the two differ by rounding only).
EAGER = {"pp2_interleaved_zb", "pp2_zbv", "pp2_zbv_full_ac"}
FLOAT8 = ["--float8.enabled", "true", "--float8.recipe", "tensorwise", "--training.mixed_precision_param", "bfloat16"]
FLOAT8_NPROC = 4 if nu.GPUS >= 4 else 2
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None

# The checkpoint jobs (not compiled): FSDP over SAVE_NPROC GPUs, 40 steps, a checkpoint every 10.
SAVE_NPROC = 4 if nu.GPUS >= 4 else 2
CKPT = ["--training.steps", "40", "--checkpoint.enabled", "true", "--checkpoint.interval", "10",
        "--checkpoint.keep_latest_k", "0"]
RESUME_STEP = 20
KILL_AFTER = 15  # steps logged before a worker is killed: the step-10 checkpoint is published


def _fsdp(nproc: int) -> list[str]:
    return ["--parallelism.dp_shard", str(nproc), "--training.local_batch_size", str(nu.GLOBAL_BATCH // nproc)]


# AdamW's Triton kernel against torch's under FSDP 2: the job's blocks widened so that their FFN matrices (1024 x
# 4096, 2.1e6 elements per rank) reach the kernel's threshold (2^20 local elements); every tensor of the tier's
# width-512 jobs stays below it, so there the default kernel choice changes nothing.
ADAMW_WIDE = ["--model.dim", "1024", "--model.ffn_hidden", "4096", *_fsdp(2)]


def _resume(ckpt: Path, dump: Path, nproc: int, gpus: list[int]) -> Path:
    """The saved run's step-RESUME_STEP checkpoint in a fresh dump folder, continued to step 40 on nproc GPUs
    (one GPU: a plain data-parallel-free job)."""
    nu.seed_checkpoint(ckpt, dump, RESUME_STEP)
    nu.run_trainer(dump, nproc, *CKPT, *_fsdp(nproc), gpus=gpus)
    return dump


def _killed(dump: Path, gpus: list[int]) -> tuple[Path, str]:
    """The checkpoint job with torchrun allowed one restart; one worker SIGKILLed once KILL_AFTER steps are
    logged. Returns the dump folder and the agent's log."""
    agent = nu.start_trainer(dump, SAVE_NPROC, *CKPT, *_fsdp(SAVE_NPROC), gpus=gpus, max_restarts=1)
    deadline = time.time() + 420
    while time.time() < deadline and agent.poll() is None and not (
            (dump / "metrics.jsonl").is_file() and len(nu.read_metrics(dump)) >= KILL_AFTER):
        time.sleep(0.05)
    if agent.poll() is not None:
        raise AssertionError(f"the job ended (exit {agent.returncode}) before a worker was killed:\n"
                             f"{nu.log_tail(dump)}")
    workers = nu.children(agent.pid)
    assert len(workers) == SAVE_NPROC, workers
    os.kill(workers[-1], signal.SIGKILL)
    try:
        code = agent.wait(timeout=420)
    except subprocess.TimeoutExpired:
        nu.kill_job(agent)
        raise AssertionError(f"the restarted job did not end in 420 s:\n{nu.log_tail(dump)}") from None
    assert code == 0, f"restarted job failed ({code}):\n{nu.log_tail(dump)}"
    return dump, Path(f"{dump}.log").read_text(errors="replace")


def _needs(item: pytest.Item) -> set[str]:
    """The pool jobs a selected test reads."""
    name, params = item.originalname, getattr(item, "callspec", None)
    params = params.params if params else {}
    if name == "test_layout_matches_one_gpu":
        return {"reference", params["layout"]}
    if name == "test_tolerance_rejects_other_data":
        return {"reference", "other_data"}
    if name == "test_float8_all_gather_matches_one_gpu":
        return {"float8_reference", "float8_fsdp"}
    if name == "test_checkpoint_resumes_on_fewer_gpus":
        return {"ckpt", f"resume{params['nproc']}"}
    if name == "test_killed_rank_restarts_and_resumes":
        return {"ckpt", "killed"}
    if name == "test_adamw_triton_kernel_matches_torch_kernel_under_fsdp":
        return {"adamw_torch", "adamw_triton"}
    return set()


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict[str, Future]:
    """Start every job the selected (and not skipped) tests of this module need, all at once."""
    selected = [i for i in request.session.items if i.module is request.module
                and not any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0])
                            for m in i.iter_markers())]
    wanted = set().union(*map(_needs, selected))
    root = tmp_path_factory.mktemp("nccl")
    pool = nu.JobPool()
    futures: dict[str, Future] = {}

    def run(name: str, nproc: int, *overrides: str) -> None:
        if name in wanted:
            futures[name] = pool.run(root / name, nproc, *overrides)

    run("reference", 1, *nu.COMPILE)
    run("float8_reference", 1, *nu.COMPILE, *FLOAT8)
    run("ckpt", SAVE_NPROC, *CKPT, *_fsdp(SAVE_NPROC))
    if "killed" in wanted:
        futures["killed"] = pool.submit(SAVE_NPROC, lambda gpus: _killed(root / "killed", gpus), name="killed")
    for nproc in (2, 1):
        if f"resume{nproc}" in wanted:
            futures[f"resume{nproc}"] = pool.submit(
                nproc, lambda gpus, n=nproc: _resume(root / "ckpt", root / f"resume{n}", n, gpus),
                after=[futures["ckpt"]], name=f"resume{nproc}")
    run("float8_fsdp", FLOAT8_NPROC, *nu.COMPILE, *FLOAT8, *_fsdp(FLOAT8_NPROC),
        "--float8.enable_fsdp_float8_all_gather", "true", "--float8.precompute_float8_dynamic_scale_for_fsdp", "true")
    run("other_data", 1, *nu.COMPILE, "--data.shuffle", "false")
    for name, (nproc, overrides) in LAYOUTS.items():
        run(name, nproc, *([] if name in EAGER else nu.COMPILE), *overrides)
    for kernel in ("torch", "triton"):
        run(f"adamw_{kernel}", 2, *nu.COMPILE, *ADAMW_WIDE, "--optimizer.adamw_kernel", kernel)
    yield futures
    pool.shutdown()


def _layout_params():
    return [pytest.param(name, marks=nu.needs_gpus(nproc), id=name) for name, (nproc, _) in LAYOUTS.items()]


@pytest.mark.parametrize("layout", _layout_params())
def test_layout_matches_one_gpu(jobs, layout):
    reference, dump = jobs["reference"].result(), jobs[layout].result()
    nu.assert_close_losses(layout, reference, dump, **TOL)
    first, last = nu.losses(reference)[1], nu.losses(reference)[20]
    assert last < 0.8 * first, f"the reference barely learns ({first:.3f} -> {last:.3f}): the comparison is empty"


def test_tolerance_rejects_other_data(jobs):
    """The bounds are tight enough to matter: one GPU reading the same corpus in another order (unshuffled)
    falls outside the early window's bound."""
    ref, other = nu.losses(jobs["reference"].result()), nu.losses(jobs["other_data"].result())
    diffs = nu.rel_diffs(ref, other)
    assert max(diffs[s] for s in sorted(diffs)[:TOL["early_steps"]]) > TOL["early_rtol"], diffs


@pytest.mark.skipif(nu.ON_CPU > 0, reason="float8 needs an H100-class GPU")
@pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (carry .whl/torchao-*.whl; pip install "
                    "--no-deps --target /tmp/site; PYTHONPATH=/tmp/site)")
def test_float8_all_gather_matches_one_gpu(jobs):
    """Tensorwise float8 with FSDP's float8 all-gather (and the one fused amax) against float8 on one GPU:
    the all-gathered weights are scaled from the whole tensor's amax, as on one GPU."""
    dump = jobs["float8_fsdp"].result()
    nu.assert_close_losses("float8_fsdp", jobs["float8_reference"].result(), dump, **FLOAT8_TOL)
    converted = re.search(r"float8 tensorwise: (\d+) linears converted", nu.log_tail(dump, 10**7))
    assert converted and int(converted[1]) > 0, nu.log_tail(dump)


@nu.needs_gpus(2)
@pytest.mark.parametrize("nproc", [n for n in (2, 1) if n < SAVE_NPROC])
def test_checkpoint_resumes_on_fewer_gpus(jobs, nproc):
    """Saved by FSDP over SAVE_NPROC GPUs at step 20, resumed on fewer: steps 21-40 as the saved run logged
    them (the layouts' bounds; the first resumed step runs the same weights on the same batch)."""
    saved, resumed = jobs["ckpt"].result(), jobs[f"resume{nproc}"].result()
    assert sorted(nu.losses(resumed)) == list(range(RESUME_STEP + 1, 41))
    assert "resumed from" in nu.log_tail(resumed, 10**7)
    nu.assert_close_losses(f"resume{nproc}", saved, resumed, steps=list(range(RESUME_STEP + 1, 41)), **TOL)


@nu.needs_gpus(2)
def test_killed_rank_restarts_and_resumes(jobs):
    """One worker SIGKILLed after step KILL_AFTER: torchrun restarts the workers, they resume from the latest
    checkpoint (step 10 or later), and every step's loss equals the uninterrupted run's (same layout,
    deterministic kernels)."""
    saved = jobs["ckpt"].result()
    dump, log = jobs["killed"].result()
    assert "resumed from" in log and (dump / "checkpoint" / "step-40").is_dir(), log[-4000:]
    got, want = nu.losses(dump), nu.losses(saved)
    assert sorted(got) == sorted(want) == list(range(1, 41))  # redone steps replaced, not duplicated
    diffs = nu.rel_diffs(want, got)
    assert max(diffs.values()) <= SAME_LAYOUT_RTOL, diffs


@nu.needs_gpus(2)
def test_adamw_triton_kernel_matches_torch_kernel_under_fsdp(jobs):
    """``TritonAdamW`` on FSDP 2's sharded parameters (DTensor shards) steps like torch's fused kernel: the two
    runs differ only by the update's float32 rounding, within the layouts' bounds; the log says which tensors
    the kernel took (none on CPU, where the plumbing check runs torch's kernel under either name)."""
    torch_run, triton_run = jobs["adamw_torch"].result(), jobs["adamw_triton"].result()
    nu.assert_close_losses("adamw_triton", torch_run, triton_run, **TOL)
    assert "optimizer: AdamW (torch's fused kernel)" in nu.log_tail(torch_run, 10**7)
    taken = re.search(r"optimizer: TritonAdamW \(Triton kernel on (\d+) of (\d+) parameter tensors",
                      nu.log_tail(triton_run, 10**7))
    assert taken, nu.log_tail(triton_run)
    assert int(taken[1]) >= (0 if nu.ON_CPU else 24), taken[0]  # on the GPUs: at least the 8 blocks x 3 FFN matrices

