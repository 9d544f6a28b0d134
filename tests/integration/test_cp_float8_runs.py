"""Context parallelism composed with float8 through the real trainer on gloo, float8 emulated
(``float8.emulate``: torchao's tensorwise casts and scales, the GEMMs in float32 on the float8-rounded operands).

One process: the trainer's float8 run equals the float32 trainer's model converted by hand, and departs from
float32 by float8's rounding. Under CP, each rank's Float8Linear takes the tensorwise amax of its own tokens
(its activations and, backward, its output gradients; the weights' amax is the whole tensor's, FSDP gathers
them first), so its inputs are rounded on another scale than one process's amax over the whole sequence: CP
with float8 is not bitwise one process, unlike CP in float32 (test_context_parallel_runs.py, 1e-5)."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
import torch.distributed as dist
from trainer_utils import TINY, losses, read_metrics, run_trainer

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.quant.float8 import convert_to_float8
from torchtitan_ext.train.trainer import Trainer

F8 = ["--float8.enabled", "true", "--float8.emulate", "true"]
CONVERTED = "float8 tensorwise: 28 linears converted, 1 kept in bf16 (emulated"  # the debug model's 4 x 7 linears
# Float8 itself moves these 5 steps' losses by up to ~2e-3 (relative) from float32: e4m3 keeps 3 mantissa bits, so
# every cast element moves by up to 2^-4 of itself. CP re-rounds the same tensors on other (per-rank) scales,
# which moves the losses by float8's own order (seen: <= 4e-4), far above float32's summation-order 1e-5: the
# bound is that order. The gradient norm, a sum of squares over every weight, moves ~10x more (seen: <= 5e-3).
# That CP's departure is float8's scale noise and not a cast left out is checked apart: its losses stay
# closer to float8 one process than to float32 one process (``_track``).
LOSS_RTOL, GN_RTOL = 2e-3, 2e-2


def _cp(scheme: str, dp_shard: int = 1) -> list[str]:
    """CP 2 x dp_shard ranks (FSDP shards over dp_shard x cp) with the reference's global batch (4 sequences)."""
    return ["--parallelism.cp", "2", "--parallelism.cp_scheme", scheme, "--parallelism.dp_shard", str(dp_shard),
            "--training.local_batch_size", str(4 // dp_shard)]


def _log(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


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


def _track(float8_reference, float32_reference, dump) -> None:
    """``dump``'s losses track float8 one process within the tolerances above, closer to it than to float32 one
    process (float8 casts ran under CP); gradient norms finite; the loss falls."""
    f8, f32, got = read_metrics(float8_reference), read_metrics(float32_reference), read_metrics(dump)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for r, g in zip(f8, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=LOSS_RTOL), r["step"]
        assert math.isfinite(g["grad_norm"]) and g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GN_RTOL)
    to_f8 = sum(abs(g["loss"] - r["loss"]) for r, g in zip(f8, got, strict=True))
    to_f32 = sum(abs(g["loss"] - r["loss"]) for r, g in zip(f32, got, strict=True))
    assert to_f8 < 0.5 * to_f32, (to_f8, to_f32)
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
    """The float32 trainer's model, converted by hand with ``convert_to_float8(emulate=True)`` after it is built,
    trains exactly as the trainer's float8 job (converted on the meta model before parallelize): same losses
    and gradient norms for 5 steps."""
    reference = read_metrics(float8_one_process[0])
    monkeypatch.delenv("RANK", raising=False)  # a plain single process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the job's threads: float32 sums in its order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = None
    try:
        trainer = Trainer(parse_args([*TINY, "--job.dump_folder", str(tmp_path / "run")]))
        converted = convert_to_float8(trainer.model_parts[0], Float8Section(enabled=True), emulate=True,
                                      log=lambda line: None)
        assert len(converted) == 28
        for r in reference:
            trainer.step = r["step"]
            loss, norm, _ = trainer.train_step()
            assert (loss, norm) == pytest.approx((r["loss"], r["grad_norm"]), rel=1e-6), r["step"]
    finally:
        torch.set_num_threads(threads)
        if trainer is not None:
            trainer.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_cp2_ring_float8_tracks_one_process(cp2_ring_float8, float8_one_process, tiny_one_process):
    dump, log = cp2_ring_float8
    assert CONVERTED in log, log[-3000:]  # rank 0 logs
    _track(float8_one_process[0], tiny_one_process, dump)


def test_cp2_alltoall_float8_tracks_one_process(float8_one_process, tiny_one_process, tmp_path):
    log = _log(run_trainer(tmp_path, 2, *_cp("alltoall"), *F8))
    assert CONVERTED in log, log[-3000:]
    _track(float8_one_process[0], tiny_one_process, tmp_path)


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
def test_fsdp2_cp2_float8_tracks_one_process(float8_one_process, tiny_one_process, tmp_path):
    """FSDP 2 x CP 2 (all-to-all) on 4 ranks, weights all-gathered in float8."""
    run_trainer(tmp_path, 4, *_cp("alltoall", dp_shard=2), *F8, "--float8.enable_fsdp_float8_all_gather", "true",
                "--float8.precompute_float8_dynamic_scale_for_fsdp", "true")
    _track(float8_one_process[0], tiny_one_process, tmp_path)


@pytest.mark.slow
def test_cp2_ring_compiled_float8_tracks_one_process(float8_one_process, tiny_one_process, tmp_path):
    """Compiled blocks around the eager ring attention, float8 casts inside the graphs (Inductor fuses them, so
    their float32 arithmetic differs from eager's in the last bits)."""
    run_trainer(tmp_path, 2, *_cp("ring"), *F8, "--training.compile", "true")
    _track(float8_one_process[0], tiny_one_process, tmp_path)
