"""Context parallelism composed with float8 through the real trainer on gloo, float8 emulated
(``float8.emulate``: torchao's tensorwise casts and scales, the GEMMs in float32 on the float8-rounded operands).

One process: the trainer's float8 run equals the float32 trainer's model converted by hand, and departs from
float32 by float8's rounding. Under CP each rank's Float8Linear takes the tensorwise amax of its own tokens (its
activations and, backward, its output gradients; a weight's amax is the whole tensor's, FSDP gathers it
first), so its inputs are rounded on other scales than one process's amax over the whole sequence: CP with
float8 is not bitwise one process, unlike CP in float32 (test_context_parallel_runs.py). The first step is
checked exactly against one process whose linears cast each CP rank's tokens apart; the later steps track
float8 one process within float8's own noise."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from float8_utils import needs_torchao
from trainer_utils import TINY, losses, read_metrics, run_trainer

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.parallel.cp_layout import layout_order, local_indices
from torchtitan_ext.quant.float8 import convert_to_float8
from torchtitan_ext.train.preemption import handlers_restored
from torchtitan_ext.train.trainer import Trainer

pytestmark = needs_torchao

F8 = ["--float8.enabled", "true", "--float8.emulate", "true"]
CONVERTED = "float8 tensorwise: 28 linears converted, 1 kept in bf16 (emulated"  # the debug model's 4 x 7 linears
SEQ_LEN = 64  # trainer_utils.TINY's
# Steps 2-5. Float8 turns float32's last-bit differences into whole rounding steps of some elements (e4m3 keeps 3
# mantissa bits), which then grow with training: ring and all-to-all, whose per-rank scales are the same, part by
# ~1e-4 within 5 steps, and data parallelism alone (per-rank amaxes too) parts from one process by ~1e-3, the
# size of float8's whole departure from float32 here. So later steps are held to that size, not float32's 1e-5;
# the gradient norm, a sum of squares, moves several times more.
LOSS_RTOL, GN_RTOL = 5e-3, 2e-2
# Step 1 against the per-rank-scales reference: float32 summation order only; in the gradient norm it may also
# flip the e5m2 rounding (2 mantissa bits) of a few output-gradient elements whose scale came out a bit apart.
FIRST_STEP_RTOL = (2e-6, 2e-5)  # (loss, gradient norm)


def _cp(scheme: str, dp_shard: int = 1) -> list[str]:
    """CP 2 x dp_shard ranks (FSDP shards over dp_shard x cp) with the reference's global batch (4 sequences)."""
    return ["--parallelism.cp", "2", "--parallelism.cp_scheme", scheme, "--parallelism.dp_shard", str(dp_shard),
            "--training.local_batch_size", str(4 // dp_shard)]


def _log(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


class _CastPerCPRank(nn.Module):
    """A Float8Linear applied to each CP rank's tokens apart (``cp_layout.local_indices``, every sequence of the
    batch): each call takes the tensorwise amax of that rank's tokens only, forward and backward, as the rank's
    own linear does under CP (FSDP 1 x CP: every rank holds the whole batch)."""

    def __init__(self, linear: nn.Module, cp: int):
        super().__init__()
        self.linear = linear
        self.ranks = [local_indices(SEQ_LEN, cp, r) for r in range(cp)]
        self.natural = torch.argsort(layout_order(SEQ_LEN, cp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.linear(x[:, idx]) for idx in self.ranks], dim=1)[:, self.natural]


def _float8_by_hand(dump: Path, steps: int, monkeypatch, cp_scales: int = 1) -> list[tuple[float, float]]:
    """(loss, gradient norm) of ``steps`` steps of the float32 trainer in this process, its model converted by hand
    with ``convert_to_float8(emulate=True)`` after it is built; with ``cp_scales`` > 1 each Float8Linear casts the
    tokens of each of that many CP ranks apart (``_CastPerCPRank``)."""
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.delenv("RANK", raising=False)  # a plain single process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the jobs' threads: float32 sums in their order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer, results = None, []
    try:
        trainer = Trainer(parse_args([*TINY, "--job.dump_folder", str(dump)]))
        model = trainer.model_parts[0]
        assert len(convert_to_float8(model, Float8Section(enabled=True), emulate=True, log=lambda s: None)) == 28
        if cp_scales > 1:
            for module in list(model.modules()):
                for name, child in list(module.named_children()):
                    if isinstance(child, Float8Linear):
                        setattr(module, name, _CastPerCPRank(child, cp_scales))
        for step in range(1, steps + 1):
            trainer.step = step
            results.append(trainer.train_step()[:2])
        return results
    finally:
        torch.set_num_threads(threads)
        if trainer is not None:
            trainer.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def float8_one_process(tmp_path_factory):
    """The tiny job (trainer_utils.TINY, 5 steps) in float8, emulated, one process: (dump folder, its log)."""
    dump = tmp_path_factory.mktemp("float8_one_process")
    return dump, _log(run_trainer(dump, 0, *F8))


@pytest.fixture(scope="module")
def cp2_ring_float8(tmp_path_factory):
    """FSDP 1 x CP 2 (ring) in float8, emulated: (dump folder, its ranks' log)."""
    dump = tmp_path_factory.mktemp("cp2_ring_float8")
    return dump, _log(run_trainer(dump, 2, *_cp("ring"), *F8))


@pytest.fixture(scope="module")
def cp2_scales_step1(tmp_path_factory):
    """Step 1's (loss, gradient norm) in one process with each CP 2 rank's tokens cast apart."""
    with pytest.MonkeyPatch.context() as monkeypatch, handlers_restored():
        return _float8_by_hand(tmp_path_factory.mktemp("cp2_scales") / "run", 1, monkeypatch, cp_scales=2)[0]


def _track(dump: Path, float8_reference: Path, step1: tuple[float, float] | None = None) -> None:
    """``dump``'s step 1 equals ``step1`` (one process with CP's per-rank scales) where given; every step tracks
    float8 one process within the tolerances above; gradient norms finite; the loss falls."""
    f8, got = read_metrics(float8_reference), read_metrics(dump)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    if step1 is not None:
        for key, want, rtol in zip(("loss", "grad_norm"), step1, FIRST_STEP_RTOL, strict=True):
            assert got[0][key] == pytest.approx(want, rel=rtol), key
    for r, g in zip(f8, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=LOSS_RTOL), r["step"]
        assert math.isfinite(g["grad_norm"]) and g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GN_RTOL)
    assert got[-1]["loss"] < 0.7 * got[0]["loss"]


def test_float8_emulated_trains_in_one_process(float8_one_process, tiny_one_process):
    """Every block linear converted; each loss a little off float32's (the casts ran), within float8's 1%; the
    loss falls."""
    dump, log = float8_one_process
    assert CONVERTED in log, log[-3000:]
    f8, f32 = losses(dump), losses(tiny_one_process)
    assert sorted(f8) == [1, 2, 3, 4, 5]
    for step, loss in f8.items():
        assert 0 < abs(loss - f32[step]) < 0.01 * f32[step], step
    assert f8[5] < 0.7 * f8[1]


def test_trainer_float8_equals_converting_by_hand(float8_one_process, tmp_path, monkeypatch,
                                                  restore_signal_handlers):
    """The float32 trainer's model converted by hand after it is built trains exactly as the trainer's float8 job
    (converted on the meta model before parallelize): the same losses and gradient norms for 5 steps."""
    reference = [(r["loss"], r["grad_norm"]) for r in read_metrics(float8_one_process[0])]
    for step, (got, want) in enumerate(zip(_float8_by_hand(tmp_path / "run", 5, monkeypatch), reference,
                                           strict=True), start=1):
        assert got == pytest.approx(want, rel=1e-6), step


def test_per_rank_scales_change_step_one(float8_one_process, cp2_scales_step1):
    """The CP references' step 1 is not one process's: per-rank amaxes move the loss and the gradient norm by
    several times the first-step tolerances (else the first-step CP checks would not see the scales)."""
    one = read_metrics(float8_one_process[0])[0]
    for got, plain, rtol in zip(cp2_scales_step1, (one["loss"], one["grad_norm"]), FIRST_STEP_RTOL, strict=True):
        assert abs(got - plain) > 5 * rtol * abs(plain)


def test_cp2_ring_float8_tracks_one_process(cp2_ring_float8, float8_one_process, cp2_scales_step1):
    dump, log = cp2_ring_float8
    assert CONVERTED in log, log[-3000:]  # rank 0 logs
    _track(dump, float8_one_process[0], cp2_scales_step1)


def test_cp2_alltoall_float8_tracks_one_process(float8_one_process, cp2_scales_step1, tmp_path):
    log = _log(run_trainer(tmp_path, 2, *_cp("alltoall"), *F8))
    assert CONVERTED in log, log[-3000:]
    _track(tmp_path, float8_one_process[0], cp2_scales_step1)


def test_cp2_float8_all_gather_equals_high_precision_all_gather(cp2_ring_float8, tmp_path):
    """FSDP's float8 all-gather under CP (each shard cast on the whole weight's amax, one fused amax after each
    step) rounds every weight element as the cast after a float32 all-gather does: the same run."""
    run_trainer(tmp_path, 2, *_cp("ring"), *F8, "--float8.enable_fsdp_float8_all_gather", "true",
                "--float8.precompute_float8_dynamic_scale_for_fsdp", "true")
    ref, got = read_metrics(cp2_ring_float8[0]), read_metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for r, g in zip(ref, got, strict=True):
        assert (g["loss"], g["grad_norm"]) == pytest.approx((r["loss"], r["grad_norm"]), rel=1e-6), r["step"]


@pytest.mark.slow
def test_fsdp2_cp2_float8_tracks_one_process(float8_one_process, tmp_path):
    """FSDP 2 x CP 2 (all-to-all) on 4 ranks, weights all-gathered in float8: each rank's amax covers a quarter
    of the batch's tokens, so only the tracking tolerance applies."""
    run_trainer(tmp_path, 4, *_cp("alltoall", dp_shard=2), *F8, "--float8.enable_fsdp_float8_all_gather", "true",
                "--float8.precompute_float8_dynamic_scale_for_fsdp", "true")
    _track(tmp_path, float8_one_process[0])


@pytest.mark.slow
def test_cp2_ring_compiled_float8_tracks_one_process(float8_one_process, tmp_path):
    """Compiled blocks around the eager ring attention, the float8 casts inside the graphs (fused by Inductor, so
    not bitwise eager's: only the tracking tolerance applies)."""
    run_trainer(tmp_path, 2, *_cp("ring"), *F8, "--training.compile", "true")
    _track(tmp_path, float8_one_process[0])
