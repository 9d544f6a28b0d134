"""Expert parallelism on real GPUs (NCCL): a MoDE model trained at EP 2 and EP 4 against EP 1 on the same GPUs
(same data-parallel degree, so the same tokens per rank and the same balancing losses), eager and compiled, in
float32 (nccl_utils.JOB says why), 10 steps; also compiled with full activation checkpointing (the recomputation
replays the forward's routes: no count exchange, no host read) and with a shared expert (computed while the
dispatch all-to-all is in flight).

The jobs start together in one ``nccl_utils.JobPool`` (several small jobs share each GPU). About two to three
minutes on 4 H100s; on 2 GPUs only the EP 2 comparisons run. Tolerances as in ``test_layouts_nccl.py``
(float32, each layout sums in its own order: ``nccl_utils.FLOAT32_TOL``); the first step's
routing (the expert load imbalance of every layer) within 1% of EP 1's. ``training.deterministic`` is off:
run-to-run noise is far below the layouts' differences, and EP's index kernels need no deterministic variant.
``MULTIGPU_REPORT=FILE`` appends each comparison's largest differences as JSON lines.
"""

from __future__ import annotations

from concurrent.futures import Future

import nccl_utils as nu
import pytest

pytestmark = pytest.mark.multigpu

TOL = nu.FLOAT32_TOL

NPROC = 4 if nu.GPUS >= 4 else 2
# mode_debug's MoDE blocks on nccl_utils' job: width 512, 4 layers, 8 experts of hidden 512, top-2.
MODE = ["--model.flavor", "mode_debug", "--model.n_layers", "4", "--model.n_experts", "8",
        "--model.moe_hidden", "512", "--training.steps", "10", "--training.deterministic", "false",
        "--parallelism.dp_shard", str(NPROC), "--training.local_batch_size", str(nu.GLOBAL_BATCH // NPROC)]
SHARED = ["--model.shared_expert", "true"]
FULL_AC = ["--activation_checkpoint.mode", "full"]

# name -> (its EP 1 reference, ep degree, compiled, extra overrides)
CASES = {
    "ep2_eager": ("ep1_eager", 2, False, []),
    "ep4_eager": ("ep1_eager", 4, False, []),
    "ep2_compiled": ("ep1_compiled", 2, True, []),
    "ep4_compiled": ("ep1_compiled", 4, True, []),
    "ep4_compiled_ac": ("ep1_compiled", 4, True, FULL_AC),
    "ep4_compiled_shared": ("ep1_compiled_shared", 4, True, SHARED),
}
REFERENCES = {"ep1_eager": (False, []), "ep1_compiled": (True, []), "ep1_compiled_shared": (True, SHARED)}


def _overrides(ep: int, compiled: bool, extra: list[str]) -> list[str]:
    return [*MODE, "--parallelism.ep", str(ep), *(nu.COMPILE if compiled else []), *extra]


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict[str, Future]:
    """Every job the selected (not skipped) tests need, started at once."""
    selected = [i for i in request.session.items if i.module is request.module
                and not any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0])
                            for m in i.iter_markers())]
    cases = {i.callspec.params["case"] for i in selected}
    wanted = cases | {CASES[c][0] for c in cases}
    root = tmp_path_factory.mktemp("ep_nccl")
    pool = nu.JobPool()
    futures = {}
    for name in sorted(wanted):
        if name in REFERENCES:
            compiled, extra = REFERENCES[name]
            futures[name] = pool.run(root / name, NPROC, *_overrides(1, compiled, extra))
        else:
            _, ep, compiled, extra = CASES[name]
            futures[name] = pool.run(root / name, NPROC, *_overrides(ep, compiled, extra))
    yield futures
    pool.shutdown()


def _cases():
    return [pytest.param(name, marks=nu.needs_gpus(ep), id=name) for name, (_, ep, _, _) in CASES.items()]


@pytest.mark.parametrize("case", _cases())
def test_expert_parallel_matches_ep1(jobs, case):
    reference = jobs[CASES[case][0]].result()
    dump = jobs[case].result()
    nu.assert_close_losses(case, reference, dump, **TOL)
    ref, got = nu.read_metrics(reference), nu.read_metrics(dump)
    assert len(got) == 10
    imbalance = sorted(k for k in ref[0] if k.endswith("/imbalance"))
    assert len(imbalance) == 4, ref[0].keys()  # every MoDE layer logs its load
    for key in imbalance:  # step 1: the same routing as EP 1 (up to bf16 near-ties flipped by summation order)
        assert got[0][key] == pytest.approx(ref[0][key], rel=1e-2), key
    first, last = ref[0]["loss"], ref[-1]["loss"]
    assert last < 0.9 * first, f"the reference barely learns ({first:.3f} -> {last:.3f}): the comparison is empty"
