#!/usr/bin/env bash
# One GPU: the 1b bf16 shape's tokens/s through `python -m torchtitan_ext.train` at the commit before the
# structure change (a copy of its package in $OLD, default .bench_old/) and at this checkout, alternated
# old, new, old, new on the same card, so run-to-run noise shows beside the difference.
# Usage on the GPU machine, from the repository root: benchmarks/bench_structure.sh [OUT_DIR]
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_structure}}"
OLD="${OLD:-$PWD/.bench_old}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {
    local name=$1 tree=$2
    (cd "$tree" && PYTHONPATH="$tree" python3 -m torchtitan_ext.train --config "$PWD/train_configs/debug.toml" \
        --job.dump_folder "$OUT/$name" --data.tokenizer byte --data.cache_dir "$OUT/cache" --training.compile true \
        --checkpoint.enabled false --eval.steps 0 --metrics.log_freq 5 --metrics.tensorboard false \
        --optimizer.lr 3e-4 --model.flavor 1b --training.seq_len 2048 --training.local_batch_size 16 \
        --training.steps 40) > "$OUT/$name.log" 2>&1 || { echo "run $name failed:"; tail -n 30 "$OUT/$name.log"; }
}
run old_1 "$OLD"
run new_1 "$PWD"
run old_2 "$OLD"
run new_2 "$PWD"
python3 benchmarks/summarize.py "$OUT"/old_1 "$OUT"/new_1 "$OUT"/old_2 "$OUT"/new_2
