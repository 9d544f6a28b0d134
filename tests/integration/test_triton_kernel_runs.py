"""The trainer with training.kernels = "triton": the same losses as "torch" under FSDP2 with activation
checkpointing and compile, and under TP (CPU, TRITON_INTERPRET=1); without a GPU and the interpreter, one line."""

from __future__ import annotations

import pytest
from trainer_utils import losses, run_trainer

TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_hidden", "128", "--training.steps", "3"]


@pytest.mark.slow
def test_trainer_triton_kernels_same_losses(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The interpreter runs one program per row: keep the rows few.
    short = [*TINY, "--training.seq_len", "16", "--training.steps", "5"]
    run_trainer(tmp_path / "torch", 2, *short, "--training.local_batch_size", "2")
    run_trainer(tmp_path / "ac_compile", 2, *short, "--training.local_batch_size", "2", "--training.kernels",
                "triton", "--activation_checkpoint.mode", "full", "--training.compile", "true")
    run_trainer(tmp_path / "tp", 2, *short, "--training.kernels", "triton", "--parallelism.tp", "2",
                "--training.local_batch_size", "4")
    want = losses(tmp_path / "torch")
    assert want[5] < want[1]
    for run in ("ac_compile", "tp"):
        got = losses(tmp_path / run)
        for step in want:
            assert got[step] == pytest.approx(want[step], abs=1e-4), (run, step)


def test_triton_kernels_need_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    proc = run_trainer(tmp_path, 0, *TINY, "--training.kernels", "triton", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: training.kernels = 'triton' needs a CUDA GPU")
