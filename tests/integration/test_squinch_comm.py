"""Squinch collectives on real gloo processes against a one-process reference built from the same inputs.

Each worker records the exact tensors handed to the Squinch DDP hook / FSDP2 reduce-scatter / HSDP replicate
hook (by wrapping the registration, not the code under test) and what came out; the reference re-encodes
those inputs chunk by chunk with the codec, routes the chunks by hand, sums in float32 and compares.

HSDP (4 processes: dp_replicate 2 x dp_shard 2): the overlapped replicate hooks (one per FSDP module, run by
FSDP2 after that module's reduce-scatter) against the same reference, and against the post-backward
all-reduce and uncompressed native HSDP within Squinch's error bound. On gloo FSDP2 runs the hook on the
calling thread with no streams (CPU), so the overlap itself (the all-reduce stream) is only exercised on
NCCL: ``tests/multigpu/test_squinch_nccl.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_utils import run_distributed

from torchtitan_ext.comm.compressed_collectives import (
    CommStats,
    SquinchReplicateAllReduce,
    _compressed_all_reduce,
    apply_squinch_fsdp,
    install_squinch_replicate_hooks,
    owned_chunk,
    register_squinch_ddp_hook,
)
from torchtitan_ext.comm.squinch import decode, encode

MIN_NUMEL = 64  # the weights (481 and 259 values) are compressed, the biases (37 and 7) are not
NAN_STEP = 2  # error-feedback runs feed a NaN input at this step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 7))


def _batch(rank: int, step: int, nan: bool = False) -> torch.Tensor:
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(1000 * step + rank))
    if nan:
        x[0, 0] = float("nan")
    return x


def _local_grads(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rank's own gradient, without any data parallelism."""
    model = _model()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------- workers

def _ddp_run(rank: int, min_numel: int, error_feedback: bool, steps: int) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())
    names = {p: n for n, p in ddp.module.named_parameters()}
    record: list[dict] = []
    register = ddp.register_comm_hook

    def register_recording(state, hook):
        def recording_hook(st, bucket):
            grads = zip(bucket.parameters(), bucket.gradients(), strict=True)
            record[-1]["buckets"].append([(names[p], g.detach().clone()) for p, g in grads])
            return hook(st, bucket)
        register(state, recording_hook)

    ddp.register_comm_hook = register_recording
    stats = CommStats()
    register_squinch_ddp_hook(ddp, dist.group.WORLD, min_numel=min_numel, error_feedback=error_feedback,
                              stats=stats)
    for step in range(steps):
        record.append({"buckets": []})
        ddp.zero_grad(set_to_none=True)
        x = _batch(rank, step, nan=error_feedback and step == NAN_STEP)
        ddp(x).square().mean().backward()
        record[-1]["grads"] = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        record[-1]["local"] = _local_grads(x)
        record[-1]["stats"] = stats.as_dict()
        stats.reset()
    return record



