"""Trainer runs that tests in several files compare against, trained once per pytest worker."""

from __future__ import annotations

import pytest
from trainer_utils import run_trainer


@pytest.fixture(scope="session")
def tiny_one_process(tmp_path_factory):
    """The plain tiny job (trainer_utils.TINY: 5 steps) in one process: the reference of the parallel layouts
    (test_parallel_layouts.py) and of plain DDP (test_bad_inputs_and_checkpoint_faults.py)."""
    dump = tmp_path_factory.mktemp("tiny_one_process")
    run_trainer(dump, 0)
    return dump
