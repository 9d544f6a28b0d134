#!/usr/bin/env bash
# Scaling-law prediction measured (issue 29): fit L(N, D) on a sweep of small runs, each with at most 1/10 of
# the target run's compute (C = 6 N D), predict the target's final validation loss, train the target, compare.
# Every run goes through `python -m torchtitan_ext.scaling sweep` (-> `python -m torchtitan_ext.train`) on one GPU.
# The AdamW learning rate follows the width as the standard-parametrization sweep measured it
# (benchmarks/mup_lr_transfer.py: best 2^-8 at width 256, 2^-10 at 1024): lr = 2^-8 x 256 / width.
# Usage on the GPU machine, from the repository root: benchmarks/scaling_prediction.sh [OUT_DIR] [-- overrides]
# (SMALL_TOKENS="..." TARGET_TOKENS=... shrink the budgets for a smoke test on a CPU)
#   small: widths 128 256 384 x tokens 2M 4M 6M (the largest: 6 x 7.1M x 6M = 2.5e14 FLOPs)
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
sweep() {  # sweep NAME WIDTH TOKENS...: one width's runs, at its learning rate
    local name=$1 width=$2; shift 2
    local lr
    lr=$(python3 -c "print(2 ** -8 * 256 / $width)")
    python3 -m torchtitan_ext.scaling sweep --config train_configs/debug.toml --widths "$width" --tokens "$@" \
        --out "$OUT/$name" -- "${COMMON[@]}" --optimizer.lr "$lr" > "$OUT/$name.log" 2>&1 \
        || { echo "sweep $name failed:"; tail -n 20 "$OUT/$name.log"; exit 1; }
    echo "$name (width $width, lr $lr): $((SECONDS - t0)) s"
}
for w in 128 256 384; do sweep "small_w$w" "$w" ${SMALL_TOKENS:-2e6 4e6 6e6}; done
{ head -n 1 "$OUT/small_w128/runs.csv"; for w in 128 256 384; do tail -n +2 "$OUT/small_w$w/runs.csv"; done; } \
    > "$OUT/runs.csv"
cat "$OUT/runs.csv"
python3 -m torchtitan_ext.scaling fit --input "$OUT/runs.csv" --plot "$OUT/fit.png" > "$OUT/fit_only.json"
sweep target 768 "${TARGET_TOKENS:-1.6e7}"
target=$(tail -n 1 "$OUT/target/runs.csv")
echo "target run (params,tokens,loss,run): $target"
n=$(echo "$target" | cut -d, -f1); d=$(echo "$target" | cut -d, -f2)
python3 -m torchtitan_ext.scaling fit --input "$OUT/runs.csv" --predict "$n,$d" --flops 2.7e15 | tee "$OUT/fit.json"
