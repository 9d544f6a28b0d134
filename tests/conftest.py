"""Shared test set-up. The suite has three tiers (docs/testing.md): the default (CI, CPU), ``slow``
(convergence comparisons and multi-minute runs; ``launch/test.sh --all``) and ``multigpu`` (NCCL on 2+
GPUs; ``launch/test.sh -m multigpu`` on a lent machine). Test folders: ``unit/<package>/`` (in-process),
``integration/`` (trainer runs, gloo process groups), ``multigpu/``; shared helpers stay in this folder, which
pytest puts on ``sys.path`` (test module names must therefore be unique across folders).

The longest test files run first: launch/test.sh hands whole files to two pytest-xdist workers, and a long
file handed out last would leave one worker idle while the other finishes it."""

from __future__ import annotations

import os

import pytest
import torch

LONGEST_FIRST = ("test_mode_tensor_parallel.py", "test_parallel_layouts.py", "test_squinch_train.py",
                 "test_expert_parallel.py", "test_bad_inputs_and_checkpoint_faults.py", "test_distill_runs.py",
                 "test_train_fsdp_resume.py", "test_attention_feature_runs.py")


# On CPU (CI: 2 cores, two pytest workers) inductor compiles in the calling process, in this one and in every
# trainer it starts, instead of starting a pool of compile worker processes for each.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    """The multigpu tier's job timeout (``tests/multigpu/nccl_utils.py``), checked before anything is collected:
    a bad value is one line."""
    value = os.environ.get("MULTIGPU_JOB_TIMEOUT", "480")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise pytest.UsageError(f"MULTIGPU_JOB_TIMEOUT={value!r}: expected a number of seconds > 0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(2400))  # convergence comparisons: the CI tier's 15 minutes is short
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: file order kept
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = int(os.environ.get("TORCHTITAN_EXT_MULTIGPU_ON_CPU") or gpus)  # the tier's plumbing on CPU (nccl_utils)
    if gpus < 2:
        skip = pytest.mark.skip(reason=f"multigpu: needs 2+ CUDA GPUs, found {gpus}")
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(skip)
