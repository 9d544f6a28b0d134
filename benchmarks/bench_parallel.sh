#!/usr/bin/env bash
# Two GPUs (nvidia-h200-x2): throughput and peak memory of one model under FSDP, TP and PP, bf16, compiled,
# the same global batch for each layout; then FSDP with torchao float8 (tensorwise) with the float8
# all-gather off and on. Prints one JSON line per run (benchmarks/summarize.py) and a table.
#
# Usage from the repository root:  benchmarks/bench_parallel.sh [OUT_DIR]
#   env: LAYERS (8) SEQ (4096) STEPS (30) NPROC (2) SKIP_FLOAT8 (0) PYTHON (python3)
#   torchao for the float8 rows comes from the wheel in .whl/ when present (the GPU machine has no index).
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_parallel}}"
PY="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
STEPS="${STEPS:-30}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

shopt -s nullglob
WHEELS=(.whl/torchao-*.whl)
if (( ${#WHEELS[@]} )); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${WHEELS[@]}" \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

# A 7b-shaped model (d_model 4096, 32 heads, SwiGLU 11008, vocabulary 32000) with fewer layers; global batch
# of 4 sequences per step in every layout.
SHAPE=(--config train_configs/debug.toml --model.flavor 7b --model.n_layers "${LAYERS:-8}"
       --training.seq_len "${SEQ:-4096}" --training.steps "$STEPS" --training.compile true
       --data.tokenizer byte --checkpoint.enabled false --eval.steps 0 --metrics.log_freq 5
       --metrics.tensorboard false --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5)
run() {  # run NAME ARGS...: one torchrun job on NPROC GPUs
    local name=$1; shift
    rm -rf "${OUT:?}/$name"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m torchtitan_ext.train \
        "${SHAPE[@]}" --job.dump_folder "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 \
        || { echo "run $name failed:"; grep -v "Failed to load" "$OUT/$name.log" | tail -n 15; }
    "$PY" benchmarks/summarize.py "$OUT/$name" | tee -a "$OUT/summary.jsonl"
}
rm -f "$OUT/summary.jsonl"
run fsdp2 --parallelism.dp_shard "$NPROC" --training.local_batch_size $(( 4 / NPROC ))
run tp2 --parallelism.tp "$NPROC" --parallelism.dp_shard 1 --training.local_batch_size 4
run pp2_1f1b --parallelism.pp "$NPROC" --parallelism.dp_shard 1 --training.local_batch_size 4 \
    --parallelism.pp_schedule 1F1B --parallelism.pp_microbatches 4
if [[ "${SKIP_FLOAT8:-0}" != 1 ]]; then
    F8=(--parallelism.dp_shard "$NPROC" --training.local_batch_size $(( 4 / NPROC )) --float8.enabled true
        --float8.recipe tensorwise)
    run fsdp2_float8 "${F8[@]}"
    run fsdp2_float8_allgather "${F8[@]}" --float8.enable_fsdp_float8_all_gather true \
        --float8.precompute_float8_dynamic_scale_for_fsdp true
fi
"$PY" - "$OUT/summary.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cols = ["tokens_per_sec", "tokens_per_sec_per_device", "mfu", "peak_memory_gib", "first_loss", "last_loss"]
print(f"{'run':<24}" + "".join(f"{c:>27}" for c in cols))
for r in rows:
    print(f"{r['run']:<24}" + "".join(f"{r.get(c, '-')!s:>27}" for c in cols) + (f"  {r['error']}" if "error" in r else ""))
EOF
