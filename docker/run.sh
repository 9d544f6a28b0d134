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
# - Shared memory: --ipc=host (IPC=private uses --shm-size $SHM_SIZE, default 16g, instead); locked memory
#   unlimited (--ulimit memlock=-1) for NCCL's registered buffers.
# - InfiniBand: /dev/infiniband passed in with --cap-add IPC_LOCK when the host has it; host networking
#   (--network=host) for the c10d rendezvous and NCCL between nodes.
# - NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID, NPROC_PER_NODE, MAX_RESTARTS and NCCL_* set here are passed on.
# DOCKER (default docker) and IMAGE (default torchtitan_ext) pick the engine and the image.
set -euo pipefail
IMAGE="${IMAGE:-torchtitan_ext}"
OUTPUTS="${OUTPUTS:-$PWD/outputs}"
CACHE="${CACHE:-$PWD/.cache}"
mkdir -p "$OUTPUTS" "$CACHE"
args=(run --rm --gpus all --network=host --ulimit memlock=-1 --ulimit stack=67108864
      --user "$(id -u):$(id -g)" -e HOME=/cache/home -e TRITON_CACHE_DIR=/cache/home/.triton
      -v "$(cd "$OUTPUTS" && pwd):/workspace/torchtitan_ext/outputs" -v "$(cd "$CACHE" && pwd):/cache")
if [ "${IPC:-host}" = host ]; then
    args+=(--ipc=host)
else
    args+=(--shm-size "${SHM_SIZE:-16g}")
fi
if [ -e /dev/infiniband ]; then
    args+=(--device /dev/infiniband --cap-add IPC_LOCK)
fi
for var in NNODES MASTER_ADDR MASTER_PORT RDZV_ID NPROC_PER_NODE MAX_RESTARTS $(compgen -e | grep '^NCCL_' || true); do
    if [ -n "${!var+x}" ]; then args+=(-e "$var"); fi
done
exec "${DOCKER:-docker}" "${args[@]}" "$IMAGE" "$@"