def _replicate_run(rank: int, min_numel: int, error_feedback: bool, steps: int) -> list[dict]:
    """HSDP's replicate all-reduce after the backward pass: every gradient of the model in one call, in
    parameter order, recorded like a DDP bucket so the DDP reference checks it."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    stats = CommStats()
    reduce = SquinchReplicateAllReduce(list(model.parameters()), dist.group.WORLD, min_numel=min_numel,
                                       error_feedback=error_feedback, stats=stats)
    record: list[dict] = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        x = _batch(rank, step, nan=error_feedback and step == NAN_STEP)
        model(x).square().mean().backward()
        bucket = [(n, p.grad.clone()) for n, p in zip(names, model.parameters(), strict=True)]
        reduce()
        record.append({"buckets": [bucket], "local": dict(bucket), "stats": stats.as_dict(),
                       "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        stats.reset()
    return record


class _Recorder:
    """Stands in front of the installed reduce-scatter to log its input and output tensors."""

    def __init__(self, comm, module: str, record: list[dict]) -> None:
        self.comm, self.module, self.record = comm, module, record

    def allocate(self, *args, **kwargs) -> torch.Tensor:
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        entry = {"module": self.module, "input": input_tensor.clone()}
        work = self.comm(output_tensor, input_tensor, group, op, async_op)
        entry["output"] = output_tensor.clone()
        self.record[-1]["calls"].append(entry)
        return work


def _fsdp_run(rank: int, min_numel: int, error_feedback: bool, steps: int, dtype: torch.dtype,
              divide_factor: float | None) -> list[dict]:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = _model()
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mp_policy=mp)
    record: list[dict] = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            install = module.set_custom_reduce_scatter
            module.set_custom_reduce_scatter = (
                lambda comm, install=install, name=name: install(_Recorder(comm, name, record)))
            if divide_factor is not None:
                module.set_gradient_divide_factor(divide_factor)
    stats = CommStats()
    apply_squinch_fsdp(model, min_numel=min_numel, error_feedback=error_feedback, stats=stats)
    for step in range(steps):
        record.append({"calls": []})
        model.zero_grad(set_to_none=True)
        x = _batch(rank, step, nan=error_feedback and step == NAN_STEP)
        model(x).float().square().mean().backward()
        record[-1]["grads"] = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
        record[-1]["stats"] = stats.as_dict()
        stats.reset()
    return record


class _HookRecorder:
    """Stands in front of an installed all-reduce hook to log the shard it is given and what it leaves."""

    def __init__(self, hook, module: str, record: list[dict]) -> None:
        self.hook, self.module, self.record = hook, module, record

    def __call__(self, reduce_output: torch.Tensor) -> None:
        entry = {"module": self.module, "input": reduce_output.clone()}
        self.hook(reduce_output)
        entry["output"] = reduce_output.clone()
        self.record[-1]["calls"].append(entry)


def _hsdp_run(rank: int, world_size: int, mode: str, min_numel: int, error_feedback: bool,
              steps: int, replicas: int = 2) -> list[dict]:
    """HSDP over dp_replicate ``replicas`` x dp_shard the rest. ``mode``: "overlap" (the replicate hooks,
    recorded), "post" (the replicate all-reduce after the backward pass) or "native" (FSDP2's own uncompressed
    HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))
    group = mesh["dp_replicate"].get_group()
    model = _model()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh if mode == "native" else mesh["dp_shard"])
    record: list[dict] = []
    stats = CommStats()
    options = {"min_numel": min_numel, "error_feedback": error_feedback, "stats": stats}
    after_backward = SquinchReplicateAllReduce(list(model.parameters()), group, **options) if mode == "post" else None
    if mode == "overlap":
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                install = module.set_all_reduce_hook
                module.set_all_reduce_hook = (
                    lambda hook, install=install, name=name: install(_HookRecorder(hook, name, record)))
        install_squinch_replicate_hooks(model, group, **options)
    for step in range(steps):
        record.append({"calls": []})
        model.zero_grad(set_to_none=True)
        model(_batch(rank, step, nan=error_feedback and step == NAN_STEP)).square().mean().backward()
        if after_backward is not None:
            after_backward()
        record[-1]["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        record[-1]["stats"] = stats.as_dict()
        stats.reset()
    return record


DRIFT_STEPS, DRIFT_NUMEL = 300, 4096


def _rms(x: torch.Tensor) -> float:
    return x.square().mean().sqrt().item()


def _drift_run(rank: int, world_size: int, owner_feedback: bool) -> dict[str, float]:
    """The compressed all-reduce over DRIFT_STEPS steps of random per-rank gradients, with error feedback on
    the rows and (``owner_feedback``) on the owner's average: the RMS of (sum of the averages - exact sum)
    at the end, and the largest RMS of one step's error, in float64."""
    gen = torch.Generator().manual_seed(rank)
    residual = torch.zeros(DRIFT_NUMEL)
    owner = torch.zeros(owned_chunk(DRIFT_NUMEL, world_size)) if owner_feedback else None
    drift = torch.zeros(DRIFT_NUMEL, dtype=torch.float64)
    one_step = 0.0
    for _ in range(DRIFT_STEPS):
        grad = torch.randn(DRIFT_NUMEL, generator=gen) * (1 + torch.rand(DRIFT_NUMEL, generator=gen))
        exact = grad.double()
        dist.all_reduce(exact)
        averaged, residual, owner = _compressed_all_reduce(grad, dist.group.WORLD, CommStats(), torch.float32,
                                                           residual, owner)
        error = averaged.double() - exact / world_size
        drift += error
        one_step = max(one_step, _rms(error))
    return {"drift": _rms(drift), "one_step": one_step}


def _worker(rank: int, world_size: int) -> dict[str, dict[str, list[dict]]]:
    """All scenarios in one spawn per world size: starting the processes costs more than the runs."""
    ddp = {
        "plain": _ddp_run(rank, MIN_NUMEL, error_feedback=False, steps=2),
        "ef": _ddp_run(rank, MIN_NUMEL, error_feedback=True, steps=4),
        "bypass": _ddp_run(rank, 10**9, error_feedback=False, steps=1),
    }
    fsdp = {
        "plain": _fsdp_run(rank, MIN_NUMEL, False, 2, torch.float32, None),
        "ef": _fsdp_run(rank, MIN_NUMEL, True, 4, torch.float32, None),
        "bf16": _fsdp_run(rank, MIN_NUMEL, False, 1, torch.bfloat16, None),
        "divide": _fsdp_run(rank, MIN_NUMEL, False, 1, torch.float32, 3.0),
        "bypass": _fsdp_run(rank, 10**9, False, 1, torch.float32, None),
    }
    replicate = {
        "plain": _replicate_run(rank, MIN_NUMEL, error_feedback=False, steps=2),
        "ef": _replicate_run(rank, MIN_NUMEL, error_feedback=True, steps=4),
    }
    hsdp = {
        "overlap": _hsdp_run(rank, world_size, "overlap", MIN_NUMEL, False, 2),
        "overlap_ef": _hsdp_run(rank, world_size, "overlap", MIN_NUMEL, True, 4),
        "overlap_bypass": _hsdp_run(rank, world_size, "overlap", 10**9, False, 1),
        "post": _hsdp_run(rank, world_size, "post", MIN_NUMEL, False, 2),
        "native": _hsdp_run(rank, world_size, "native", MIN_NUMEL, False, 2),
    }
    if world_size == 4:  # four replicas: the all-to-all + all-gather, with the owner's residual
        hsdp["overlap_ef_4x1"] = _hsdp_run(rank, world_size, "overlap", MIN_NUMEL, True, 4, replicas=4)
    drift = {"double": [_drift_run(rank, world_size, True)], "rows_only": [_drift_run(rank, world_size, False)]}
    return {"ddp": ddp, "fsdp": fsdp, "replicate": replicate, "hsdp": hsdp, "drift": drift}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request) -> tuple[int, dict[str, dict[str, list[list[dict]]]]]:
    """(world size, {"ddp" / "fsdp" / "replicate" / "hsdp": {scenario: per-rank list of per-step records}})."""
    per_rank = run_distributed(_worker, request.param)
    return request.param, {
        kind: {scenario: [r[kind][scenario] for r in per_rank] for scenario in per_rank[0][kind]}
        for kind in ("ddp", "fsdp", "replicate", "hsdp", "drift")
    }


