#!/usr/bin/env bash
# One H100: the trainer on a llama3_8b-shaped model with fewer layers, compiled, in bf16 and with float8
# tensorwise, rowwise (torchao Float8Linear) and blockwise (1x128 / 128x128 block scales,
# quant/float8_blockwise.py). Phase 1: 30-step throughput runs of every variant. Phase 2 (when the time
# budget allows): 300 steps of the LOSS_VARIANTS for each of SEEDS on the same data, logging every step's loss
# and ending with a validation loss (EVAL_STEPS batches held out). Prints a table (losses: means over the
# seeds) and writes summary.json. The defaults fit in about 9 minutes on one H100.
#
# Usage from the repository root:  benchmarks/bench_float8.sh [--smoke] [OUT_DIR]
#   env: VARIANTS ("bf16 tensorwise rowwise blockwise") LOSS_VARIANTS ("bf16 blockwise": phase 2's runs)
#        SEEDS ("0": phase 2's seeds) EVAL_STEPS (16) LAYERS (4) SEQ (4096) BATCH (2) LOSS_STEPS (300)
#        BUDGET_S (500: phase 2 runs only if its predicted time fits what is left) PYTHON (python3)
#        VOCAB (the flavor's 128256: the model's vocabulary, e.g. 128512 = 251 x 512 so that a blockwise
#        output head can convert); a variant RECIPE_head (e.g. blockwise_head) runs the output head in
#        float8 too (float8.filter_fqns = [])
#        EXTRA (trainer overrides added to every run, e.g. EXTRA="--activation_checkpoint.mode selective
#        --activation_checkpoint.selective_every 0")
#   --smoke: the debug flavor on CPU in a minute, to check the script; the float8 runs must then be
#            refused with the one-line error (no FP8 on CPU), which the table shows.
# torchao comes from the wheel carried in .whl/ (the GPU machine has no package index).
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without the #s
    sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
case "${SEEDS:-0}" in *[!0-9\ ]*) echo "error: SEEDS='$SEEDS': expected whole numbers separated by spaces"; exit 2 ;; esac
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_float8}}"
PY="${PYTHON:-python3}"
START=$SECONDS
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

source benchmarks/torchao_wheel.sh
use_torchao_wheel bench_float8 "$SMOKE" || exit 1
"$PY" -c "import torch, torchao; print(f'torch {torch.__version__}, torchao {torchao.__version__}')" 2>&1 \
    | grep -v "Failed to load" || { (( SMOKE )) || exit 1; }

if (( SMOKE )); then
    SHAPE=(--model.flavor debug --training.seq_len 128 --training.local_batch_size 4 --job.device cpu
           --training.compile false --data.tokenizer byte)
    STEPS1=6; LOSS_STEPS=${LOSS_STEPS:-12}; BUDGET_S=${BUDGET_S:-600}
else
    SHAPE=(--model.n_layers "${LAYERS:-4}" --training.seq_len "${SEQ:-4096}"
           --training.local_batch_size "${BATCH:-2}" ${VOCAB:+--model.vocab_size "$VOCAB"})
    STEPS1=30; LOSS_STEPS=${LOSS_STEPS:-300}; BUDGET_S=${BUDGET_S:-500}
fi
read -ra VARIANTS <<< "${VARIANTS:-bf16 tensorwise rowwise blockwise}"
read -ra LOSS_VARIANTS <<< "${LOSS_VARIANTS:-bf16 blockwise}"
read -ra SEEDS <<< "${SEEDS:-0}"
read -ra EXTRA_ARGS <<< "${EXTRA:-}"
flags() {  # the float8 overrides of a variant; RECIPE_head: the output head in float8 too
    case $1 in
        bf16) echo "--float8.enabled false" ;;
        *_head) echo "--float8.enabled true --float8.recipe ${1%_head} --float8.filter_fqns []" ;;
        *) echo "--float8.enabled true --float8.recipe $1" ;;
    esac
}
run() {  # run NAME STEPS VARIANT [OVERRIDES...]: one trainer job; its wall time goes to NAME.seconds
    local name=$1 steps=$2 variant=$3 t0=$SECONDS f
    shift 3
    read -ra f <<< "$(flags "$variant")"  # not globbed: "[]" is a value, not a pattern
    "$PY" -m torchtitan_ext.train --config train_configs/llama3_8b_float8.toml \
        --job.dump_folder "$OUT/$name" "${SHAPE[@]}" --training.steps "$steps" \
        --lr_scheduler.warmup_steps $(( steps / 10 )) "${f[@]}" "${EXTRA_ARGS[@]}" "$@" > "$OUT/$name.log" 2>&1 \
        || { echo "run $name failed:"; grep -v "Failed to load" "$OUT/$name.log" | tail -n 5; }
    echo $(( SECONDS - t0 )) > "$OUT/$name.seconds"
}

rm -rf "${VARIANTS[@]/#/$OUT/tp_}" "$OUT"/loss_*
for v in "${VARIANTS[@]}"; do run "tp_$v" "$STEPS1" "$v"; done

# Phase 2 if it fits: each run's startup (wall time minus its steps) plus LOSS_STEPS at its measured speed.
PLAN=$("$PY" - "$OUT" "$STEPS1" "$LOSS_STEPS" "${#SEEDS[@]}" "${LOSS_VARIANTS[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, steps1, steps2, seeds, variants = Path(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5:]
total = 0.0
for v in variants:
    if not (out / f"tp_{v}.seconds").exists():
        continue  # not among VARIANTS: no phase 1 run to predict from, and none in phase 2
    wall = float((out / f"tp_{v}.seconds").read_text())
    rows = [json.loads(x) for x in (out / f"tp_{v}" / "metrics.jsonl").read_text().splitlines()] \
        if (out / f"tp_{v}" / "metrics.jsonl").exists() else []
    if not rows:
        continue  # refused or failed: phase 2 skips it
    # seconds per step from the logged tokens/s: tokens per step = batch x seq, read from the run's config
    cfg = (out / f"tp_{v}" / "config.toml").read_text()
    get = lambda key: int(next(l.split("=")[1] for l in cfg.splitlines() if l.strip().startswith(key + " ")))
    tokens = get("local_batch_size") * get("seq_len")
    tps = statistics.median(r["tokens_per_sec"] for r in rows[1:] or rows)
    step_s = tokens / tps
    total += seeds * (max(wall - steps1 * step_s, 0) + steps2 * step_s)  # a start-up and the steps per seed
print(round(total))
EOF
)
LEFT=$(( BUDGET_S - (SECONDS - START) ))
if [[ -n "$PLAN" ]] && (( PLAN <= LEFT )); then
    echo "phase 2: ${LOSS_STEPS}-step loss runs, seeds ${SEEDS[*]}, predicted ${PLAN}s of ${LEFT}s left"
    for seed in "${SEEDS[@]}"; do
        for v in "${LOSS_VARIANTS[@]}"; do  # a variant refused or failed in phase 1 would fail the same way
            [[ -s "$OUT/tp_$v/metrics.jsonl" ]] && run "loss_${v}_s$seed" "$LOSS_STEPS" "$v" \
                --job.seed "$seed" --metrics.log_freq 1 --eval.steps "${EVAL_STEPS:-16}"
        done
    done
else
    echo "phase 2 skipped: predicted ${PLAN:-?}s, ${LEFT}s left of BUDGET_S=$BUDGET_S"
fi

"$PY" benchmarks/compare_variants.py "$OUT" "${VARIANTS[@]}"
echo "total ${SECONDS}s; logs and metrics in $OUT"
