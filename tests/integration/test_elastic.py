"""Elastic restarts and multi-node rendezvous on one machine (CPU, gloo, 4 processes).

A worker killed mid-run: torchrun (c10d rendezvous, --max_restarts) restarts the workers, they resume from
the latest checkpoint and the job ends with the losses of an uninterrupted run. Two torchrun agents started
through ``launch/train.sh`` with ``NNODES=2`` form one 4-process FSDP job equal to a one-node run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from trainer_utils import REPO, TINY, losses, read_metrics, run_trainer

pytestmark = pytest.mark.slow

JOB = ["--training.steps", "8", "--training.local_batch_size", "1", "--checkpoint.enabled", "true",
       "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """4 processes (FSDP over 4), one node, no fault."""
    dump = tmp_path_factory.mktemp("uninterrupted")
    run_trainer(dump, 4, *JOB)
    return losses(dump)


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def _assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


def test_killed_rank_restarts_and_resumes(tmp_path, uninterrupted):
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "4",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--max_restarts", "1",
           "-m", "torchtitan_ext.train", *TINY, "--job.dump_folder", str(dump), *JOB]
    agent = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not ((dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 5):
        time.sleep(0.1)  # step 5 logged: the checkpoint of step 4 is published
    workers = _children(agent.pid)
    assert len(workers) == 4
    os.kill(workers[-1], signal.SIGKILL)
    out, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-4000:]
    assert "resumed from" in out and (dump / "checkpoint" / "step-8").is_dir()
    _assert_same(losses(dump), uninterrupted)  # redone steps replaced in metrics.jsonl, not duplicated


def test_two_agents_through_train_sh(tmp_path, uninterrupted):
    """NNODES=2 x NPROC_PER_NODE=2 on this machine: two torchrun agents meet through the c10d rendezvous."""
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    dump = tmp_path / "run"
    env = {**ENV, "NNODES": "2", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RDZV_ID": f"test-{os.getpid()}"}
    args = ["bash", "launch/train.sh", "--config", str(empty), *TINY, "--job.dump_folder", str(dump), *JOB]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    nodes = [subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for log in logs]
    try:
        for n in nodes:
            n.wait(timeout=240)
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    outs = [(log.read_text(), log.read_text()) for log in logs]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    log = "".join(o[0] for o in outs)
    assert "dp_shard 4" in log
    _assert_same(losses(dump), uninterrupted)
