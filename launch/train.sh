#!/usr/bin/env bash
# Train with torchrun. No arguments: the default debug job on the built-in corpus, on every local GPU
# when CUDA is present, else on 2 CPU processes with gloo. Extra arguments go to the trainer
# (--config FILE, --section.key value). Multi-node: set NNODES, MASTER_ADDR, MASTER_PORT (and
# NPROC_PER_NODE) the same way on every node; the nodes meet through a c10d rendezvous hosted on
# MASTER_ADDR (node ranks are assigned by arrival, NODE_RANK is not needed; RDZV_ID names the job).
# MAX_RESTARTS (default 3): when a worker dies, torchrun restarts every worker of the job that many times;
# they resume from the latest checkpoint.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$REPO"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    NPROC_PER_NODE="${NPROC_PER_NODE:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
    export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
else
    NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
has_config=0
for a in "$@"; do [ "$a" = "--config" ] && has_config=1; done
config=()
[ "$has_config" = 1 ] || config=(--config "${CONFIG:-train_configs/debug.toml}")
NNODES="${NNODES:-1}"
if [ "$NNODES" = 1 ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_id "${RDZV_ID:-torchtitan_ext}" \
          --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}")
fi
exec "$PY" -m torch.distributed.run "${rdzv[@]}" --nproc_per_node "$NPROC_PER_NODE" \
    --max_restarts "${MAX_RESTARTS:-3}" -m torchtitan_ext.train "${config[@]}" "$@"
