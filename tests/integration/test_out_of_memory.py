"""A CUDA out-of-memory error ends the job in one line with exit code 4 (``plan.out_of_memory``): where it
rose, the allocator's peak, the planner's figures and what would fit; the saved checkpoints are untouched.
The CPU tests drive the same boundary with a real ``torch.OutOfMemoryError`` raised inside the run; the GPU
test makes a real one under a per-process memory cap."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from trainer_utils import CKPT_EVERY_2, TINY, file_checksums

from torchtitan_ext.errors import EXIT_OUT_OF_MEMORY
from torchtitan_ext.train.__main__ import main
from torchtitan_ext.train.trainer import Trainer


def _run(capsys, dump: Path, *overrides: str) -> tuple[int, str, str]:
    os.environ.pop("RANK", None)
    code = main([*TINY, "--job.dump_folder", str(dump), *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_out_of_memory_in_a_later_step_is_one_line_and_keeps_the_checkpoints(tmp_path, capsys, monkeypatch):
    dump = tmp_path / "run"
    queue_step = Trainer.queue_step
    saved: dict[str, str] = {}

    def fail_at_step_3(self):
        if self.step == 3:
            saved.update(file_checksums(dump / "checkpoint"))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return queue_step(self)

    monkeypatch.setattr(Trainer, "queue_step", fail_at_step_3)
    code, _, err = _run(capsys, dump, *CKPT_EVERY_2, "--training.steps", "4")
    assert code == EXIT_OUT_OF_MEMORY
    line = _one_error_line(err)
    assert line.startswith("error: CUDA out of memory in training step 3: allocator peak "), line
    assert "activation_checkpoint.mode none" in line and "would fit: --activation_checkpoint.mode full" in line
    assert line.endswith("nothing saved was touched"), line
    assert saved and sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert file_checksums(dump / "checkpoint") == saved


def test_out_of_memory_in_evaluation_and_while_building_name_the_stage(tmp_path, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    def evaluate(self):  # named as the trainer's, which the stage is told by
        no_memory()

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    code, _, err = _run(capsys, tmp_path / "eval", "--training.steps", "2", "--eval.steps", "1")
    assert code == EXIT_OUT_OF_MEMORY
    assert _one_error_line(err).startswith("error: CUDA out of memory in evaluation after step 2:")
    monkeypatch.setattr(Trainer, "_build_checkpointer", no_memory)
    code, _, err = _run(capsys, tmp_path / "build", "--training.steps", "2")
    assert code == EXIT_OUT_OF_MEMORY
    assert _one_error_line(err).startswith("error: CUDA out of memory while building the run")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_out_of_memory_under_a_memory_cap(tmp_path, capsys):
    """A 1b model in a process capped at 2% of the card: the real allocator error, as the one line."""
    torch.cuda.set_per_process_memory_fraction(0.02)
    try:
        code, _, err = _run(capsys, tmp_path / "run", "--model.flavor", "1b", "--training.seq_len", "2048",
                            "--training.local_batch_size", "2")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert code == EXIT_OUT_OF_MEMORY
    line = _one_error_line(err)
    assert line.startswith("error: CUDA out of memory ") and " GiB of " in line, line
