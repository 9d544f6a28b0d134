"""``launch/slurm.sbatch``'s preemption path, run as Slurm would run it but on one machine: the script itself
under bash with the Slurm variables set and ``srun`` / ``scontrol`` replaced by shims (``srun`` runs its
command here, ``scontrol`` answers ``show hostnames`` and records ``requeue``). Its step starts two CPU
workers through ``launch/train.sh`` (torchrun), USR1 goes to the script as ``#SBATCH --signal=B:USR1`` sends
it, and the trap's ``launch/forward_signal.sh`` must reach both workers (each logs that it received the
signal itself), the run must save a checkpoint of the step it stopped at, and the script must exit with the
step's status (0), not the interrupted ``wait``'s 138, after requeueing the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer_utils import REPO, TINY, read_metrics

SRUN = """#!/usr/bin/env bash
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done  # options, as srun takes them
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$SCONTROL_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; fi
"""


def _shims(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_ID": "4242",
            # launch/setup_env.sh: use this interpreter as it is (it has torch and the package)
            "PYTHON": sys.executable, "VENV": str(tmp_path / "no-venv"),
            "NPROC_PER_NODE": "2", "MAX_RESTARTS": "0", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def test_usr1_reaches_every_worker_saves_and_exits_0(tmp_path):
    dump = tmp_path / "run"
    env = _shims(tmp_path)
    cmd = ["bash", "launch/slurm.sbatch", "--config", "train_configs/debug.toml", *TINY, "--training.steps", "100000",
           "--checkpoint.enabled", "true", "--checkpoint.interval", "100000", "--job.dump_folder", str(dump)]
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and job.poll() is None and not (
                (dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 3):
            time.sleep(0.2)
        assert job.poll() is None, job.communicate()[0][-4000:]
        os.kill(job.pid, signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@300 does: to the batch shell only
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out[-4000:]
    assert "forward_signal: SIGUSR1 sent to 2 workers" in out, out[-4000:]
    last = read_metrics(dump)[-1]["step"]
    saved = sorted(p.name for p in (dump / "checkpoint").iterdir())
    assert saved == [f"step-{last}"] and last < 100000, (saved, last)
    for rank in (0, 1):
        log = (dump / "logs" / f"rank-{rank}.log").read_text()
        assert f"preempted (signal) after step {last}: saved" in log and "(this rank: SIGUSR1)" in log, log[-2000:]
    assert "requeue 4242" in (tmp_path / "scontrol.log").read_text().splitlines()


def test_forward_signal_without_workers_sends_nothing(tmp_path):
    env = {**os.environ, "SLURM_JOB_ID": f"no-such-job-{os.getpid()}"}  # never another run's workers
    proc = subprocess.run(["bash", "launch/forward_signal.sh", "USR1"], cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "nothing sent" in proc.stdout, proc.stdout + proc.stderr
