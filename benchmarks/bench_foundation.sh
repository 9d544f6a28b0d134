#!/usr/bin/env bash
# One GPU: the trainer's throughput for the 1b benchmark shape and the 600m flavor, bf16, compiled.
# Usage on the GPU machine, from the repository root: benchmarks/bench_foundation.sh [OUT_DIR]
# The byte tokenizer feeds models whose flavors fix their vocabulary (1b: 32000, 600m: 151936): the
# shapes, and so the speed, are the flavors'; the loss is not comparable with a real tokenizer's.
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_foundation}}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run() {
    local name=$1; shift
    python3 -m torchtitan_ext.train --config train_configs/debug.toml --job.dump_folder "$OUT/$name" \
        --data.tokenizer byte --training.compile true --checkpoint.enabled false \
        --eval.steps 0 --metrics.log_freq 5 --metrics.tensorboard false --optimizer.lr 3e-4 "$@" \
        > "$OUT/$name.log" 2>&1 || { echo "run $name failed:"; tail -n 30 "$OUT/$name.log"; }
}
run 1b_bs16 --model.flavor 1b --training.seq_len 2048 --training.local_batch_size 16 --training.steps 40
run 600m_bs8 --model.flavor 600m --training.seq_len 2048 --training.local_batch_size 8 --training.steps 40
python3 benchmarks/summarize.py "$OUT"/1b_bs16 "$OUT"/600m_bs8
