"""``launch/setup_env.sh`` (sourced by train.sh and test.sh) on a virtual environment whose interpreter is a
shim that records what it is asked: TORCH_SPEC and TORCH_INDEX_URL reach pip, and a second process waits on
the build lock (``$VENV.lock``) held by another until it is released, so Slurm nodes sharing a checkout build
the environment once."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path

from trainer_utils import REPO

# No torch here (so setup_env installs it); pip calls are recorded and succeed.
SHIM = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
if [ "$1" = "-c" ]; then exit 1; fi
exit 0
"""


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(SHIM)
    (venv / "bin" / "python").chmod(0o755)
    return venv


def _source(venv: Path, **extra: str) -> subprocess.Popen:
    env = {**os.environ, "VENV": str(venv), **extra}
    return subprocess.Popen(["bash", "-c", 'source launch/setup_env.sh && echo "PY=$PY"'], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_torch_spec_and_index_url_reach_pip(tmp_path):
    venv = _venv(tmp_path)
    proc = _source(venv, TORCH_SPEC="torch==2.11.0 torchao==0.17.0",
                   TORCH_INDEX_URL="https://download.pytorch.org/whl/cu128")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"PY={venv}/bin/python" in out
    calls = (venv / "calls.log").read_text().splitlines()
    assert "-m pip install -q torch==2.11.0 torchao==0.17.0 --index-url https://download.pytorch.org/whl/cu128" in calls
    assert f"-m pip install -q -e {REPO}[dev]" in calls
    assert list(venv.glob(".installed-*"))  # the package's install is stamped: not redone next time


def test_second_builder_waits_for_the_lock(tmp_path):
    venv = _venv(tmp_path)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another node is building
        proc = _source(venv)
        time.sleep(3)
        assert proc.poll() is None and not (venv / "calls.log").exists()  # waiting, nothing installed yet
        fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "another process is building" in err, err
    assert f"PY={venv}/bin/python" in out