@pytest.fixture
def ddp_runs(results) -> tuple[int, dict[str, list[list[dict]]]]:
    return results[0], results[1]["ddp"]


@pytest.fixture
def fsdp_runs(results) -> tuple[int, dict[str, list[list[dict]]]]:
    return results[0], results[1]["fsdp"]


# --------------------------------------------------------------------------------------------- reference

def _roundtrip(chunk: torch.Tensor) -> torch.Tensor:
    return decode(encode(chunk), chunk.numel())


def _ref_send(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (world, c) rows as each destination decodes them, and the error-feedback residual."""
    sent = torch.stack([_roundtrip(row) for row in rows])
    residual = rows - sent
    return sent, torch.where(residual.isfinite(), residual, 0.0)


def _ref_sum(sent: list[torch.Tensor]) -> torch.Tensor:
    """(world, c): row d is destination d's float32 sum of the chunks it received, in rank order."""
    world = len(sent)
    return torch.stack([torch.stack([sent[r][d] for r in range(world)]).sum(0) for d in range(world)])


def _exact_mean(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([v.double() for v in values]).mean(0)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-6, atol=1e-7, equal_nan=True)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


# ----------------------------------------------------------------------------------------------- DDP

def _ddp_reference(runs: list[list[dict]], error_feedback: bool, owner_feedback: bool = False) -> None:
    """Check every step's gradients on every rank against the compressed all-reduce done by hand;
    ``owner_feedback``: the owners keep the residual of their average's encoding too (the HSDP hooks)."""
    world = len(runs)
    residuals: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]  # per rank, per parameter
    owner_residuals: dict[str, torch.Tensor] = {}  # (world, chunk): row d owner d's, by the group's first name
    for step in range(len(runs[0])):
        steps = [run[step] for run in runs]
        for b, bucket in enumerate(steps[0]["buckets"]):
            names = [n for n, _ in bucket]
            inputs = [dict(s["buckets"][b]) for s in steps]
            for rank in range(world):
                for n in names:  # what the hook was given is the rank's own gradient
                    _close(inputs[rank][n], steps[rank]["local"][n])
            large = [n for n in names if inputs[0][n].numel() >= MIN_NUMEL]
            for n in names:
                if n not in large:  # below min_numel: a plain all-reduce, exact to fp32 rounding
                    expected = _exact_mean([i[n] for i in inputs])
                    for s in steps:
                        _close(s["grads"][n], expected)
            if not large:
                continue
            sizes = [inputs[0][n].numel() for n in large]
            n_total = sum(sizes)
            chunk = math.ceil(math.ceil(n_total / world) / 8) * 8
            sent = []
            for rank in range(world):
                flat = torch.cat([inputs[rank][n].reshape(-1).float() for n in large])
                if error_feedback:
                    flat = flat + torch.cat([residuals[rank].get(n, torch.zeros(k))
                                             for n, k in zip(large, sizes, strict=True)])
                rows = torch.nn.functional.pad(flat, (0, world * chunk - n_total)).view(world, chunk)
                decoded, residual = _ref_send(rows)
                sent.append(decoded)
                residuals[rank].update(zip(large, residual.reshape(-1)[:n_total].split(sizes), strict=True))
            owned_mean = _ref_sum(sent) / world
            if world == 2:  # one all-gather of the encoded rows, the mean not encoded again
                result = owned_mean.reshape(-1)[:n_total]
            else:
                if owner_feedback:  # the owners' residuals of their last encoding of the same group
                    kept = owner_residuals.get(large[0])
                    owned_mean = owned_mean + (kept if kept is not None and kept.shape == owned_mean.shape else 0.0)
                gathered = torch.stack([_roundtrip(row) for row in owned_mean])
                owner_residuals[large[0]] = torch.nan_to_num(owned_mean - gathered, nan=0.0, posinf=0.0,
                                                             neginf=0.0)
                result = gathered.reshape(-1)[:n_total]
            expected = dict(zip(large, result.split(sizes), strict=True))
            for s in steps:
                for n in large:
                    _close(s["grads"][n], expected[n].view_as(s["grads"][n]))
                    if step != NAN_STEP or not error_feedback:
                        assert _rel_err(s["grads"][n], _exact_mean([i[n] for i in inputs])) < 0.2


