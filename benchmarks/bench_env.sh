# Sourced by the multi-GPU benchmark scripts, from the repository root, once OUT_DIR and WORK are set: makes both
# folders (OUT_DIR absolute), sets OUT (= WORK, where run_job.sh writes run folders and logs), puts the repository
# on PYTHONPATH, keeps NVLink multicast off (NVLS can take a shared host's GPUs out of service) and picks PY:
# python3, or the virtual environment's python where python3 has no torch.
mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
OUT=$WORK
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PY:-python3}"
[ -x .venv/bin/python ] && ! "$PY" -c "import torch" 2>/dev/null && PY=$PWD/.venv/bin/python
