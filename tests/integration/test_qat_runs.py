"""QAT and INT8 forward in the trainer: 300-step runs close to full precision, the export CLI with EMA weights, TP2
equal to one process."""

from __future__ import annotations

import pytest

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "2", "--model.ffn_hidden", "256",
         "--model.activation", "relu2", "--training.seq_len", "32", "--training.steps", "300",
         "--lr_scheduler.warmup_steps", "20", "--metrics.log_freq", "10"]


@pytest.mark.slow
def test_qat_and_int8_train_close_to_full_precision(tmp_path):
    """300 steps of a 2-layer, dim-64 model: each variant's mean logged loss over steps 260-300 is within 0.1
    (nats) of the float32 run's (4% of a loss near 2.5), and it learned (fell by over 1.5)."""
    from trainer_utils import read_metrics, run_trainer
    runs = {"fp32": [], "qat_static": ["--quant.qat", "int8", "--quant.clamp", "static"],
            "qat_dynamic": ["--quant.qat", "int8", "--quant.clamp", "dynamic"],
            "int8": ["--quant.int8_forward", "true", "--model.residual_scalars", "true"]}
    final = {}
    for name, extra in runs.items():
        proc = run_trainer(tmp_path / name, 0, *SMALL, *extra)
        assert ("quant:" in proc.stdout) == bool(extra), proc.stdout[:2000]
        metrics = read_metrics(tmp_path / name)
        final[name] = sum(r["loss"] for r in metrics[-5:]) / 5
        assert metrics[0]["loss"] - final[name] > 1.5, (name, metrics[0]["loss"], final[name])
    print("mean loss, steps 260-300:", {k: round(v, 4) for k, v in final.items()})
    for name in ("qat_static", "qat_dynamic", "int8"):
        assert abs(final[name] - final["fp32"]) < 0.1, (name, final)


def test_export_cli_with_ema(tmp_path):
    import subprocess
    import sys

    from trainer_utils import REPO, run_trainer
    run_trainer(tmp_path, 0, "--training.steps", "10", "--checkpoint.enabled", "true", "--ema.decay", "0.9",
                "--eval.steps", "2")
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    sizes = {}
    for bits in (8, 6):
        proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.quant.export", "--checkpoint", str(tmp_path),
                               "--bits", str(bits)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"EMA weights of step 10, {bits}-bit" in proc.stdout
        line = next(x for x in proc.stdout.splitlines() if x.startswith("validation loss"))
        original, deq = (float(x.split()[-1].rstrip(",")) for x in line.split(":")[1].split("(")[0].split(","))
        assert abs(deq - original) < (0.01 if bits == 8 else 0.05), line
        sizes[bits] = (tmp_path / f"export-int{bits}.pt").stat().st_size
    assert sizes[6] < 0.8 * sizes[8]
    bad = subprocess.run([sys.executable, "-m", "torchtitan_ext.quant.export", "--checkpoint", str(tmp_path / "no")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no config.toml" in bad.stderr


@pytest.mark.parametrize("quant", [["--quant.qat", "int8"],
                                   ["--quant.int8_forward", "true", "--model.residual_scalars", "true"]],
                         ids=["qat", "int8"])
def test_tp2_equals_one_process(tmp_path, quant):
    """QAT and INT8 forward (with residual scalars) under TP2 (sharded w1/w2, q/k/v/o): the per-tensor scales
    and the dynamic clamp are those of the whole weights, and the scalars' gradients are summed over the
    sequence shards, so every step's loss and gradient norm match one process to float32 rounding. (Scales
    from each rank's own shard instead drift from one process by 1e-5 after 4 steps, above the tolerance.)"""
    from trainer_utils import read_metrics, run_trainer
    tiny = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "2", "--model.ffn_hidden", "256",
            "--model.activation", "relu2", "--training.seq_len", "32"]
    proc = run_trainer(tmp_path / "one", 0, *tiny, *quant)
    assert "quant:" in proc.stdout
    run_trainer(tmp_path / "tp2", 2, *tiny, *quant, "--parallelism.tp", "2")
    one, tp2 = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [1, 2, 3, 4, 5]
    for a, b in zip(one, tp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-6), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-6), (a["step"], a["grad_norm"], b["grad_norm"])