def test_ddp_hook_matches_one_process_reference(ddp_runs):
    _, runs = ddp_runs
    _ddp_reference(runs["plain"], error_feedback=False)
    grads = runs["plain"][0][0]["grads"]["0.weight"]
    exact = _exact_mean([r[0]["local"]["0.weight"] for r in runs["plain"]])
    assert not torch.equal(grads.double(), exact), "the weight went through uncompressed"


def test_ddp_error_feedback_and_non_finite(ddp_runs):
    _, runs = ddp_runs
    _ddp_reference(runs["ef"], error_feedback=True)
    plain, ef = runs["plain"][0], runs["ef"][0]
    assert torch.equal(ef[0]["grads"]["0.weight"], plain[0]["grads"]["0.weight"]), "no residual at step 0"
    assert not torch.equal(ef[1]["grads"]["0.weight"], plain[1]["grads"]["0.weight"]), "residual unused"
    assert not ef[NAN_STEP]["grads"]["0.weight"].isfinite().all(), "a NaN gradient must stay visible"
    assert all(g.isfinite().all() for g in ef[NAN_STEP + 1]["grads"].values()), "NaN leaked into residual"


def test_double_error_feedback_bounds_the_summed_error(results):
    """With both residuals the averages summed over 300 steps telescope to the exact sum minus the last
    residuals: within one step's error. Over 4 ranks, with the rows' residual alone the owner's 300 encoding
    errors add up like a random walk (the behaviour before double error feedback). Between 2 ranks the mean is
    not encoded again (one all-gather of the encoded rows): the rows' residual alone bounds it."""
    world = results[0]
    for double, rows_only in zip(results[1]["drift"]["double"], results[1]["drift"]["rows_only"], strict=True):
        double, rows_only = double[0], rows_only[0]
        assert double["drift"] <= 2 * double["one_step"], double
        if world == 2:
            assert rows_only["drift"] <= 2 * rows_only["one_step"], rows_only
        else:
            assert rows_only["drift"] > 5 * rows_only["one_step"], rows_only


