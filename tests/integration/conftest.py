"""Trainer runs that tests in several files compare against, trained once per pytest worker."""

from __future__ import annotations

import subprocess

import pytest
from trainer_utils import CKPT_EVERY_2, run_trainer

from torchtitan_ext.train.preemption import handlers_restored


@pytest.fixture(scope="session")
def tiny_one_process(tmp_path_factory):
    """The plain tiny job (trainer_utils.TINY: 5 steps) in one process: the reference of the parallel layouts
    (test_parallel_layouts.py), of plain DDP and gradient accumulation (test_bad_inputs_and_checkpoint_faults.py)
    and of Squinch under HSDP (test_squinch_train.py)."""
    dump = tmp_path_factory.mktemp("tiny_one_process")
    run_trainer(dump, 0)
    return dump


@pytest.fixture(scope="session")
def checkpointed_run(tmp_path_factory):
    """The tiny job, 4 steps in one process with checkpoints at 2 and 4 (each with checksums.json): the run the
    fault tests copy and damage, resume or interrupt (test_checkpoint_integrity.py, test_interrupts.py,
    test_resume_diagnoses.py). Tests copy it before touching it."""
    dump = tmp_path_factory.mktemp("checkpointed_run") / "run"
    run_trainer(dump, 0, *CKPT_EVERY_2, "--training.steps", "4")
    return dump


@pytest.fixture
def restore_signal_handlers():
    """Tests that install SIGTERM / SIGUSR1 / SIGINT handlers themselves, or build a trainer without the entry
    point (which restores them): pytest's are put back."""
    with handlers_restored():
        yield


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a real filesystem of ``size`` (mount's spelling: "1m") under ``tmp_path``, for the
    full-disk tests (CI runs as root; skipped where mounting is refused); unmounted afterwards."""
    mounts = []

    def mount(size: str):
        path = tmp_path / f"fs{len(mounts)}"
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
