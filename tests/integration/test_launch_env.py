"""The launcher's environment, checked where the trainer starts (issue 64): ``WORLD_SIZE`` above 1 without
``RANK`` (and ``RANK`` without ``WORLD_SIZE``) is one line instead of a silent world-of-one run, a
``MASTER_PORT`` that is not a port is one line naming it, and a peer that never comes ends the rendezvous after
``TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S`` with one line naming the address and the timeout (not
``DistStoreError``'s traceback). Each: exit code 2, and nothing written in the dump folder but the claim's
lock and logs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from dist_utils import free_port
from trainer_utils import REPO, TINY

from torchtitan_ext.cli import run_tool
from torchtitan_ext.errors import EXIT_USER
from torchtitan_ext.tools import train as train_tool

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "TORCHELASTIC_RESTART_COUNT", "TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _error_lines(capsys, code: int) -> list[str]:
    assert code == EXIT_USER, capsys.readouterr()
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("env, expected", [
    ({"WORLD_SIZE": "2"}, "environment variable WORLD_SIZE=2 without RANK: each of the 2 processes needs its RANK "
                          "(torchrun or launch/train.sh sets both); unset WORLD_SIZE for a plain one-process run"),
    ({"RANK": "0"}, "environment variable RANK=0 without WORLD_SIZE: a process of a job needs both (torchrun sets "
                    "them; unset RANK for a plain one-process run)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"},
     "environment variable MASTER_PORT='abc': expected a port number, 1 to 65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
     "environment variable MASTER_PORT='70000': expected a port number, 1 to 65535"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"},
     "environment variable MASTER_ADDR not set: rank 1 of WORLD_SIZE=2 meets the other processes at "
     "MASTER_ADDR:MASTER_PORT (torchrun sets them; unset RANK and WORLD_SIZE for a plain one-process run)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
      "TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S": "soon"},
     "environment variable TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S='soon': expected a number of seconds > 0"),
])
def test_a_launcher_variable_is_one_line(tmp_path, no_launcher, capsys, env, expected):
    for name, value in env.items():
        no_launcher.setenv(name, value)
    code = run_tool(train_tool._train, [*TINY, "--job.dump_folder", str(tmp_path / "run")])
    assert _error_lines(capsys, code) == [f"error: {expected}"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoint").exists()


def test_a_peer_that_never_comes_is_one_line_naming_the_rendezvous(tmp_path, no_launcher):
    """Rank 0 of a world of 2, alone: it hosts the store and waits for rank 1, which never starts."""
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S": "3", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", *TINY, "--job.dump_folder",
                           str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    assert proc.returncode == EXIT_USER, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    head, reason = lines[0].split(": ", 2)[1:]
    assert head == f"rendezvous at 127.0.0.1:{port} (rank 0 of WORLD_SIZE=2) failed within 3 s " \
                   f"(TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S)", lines[0]
    assert "1/2 clients joined; check that every process was started with the same MASTER_ADDR, MASTER_PORT " \
           "and WORLD_SIZE and can reach that address" in reason, lines[0]
    assert seconds < 120, seconds  # the knob's 3 s, not the process group's 30 minutes


def test_a_rank_whose_store_never_answers_is_one_line_without_native_frames(tmp_path, no_launcher):
    """Rank 1 of a world of 2 whose rank 0 never starts: the C++ store's connect and retry logs (native stacks
    of some forty frames each) do not reach the terminal, only the one line naming the rendezvous."""
    port = free_port()
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHTITAN_EXT_RENDEZVOUS_TIMEOUT_S": "2", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", *TINY, "--job.dump_folder",
                           str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_USER, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: rendezvous at 127.0.0.1:{port} (rank 1 of WORLD_SIZE=2) failed within 2 s"), \
        lines[0]