def test_replicate_all_reduce_matches_one_process_reference(results):
    """HSDP with Squinch averages the gradient shards over dp_replicate after the backward pass: the same
    compressed all-reduce as the DDP hook, checked the same way, with and without error feedback."""
    runs = results[1]["replicate"]
    _ddp_reference(runs["plain"], error_feedback=False)
    _ddp_reference(runs["ef"], error_feedback=True)
    assert not runs["ef"][0][NAN_STEP]["grads"]["0.weight"].isfinite().all(), "a NaN gradient must stay visible"
    assert all(g.isfinite().all() for g in runs["ef"][0][NAN_STEP + 1]["grads"].values())
    assert runs["plain"][0][0]["stats"]["comm/bytes_sent"] < runs["plain"][0][0]["stats"]["comm/bytes_uncompressed"]


def test_ddp_min_numel_bypass_is_exact(ddp_runs):
    _, runs = ddp_runs
    for n, _ in runs["bypass"][0][0]["buckets"][0]:
        expected = _exact_mean([r[0]["local"][n] for r in runs["bypass"]])
        for r in runs["bypass"]:
            _close(r[0]["grads"][n], expected)


def test_ddp_stats_count_collective_bytes(ddp_runs):
    world, runs = ddp_runs
    for step in runs["plain"][0]:
        sent = uncompressed = 0
        for bucket in step["buckets"]:
            numels = [g.numel() for _, g in bucket]
            small = sum(n for n in numels if n < MIN_NUMEL)
            large = sum(n for n in numels if n >= MIN_NUMEL)
            if world == 2:  # one all-gather of the whole encoded bucket, 6 bytes per 8 values
                blocks = math.ceil(large / 8)
                sent += 4 * small + 6 * blocks
                uncompressed += 4 * small + 4 * 8 * blocks
            else:  # an all-to-all of world chunks and an all-gather of one
                chunk = math.ceil(math.ceil(large / world) / 8) * 8
                sent += 4 * small + 6 * (chunk // 8) * (world + 1)
                uncompressed += 4 * small + 4 * chunk * (world + 1)
        assert step["stats"] == {"comm/bytes_sent": sent, "comm/bytes_uncompressed": uncompressed}
        assert (sent - 4 * 44) / (uncompressed - 4 * 44) == 6 / 32
    bypass = runs["bypass"][0][0]["stats"]
    assert bypass["comm/bytes_sent"] == bypass["comm/bytes_uncompressed"] == 4 * (481 + 37 + 259 + 7)


# ---------------------------------------------------------------------------------------------- FSDP2

def _fsdp_reference(runs: list[list[dict]], error_feedback: bool, divide: float) -> None:
    world = len(runs)
    residuals: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]  # per rank, per FSDP module
    for step in range(len(runs[0])):
        calls = [run[step]["calls"] for run in runs]
        assert len(calls[0]) == 2  # one reduce-scatter per sharded Linear, none for the parameterless root
        for c, call in enumerate(calls[0]):
            sent = []
            for rank in range(world):
                rows = calls[rank][c]["input"].float().view(world, -1)
                if error_feedback:
                    rows = rows + residuals[rank].get(call["module"], torch.zeros_like(rows))
                decoded, residuals[rank][call["module"]] = _ref_send(rows)
                sent.append(decoded)
            expected = _ref_sum(sent) / divide
            for rank in range(world):
                out = calls[rank][c]["output"]
                _close(out, expected[rank].to(out.dtype))


