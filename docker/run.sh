#!/usr/bin/env bash
# Runs the torchtitan_ext image (docker build -f docker/Dockerfile -t torchtitan_ext .) with what training
# needs; arguments are the command (default: the image's launch/train.sh, the default job):
#   docker/run.sh
#   docker/run.sh launch/train.sh --config train_configs/600m.toml
#   NNODES=4 MASTER_ADDR=node0 NCCL_SOCKET_IFNAME=ib0 docker/run.sh launch/train.sh --config train_configs/7b.toml
# - OUTPUTS (default ./outputs, created) is mounted at the image's outputs/, so checkpoints, TensorBoard logs
#   and metrics outlive the container; CACHE (default ./.cache) is the container's home (/cache/home: the
#   built-in corpus and tokenizer cache, Triton's kernels). The container runs as you (--user uid:gid), so
#   both stay yours.
# - GPUs: docker's --gpus all; podman's CDI devices (--device nvidia.com/gpu=all; a CDI spec made by
#   nvidia-ctk cdi generate). GPUS=none runs without GPUs (a CPU host).
# - Shared memory: --ipc=host (IPC=private uses --shm-size $SHM_SIZE, default 16g, instead); locked memory
#   unlimited (--ulimit memlock=-1) for NCCL's registered buffers and a 64 MiB stack. Podman sets limits
#   from this shell and cannot raise them past its hard limits: a limit it cannot set is left out, and said.
# - InfiniBand: /dev/infiniband passed in with --cap-add IPC_LOCK when the host has it (said when not); host
#   networking (--network=host) for the c10d rendezvous and NCCL between nodes.
# - NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID, NPROC_PER_NODE, MAX_RESTARTS and NCCL_* set here are passed on.
# DOCKER (default docker; podman, or a docker that is podman, is recognised) and IMAGE (default
# torchtitan_ext) pick the engine and the image.
set -euo pipefail
IMAGE="${IMAGE:-torchtitan_ext}"
OUTPUTS="${OUTPUTS:-$PWD/outputs}"
CACHE="${CACHE:-$PWD/.cache}"
mkdir -p "$OUTPUTS" "$CACHE"
DOCKER="${DOCKER:-docker}"
engine=docker
if [ "$(basename "$DOCKER")" = podman ] || "$DOCKER" --version 2>/dev/null | grep -qi podman; then
    engine=podman
fi
note() { echo "docker/run.sh: $*" >&2; }
args=(run --rm --network=host --user "$(id -u):$(id -g)" -e HOME=/cache/home -e TRITON_CACHE_DIR=/cache/home/.triton
      -v "$(cd "$OUTPUTS" && pwd):/workspace/torchtitan_ext/outputs" -v "$(cd "$CACHE" && pwd):/cache")
case "${GPUS:-all}:$engine" in
    none:*) note "GPUS=none: no GPUs passed in" ;;
    *:docker) args+=(--gpus "${GPUS:-all}") ;;
    *:podman)
        if ! ls /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json >/dev/null 2>&1; then
            note "podman passes GPUs as CDI devices and this host has no CDI spec (/etc/cdi, /var/run/cdi):" \
                 "make one with 'nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml', or set GPUS=none"
            exit 2
        fi
        args+=(--device "nvidia.com/gpu=${GPUS:-all}") ;;
esac
# ulimit name, value, this shell's flag, the value in KiB (-1: unlimited)
limits=()
for limit in "memlock -1 -l -1" "stack 67108864 -s 65536"; do
    read -r name value flag kib <<< "$limit"
    hard="$(ulimit -H "$flag")"
    if [ "$engine" = docker ] || [ "$hard" = unlimited ] || { [ "$kib" != -1 ] && [ "$hard" -ge "$kib" ]; }; then
        limits+=(--ulimit "$name=$value")
    else
        note "$engine cannot raise $name past this shell's hard limit ($hard KiB): --ulimit $name=$value left out"
    fi
done
if [ "$engine" = podman ] && [ "${#limits[@]}" -gt 0 ]; then
    # podman's --ulimit replaces containers.conf's default_ulimits: keep open files and processes at this
    # shell's hard limits rather than podman's built-in ones, which it may not be allowed to set (processes
    # also at most the kernel's pid_max, above which some hosts refuse the limit to runc)
    pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
    nproc=$(ulimit -Hu)
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
    limits+=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=$nproc:$nproc")
fi
args+=("${limits[@]}")
if [ "${IPC:-host}" = host ]; then
    args+=(--ipc=host)
else
    args+=(--shm-size "${SHM_SIZE:-16g}")
fi
if [ -e /dev/infiniband ]; then
    args+=(--device /dev/infiniband --cap-add IPC_LOCK)
else
    note "no /dev/infiniband on this host: InfiniBand not passed in"
fi
for var in NNODES MASTER_ADDR MASTER_PORT RDZV_ID NPROC_PER_NODE MAX_RESTARTS $(compgen -e | grep '^NCCL_' || true); do
    if [ -n "${!var+x}" ]; then args+=(-e "$var"); fi
done
exec "$DOCKER" "${args[@]}" "$IMAGE" "$@"
