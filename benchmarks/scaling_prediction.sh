#!/usr/bin/env bash
# Scaling-law prediction measured (issue 29): fit L(N, D) on a sweep of small runs, each with at most 1/10 of
# the target run's compute (C = 6 N D), predict the target's final validation loss, train the target, compare.
# Everything runs through `python -m torchtitan_ext.scaling sweep` / `python -m torchtitan_ext.train` on one GPU.
# Usage on the GPU machine, from the repository root: benchmarks/scaling_prediction.sh [OUT_DIR] [-- overrides]
#   small: widths 128 256 384 x tokens 2M 4M 6M (the largest 6 x 7.1M x 6M = 2.5e14 FLOPs)
#   target: width 768, 16M tokens (6 x 28.3M x 16M = 2.7e15 FLOPs)
set -uo pipefail
OUT="${1:-/tmp/scaling_prediction}"
shift $(( $# > 0 ? 1 : 0 ))
[ "${1:-}" = "--" ] && shift
COMMON=(--training.local_batch_size 32 --training.seq_len 256 --lr_scheduler.warmup_steps 50
        --checkpoint.enabled false --metrics.tensorboard false --metrics.log_freq 100 --eval.steps 20 "$@")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$SECONDS
python3 -m torchtitan_ext.scaling sweep --config train_configs/debug.toml --widths 128 256 384 \
    --tokens 2e6 4e6 6e6 --out "$OUT/sweep" --fit -- "${COMMON[@]}" > "$OUT/sweep.log" 2>&1 \
    || { echo "sweep failed:"; tail -n 20 "$OUT/sweep.log"; exit 1; }
echo "sweep: $((SECONDS - t0)) s"
cat "$OUT/sweep/runs.csv"
# The target's shape, planned exactly as the sweep plans its runs (same head_dim, FFN ratio, steps).
python3 -m torchtitan_ext.scaling sweep --config train_configs/debug.toml --widths 768 --tokens 1.6e7 \
    --out "$OUT/target" -- "${COMMON[@]}" > "$OUT/target.log" 2>&1 \
    || { echo "target failed:"; tail -n 20 "$OUT/target.log"; exit 1; }
echo "sweep + target: $((SECONDS - t0)) s"
target=$(tail -n 1 "$OUT/target/runs.csv")
echo "target run (params,tokens,loss,...): $target"
n=$(echo "$target" | cut -d, -f1); d=$(echo "$target" | cut -d, -f2)
python3 -m torchtitan_ext.scaling fit --input "$OUT/sweep/runs.csv" --predict "$n,$d" --flops 2.7e15 \
    --plot "$OUT/fit.png" | tee "$OUT/fit.json"