def _fsdp_end_to_end(runs: list[list[dict]], tol: float) -> None:
    """The resulting gradients are near the exact mean of the ranks' own gradients."""
    world = len(runs)
    for step, state in enumerate(runs[0]):
        local = [_local_grads(_batch(r, step)) for r in range(world)]
        for n, g in state["grads"].items():
            assert _rel_err(g, _exact_mean([lg[n] for lg in local])) < tol, n


def test_fsdp_reduce_scatter_matches_one_process_reference(fsdp_runs):
    world, runs = fsdp_runs
    _fsdp_reference(runs["plain"], error_feedback=False, divide=world)
    _fsdp_end_to_end(runs["plain"], tol=0.2)
    _fsdp_reference(runs["bf16"], error_feedback=False, divide=world)
    assert runs["bf16"][0][0]["calls"][0]["output"].dtype == torch.bfloat16


def test_fsdp_respects_gradient_divide_factor(fsdp_runs):
    _, runs = fsdp_runs
    _fsdp_reference(runs["divide"], error_feedback=False, divide=3.0)


def test_fsdp_error_feedback_and_non_finite(fsdp_runs):
    world, runs = fsdp_runs
    _fsdp_reference(runs["ef"], error_feedback=True, divide=world)
    plain, ef = runs["plain"][0], runs["ef"][0]
    assert torch.equal(ef[0]["calls"][0]["output"], plain[0]["calls"][0]["output"])
    assert not torch.equal(ef[1]["calls"][0]["output"], plain[1]["calls"][0]["output"])
    assert not all(c["output"].isfinite().all() for c in ef[NAN_STEP]["calls"])
    assert all(c["output"].isfinite().all() for c in ef[NAN_STEP + 1]["calls"])


def test_fsdp_min_numel_bypass_is_exact(fsdp_runs):
    world, runs = fsdp_runs
    local = [_local_grads(_batch(r, 0)) for r in range(world)]
    for n, g in runs["bypass"][0][0]["grads"].items():
        _close(g, _exact_mean([lg[n] for lg in local]))


