#!/usr/bin/env bash
# Train with torchrun (through python -m torchtitan_ext.launch). No arguments: the default debug job on the
# built-in corpus, on every local GPU when CUDA is present, else on 2 CPU processes with gloo. Extra arguments
# go to the trainer (--config FILE, --section.key value). Multi-node: set NNODES, MASTER_ADDR, MASTER_PORT (and
# NPROC_PER_NODE) the same way on every node; the nodes meet through a c10d rendezvous hosted on
# MASTER_ADDR (node ranks are assigned by arrival, NODE_RANK is not needed; RDZV_ID names the job).
# The job is checked before any worker starts (config, overrides, dump folder): a mistake is one line and
# exit code 2. MAX_RESTARTS (default 3): when a worker crashes, every worker of the job is restarted that many
# times; they resume from the latest checkpoint. A worker's refusal (exit code 2), protective stop (3) or
# out-of-memory stop (4) is not restarted, and the job's exit code is the worker's. SIGTERM, SIGUSR1 and
# Ctrl-C reach every worker: they finish the step, save a checkpoint and exit 0.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$REPO"
has_config=0
for a in "$@"; do [ "$a" = "--config" ] && has_config=1; done
config=()
[ "$has_config" = 1 ] || config=(--config "${CONFIG:-train_configs/debug.toml}")
NNODES="${NNODES:-1}"
if [ "$NNODES" = 1 ]; then
    rdzv=(--standalone)
else
    if [ -z "${MASTER_ADDR:-}" ]; then
        echo "error: NNODES=$NNODES needs MASTER_ADDR (the host of the rendezvous, the same on every node)" >&2
        exit 2
    fi
    port="${MASTER_PORT:-29500}"
    if ! [[ "$port" =~ ^[0-9]{1,5}$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
        echo "error: environment variable MASTER_PORT='$port': expected a port number, 1 to 65535" >&2
        exit 2
    fi
    rdzv=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_id "${RDZV_ID:-torchtitan_ext}" \
          --rdzv_endpoint "$MASTER_ADDR:$port")
fi
# NPROC_PER_NODE unset: the launcher counts the GPUs (2 CPU processes without CUDA)
exec "$PY" -m torchtitan_ext.launch "${rdzv[@]}" ${NPROC_PER_NODE:+--nproc_per_node "$NPROC_PER_NODE"} \
    --max_restarts "${MAX_RESTARTS:-3}" -- "${config[@]}" "$@"
