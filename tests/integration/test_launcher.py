"""``launch/train.sh`` (real torchrun through ``python -m torchtitan_ext.launch``, 2 CPU workers) answers like
``python -m torchtitan_ext.train``: a bad key, a bad value, a missing config and a busy dump folder are one
line and exit code 2 within seconds, before any worker starts (the folder as it was); a worker's protective
stop (exit code 3) is the job's exit code and is not restarted; SIGTERM to the launcher saves the step and
exits 0 with one line, and the resume continues exactly; ``launch/slurm.sbatch`` outside Slurm says what it
needs in one line."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_utils import REPO, TEST_CACHE, file_checksums, losses

# The debug config, shrunk (the byte tokenizer: no corpus tokenizer to train).
SHRUNK = ["--data.tokenizer", "byte", "--data.cache_dir", str(TEST_CACHE), "--training.steps", "2",
          "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
          "--metrics.tensorboard", "false", "--eval.steps", "0"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # launch/setup_env.sh: this interpreter as it is (it has torch and the package)
    return {**os.environ, "PYTHON": sys.executable, "VENV": str(tmp_path / "no-venv"), "NPROC_PER_NODE": "2",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **extra}


def _train_sh(tmp_path: Path, *args: str, timeout: float = 300,
              **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(["bash", "launch/train.sh", *args], cwd=REPO, env=_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _held(dump: Path) -> tuple[object, str]:
    """The dump folder's lock held as a live run holds it: flock on .lock, the holder's record in it."""
    dump.mkdir(parents=True)
    holder = json.dumps({"host": "node7", "pid": 4242, "started": 0}) + "\n"
    lock = open(dump / ".lock", "w")  # noqa: SIM115  (held across the test)
    lock.write(holder)
    lock.flush()
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock, holder


@pytest.mark.parametrize("case", ["bad key", "bad value", "missing config", "float8 keys", "busy folder"])
def test_a_mistake_is_one_line_and_exit_2_before_any_worker(tmp_path, case):
    dump = tmp_path / "run"
    args = [*SHRUNK, "--job.dump_folder", str(dump)]
    lock = None
    if case == "bad key":
        args += ["--training.stepz", "3"]
        expected = "error: argument --training.stepz: unknown key 'training.stepz'; did you mean 'steps'?"
    elif case == "bad value":
        args += ["--training.steps", "abc"]
        expected = "error: argument --training.steps: training.steps: expected int, got 'abc'"
    elif case == "float8 keys":  # keys that contradict each other: refused before torch starts
        args += ["--float8.high_precision_eval", "true"]
        expected = "error: float8.high_precision_eval = true needs float8.enabled = true"
    elif case == "missing config":
        args = ["--config", str(tmp_path / "nope.toml"), *args]
        expected = (f"error: config file {tmp_path / 'nope.toml'}: not found (expected a TOML file, e.g. "
                    "train_configs/debug.toml)")
    else:
        lock, holder = _held(dump)
        expected = (f"error: job.dump_folder {dump} is in use by another run (host node7, pid 4242, started "
                    f"1970-01-01 00:00:00 UTC; lock file {dump}/.lock): wait for it to end, or choose another "
                    f"job.dump_folder")
    try:
        before = file_checksums(tmp_path)
        proc, seconds = _train_sh(tmp_path, *args, MAX_RESTARTS="3")
    finally:
        if lock is not None:
            lock.close()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [expected], proc.stderr
    assert proc.stdout == ""
    assert seconds < 30, seconds  # the interpreter's start and the check: no worker, no torch import in it
    assert file_checksums(tmp_path) == before and not (dump / "logs").exists()  # no worker ran
    if case == "busy folder":
        assert (dump / ".lock").read_text() == holder


def test_a_protective_stop_is_the_exit_code_and_not_restarted(tmp_path):
    """A diverging run (exit code 3 from its workers) under MAX_RESTARTS=3 ends at once with that code."""
    dump = tmp_path / "run"
    proc, _ = _train_sh(tmp_path, *SHRUNK, "--job.dump_folder", str(dump), "--training.steps", "6",
                        "--optimizer.lr", "1e30", "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0",
                        MAX_RESTARTS="3")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "loss is nan" in proc.stderr or "loss is inf" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert "restarting" not in proc.stdout + proc.stderr
    starts = [line for line in (dump / "logs" / "rank-0.log").read_text().splitlines()
              if line.startswith("training 6 steps from step 0")]
    assert len(starts) == 1, starts  # one attempt


def _losses_until(dump: Path, step: int) -> dict[int, float]:
    return {s: v for s, v in losses(dump).items() if s <= step}


def _stopped_by(tmp_path: Path, sig: signal.Signals, dump: Path, *args: str) -> int:
    """``launch/train.sh`` sent ``sig`` once step 3 is logged: exit code 0, no traceback, one line naming the
    step saved; that step."""
    cmd = ["bash", "launch/train.sh", *SHRUNK, *args, "--job.dump_folder", str(dump)]
    with open(tmp_path / "stderr.log", "w") as stderr:
        job = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        out = []
        for line in job.stdout:
            out.append(line)
            if line.startswith("step      3 "):
                job.send_signal(sig)  # train.sh execs the launcher: this is its pid
                break
        rest, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    out_text, err = "".join(out) + rest, (tmp_path / "stderr.log").read_text()
    assert job.returncode == 0, out_text[-2000:] + err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    last = out_text.strip().splitlines()[-1]
    saved = int(last.split("after step ")[1].split(":")[0])
    assert last == (f"preempted (signal) after step {saved}: saved {dump}/checkpoint/step-{saved}; exiting "
                    f"(this rank: {sig.name})"), last
    assert [x for x in out_text.splitlines() if x.startswith("preempted")] == [last]
    return saved


def test_ctrl_c_to_the_launcher_saves_and_exits_0(tmp_path):
    dump = tmp_path / "run"
    saved = _stopped_by(tmp_path, signal.SIGINT, dump, "--training.steps", "1000", "--checkpoint.enabled", "true",
                        "--checkpoint.interval", "1000")
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [f"step-{saved}"]


def test_sigterm_to_the_launcher_saves_exits_0_and_the_resume_is_exact(tmp_path):
    steps = ["--training.steps", "12", "--checkpoint.enabled", "true", "--checkpoint.interval", "100"]
    reference, _ = _train_sh(tmp_path, *SHRUNK, *steps, "--job.dump_folder", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]

    dump = tmp_path / "run"
    saved = _stopped_by(tmp_path, signal.SIGTERM, dump, *steps)
    assert 3 <= saved < 12

    resumed, _ = _train_sh(tmp_path, *SHRUNK, *steps, "--job.dump_folder", str(dump))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {dump}/checkpoint/step-{saved}" in resumed.stdout.splitlines()
    assert losses(dump) == losses(tmp_path / "reference")  # every step, before and after the stop, as one run's


def test_slurm_sbatch_by_hand_says_what_it_needs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", "launch/slurm.sbatch"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: launch/slurm.sbatch needs SLURM_JOB_ID, SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST (Slurm sets "
        "them): submit it with sbatch --nodes=N launch/slurm.sbatch [--config FILE ...]; on one machine run "
        "launch/train.sh"]


@pytest.mark.parametrize("env, expected", [
    ({"NNODES": "2"}, "error: NNODES=2 needs MASTER_ADDR (the host of the rendezvous, the same on every node)"),
    ({"NNODES": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "abc"},
     "error: environment variable MASTER_PORT='abc': expected a port number, 1 to 65535"),
])
def test_multi_node_variables_are_one_line(tmp_path, env, expected):
    proc, _ = _train_sh(tmp_path, *SHRUNK, "--job.dump_folder", str(tmp_path / "run"), **env)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [expected], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_crashed_worker_is_restarted_with_one_line(tmp_path):
    """A worker killed (SIGKILL) after step 4's checkpoint: every worker restarts once (MAX_RESTARTS=1), says
    so in one line, resumes and finishes; the job exits 0."""
    dump = tmp_path / "run"
    cmd = ["bash", "launch/train.sh", *SHRUNK, "--training.steps", "8", "--checkpoint.enabled", "true",
           "--checkpoint.interval", "2", "--job.dump_folder", str(dump)]
    with open(tmp_path / "stderr.log", "w") as stderr:
        job = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path, MAX_RESTARTS="1"), stdout=subprocess.PIPE,
                               stderr=stderr, text=True)
    try:
        out = []
        for line in job.stdout:
            out.append(line)
            if line.startswith("step      5 "):  # step-4 is published (synchronous save) before step 5 is logged
                workers = [int(c) for task in Path(f"/proc/{job.pid}/task").iterdir()
                           for c in (task / "children").read_text().split()]
                assert len(workers) == 2
                os.kill(workers[-1], signal.SIGKILL)
                break
        rest, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    out_text, err = "".join(out) + rest, (tmp_path / "stderr.log").read_text()
    assert job.returncode == 0, out_text[-2000:] + err[-3000:]
    restarts = [x for x in out_text.splitlines() if "restarting every worker" in x]
    assert restarts == ["worker rank 1 failed (killed by SIGKILL): restarting every worker from the latest "
                        "checkpoint (restart 1 of 1)"], out_text[-3000:]
    assert "resumed from" in out_text and (dump / "checkpoint" / "step-8").is_dir()