def test_fsdp_stats_count_collective_bytes(fsdp_runs):
    world, runs = fsdp_runs
    for key, itemsize in (("plain", 4), ("bf16", 2)):
        for step in runs[key][0]:
            shards = [c["input"].numel() // world for c in step["calls"]]
            sent = sum(world * 6 * math.ceil(s / 8) for s in shards)
            uncompressed = sum(world * s * itemsize for s in shards)
            assert step["stats"] == {"comm/bytes_sent": sent, "comm/bytes_uncompressed": uncompressed}
    # 481 + 37 and 259 + 7 values, FSDP pads dim 0 (37 and 7 rows) to a multiple of the world size
    rows = [math.ceil(37 / world) * world, math.ceil(7 / world) * world]
    assert runs["plain"][0][0]["stats"]["comm/bytes_uncompressed"] == 4 * (rows[0] * 14 + rows[1] * 38)
    bypass = runs["bypass"][0][0]["stats"]
    assert bypass["comm/bytes_sent"] == bypass["comm/bytes_uncompressed"]


# ------------------------------------------------------------------------------ HSDP: overlapped replicate hooks

# Per block: |decode(encode(x)) - x| <= 0.0738 max|x| (squinch.py, derived in tests/unit/comm/test_squinch_codec.py).
SQUINCH_REL_BOUND = 0.0738


def _replica_groups(world: int) -> list[list[int]]:
    """The ranks that average one shard over dp_replicate: mesh (2, world / 2), rank = replica * shards + shard."""
    shards = world // 2
    return [[s, shards + s] for s in range(shards)]


def _hook_calls_as_buckets(runs: list[list[dict]], ranks: list[int]) -> list[list[dict]]:
    """The hook calls of ``ranks`` as the DDP reference's records: each module's shard one bucket, keyed by
    the module, its input being what the replica's reduce-scatter left and its output the hook's result."""
    return [[{"buckets": [[(c["module"], c["input"])] for c in st["calls"]],
              "local": {c["module"]: c["input"] for c in st["calls"]},
              "grads": {c["module"]: c["output"] for c in st["calls"]}} for st in runs[r]] for r in ranks]


def test_hsdp_overlapped_hooks_match_one_process_reference(results):
    """Every FSDP module's shard is averaged over its replica pair as the hand-built compressed all-reduce
    does (bit for bit up to float32 summation order), with and without error feedback, a NaN kept visible and
    not leaking into the residual; below min_numel a plain all-reduce; bytes as counted by hand."""
    world, runs = results[0], results[1]["hsdp"]
    for ranks in _replica_groups(world):
        for key, ef in (("overlap", False), ("overlap_ef", True)):
            records = _hook_calls_as_buckets(runs[key], ranks)
            assert all(len(st["buckets"]) == 2 for st in records[0])  # the two Linears; the root holds none
            _ddp_reference(records, error_feedback=ef, owner_feedback=ef)
        bypass = _hook_calls_as_buckets(runs["overlap_bypass"], ranks)
        for module, _ in bypass[0][0]["grads"].items():  # min_numel above every shard: a plain all-reduce
            expected = _exact_mean([r[0]["local"][module] for r in bypass])
            for r in bypass:
                _close(r[0]["grads"][module], expected)
    if world == 4:  # dp_replicate 4 x dp_shard 1: two encodings, double error feedback
        _ddp_reference(_hook_calls_as_buckets(runs["overlap_ef_4x1"], range(4)), error_feedback=True,
                       owner_feedback=True)
    ef = runs["overlap_ef"][0]
    assert not ef[NAN_STEP]["grads"]["0.weight"].isfinite().all(), "a NaN gradient must stay visible"
    assert all(g.isfinite().all() for g in ef[NAN_STEP + 1]["grads"].values()), "NaN leaked into residual"
    assert not torch.equal(ef[1]["grads"]["0.weight"], runs["overlap"][0][1]["grads"]["0.weight"]), "residual unused"
    for step in runs["overlap"][0]:  # two replicas: one all-gather of each module's encoded shard
        blocks = [math.ceil(c["input"].numel() / 8) for c in step["calls"]]
        assert step["stats"] == {"comm/bytes_sent": sum(6 * b for b in blocks),
                                 "comm/bytes_uncompressed": sum(4 * 8 * b for b in blocks)}
    bypass = runs["overlap_bypass"][0][0]["stats"]
    assert bypass["comm/bytes_sent"] == bypass["comm/bytes_uncompressed"]


def test_hsdp_overlapped_equals_post_backward_and_uncompressed_within_bound(results):
    """The full gradients of overlapped HSDP, post-backward HSDP and uncompressed native HSDP: native is the
    exact mean of the four ranks' own gradients; both compressed orders lie within Squinch's error bound of it.
    Bound: each replica's shard x_r is encoded (error <= 0.0738 max|x_r|), the mean of the decoded shards is
    encoded again (error <= 0.0738 max|mean|), so |compressed - exact| <= 0.0738 (2 + 0.0738) max_r max|x_r|.
    The two orders chunk the gradients differently (per module / all at once), so they agree within twice that,
    not bit for bit."""
    world, runs = results[0], results[1]["hsdp"]
    shards = world // 2
    for step in range(2):
        local = [_local_grads(_batch(r, step)) for r in range(world)]
        replicas = [{n: _exact_mean([local[r * shards + s][n] for s in range(shards)]) for n in local[0]}
                    for r in range(2)]
        biggest = max(g.abs().max().item() for x in replicas for g in x.values())
        bound = SQUINCH_REL_BOUND * (2 + SQUINCH_REL_BOUND) * biggest * (1 + 1e-5) + 1e-6 * biggest
        for rank in range(world):
            native, overlap, post = (runs[k][rank][step]["grads"] for k in ("native", "overlap", "post"))
            for n in native:
                exact = _exact_mean([lg[n] for lg in local])
                _close(native[n], exact)
                assert (overlap[n].double() - exact).abs().max().item() <= bound, (step, n)
                assert (post[n].double() - exact).abs().max().item() <= bound, (step, n)
                assert torch.equal(overlap[n], runs["overlap"][0][step]["grads"][n]), "replicas disagree"
        first = {k: runs[k][0][step]["grads"]["0.weight"] for k in ("overlap", "native")}
        assert not torch.equal(first["overlap"], first["native"]), "the weight went through uncompressed"
