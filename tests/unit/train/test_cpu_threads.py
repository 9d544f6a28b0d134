"""A CPU process sets torch's thread count itself (issue 64): the usable cores shared by this machine's
processes of the job, unless ``OMP_NUM_THREADS`` says otherwise; a cgroup CPU quota bounds the cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from torchtitan_ext.train import build


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores, local, expected", [(8, 2, 4), (8, 1, 8), (2, 4, 1), (6, 4, 1)])
def test_cores_are_shared_by_the_local_processes(monkeypatch, threads_restored, cores, local, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setattr(build, "usable_cores", lambda: cores)
    line = build.set_cpu_threads()
    assert torch.get_num_threads() == expected
    plural = "s" if expected > 1 else ""
    assert line == f"{expected} thread{plural} per process ({cores} cores / {local} processes here; " \
                   "OMP_NUM_THREADS overrides)"


def test_omp_num_threads_overrides(monkeypatch, threads_restored):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what the OpenMP runtime makes of the variable at the interpreter's start
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert build.set_cpu_threads() == "3 threads per process (OMP_NUM_THREADS)"
    assert torch.get_num_threads() == 3


def test_a_fresh_process_without_omp_num_threads_uses_its_share():
    """A real interpreter bound to one core (its affinity) takes one thread, whatever torch's default."""
    code = ("import os, torch; from torchtitan_ext.train.build import set_cpu_threads; os.sched_setaffinity(0, {0}); "
            "print(set_cpu_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1 thread per process (1 cores / 1 processes here; OMP_NUM_THREADS overrides)"
