#!/usr/bin/env bash
# One H100: the trainer on the MoDE bench shape (the model of bench_mode_compile.sh: d_model 2048, 4 MoDE
# layers of 16 experts, top-2, moe_hidden 1408, vocabulary 32000, 8 x 2048 tokens, compiled, one GPU, no EP)
# in bf16 and in float8 (tensorwise linears + float8.experts: the experts' grouped GEMMs in float8 rowwise).
# Phase 1: 30-step throughput runs. Phase 2 (when BUDGET_S allows): LOSS_STEPS steps of each on the same data
# (same seed) for the loss. Prints tokens/s, MFU, the float8 / bf16 ratio and the losses; writes summary.json.
#
# Usage from the repository root:  benchmarks/bench_float8_mode.sh [OUT_DIR [OVERRIDES...]]
#   env: VARIANTS ("bf16 float8"; also "float8_linears": tensorwise linears, experts in bf16)
#        LOSS_STEPS (300) BUDGET_S (400: phase 2 runs only if its predicted time fits what is left) PYTHON
# torchao comes from the wheel carried in .whl/ (the GPU machine has no package index).
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_float8_mode}}"
shift || true
PY="${PYTHON:-python3}"
START=$SECONDS
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

source benchmarks/torchao_wheel.sh
use_torchao_wheel bench_float8_mode || exit 1
"$PY" -c "import torch, torchao; print(f'torch {torch.__version__}, torchao {torchao.__version__}')" 2>&1 \
    | grep -v "Failed to load" || exit 1

LOSS_STEPS=${LOSS_STEPS:-300}
BUDGET_S=${BUDGET_S:-400}
read -r -a VARIANTS <<< "${VARIANTS:-bf16 float8}"
ARGS=(--config train_configs/mode_debug.toml --parallelism.ep 1 --parallelism.dp_shard 1
      --data.tokenizer byte --checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false
      --optimizer.lr 3e-4
      --model.dim 2048 --model.n_heads 16 --model.n_kv_heads 8 --model.n_layers 4 --model.n_experts 16
      --model.top_k 2 --model.moe_hidden 1408 --model.vocab_size 32000 --training.seq_len 2048
      --training.local_batch_size 8 --training.compile true "$@")
flags() {  # the float8 overrides of a variant
    case $1 in
        bf16) echo "--float8.enabled false" ;;
        float8) echo "--float8.enabled true --float8.recipe tensorwise --float8.experts true" ;;
        float8_linears) echo "--float8.enabled true --float8.recipe tensorwise --float8.experts false" ;;
        *) echo "unknown variant $1" >&2; exit 1 ;;
    esac
}
run() {  # run NAME STEPS VARIANT: one trainer job; its wall time goes to NAME.seconds
    local name=$1 steps=$2 variant=$3 t0=$SECONDS
    # shellcheck disable=SC2046
    timeout 300 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --job.dump_folder "$OUT/$name" \
        --training.steps "$steps" --metrics.log_freq $(( steps >= 100 ? 10 : 5 )) \
        --lr_scheduler.warmup_steps $(( steps / 10 )) $(flags "$variant") > "$OUT/$name.log" 2>&1 \
        || { echo "run $name failed:"; grep -v "Failed to load" "$OUT/$name.log" | tail -n 5; }
    echo "run $name: $(( SECONDS - t0 ))s"
    echo $(( SECONDS - t0 )) > "$OUT/$name.seconds"
}

rm -rf "${VARIANTS[@]/#/$OUT/tp_}" "${VARIANTS[@]/#/$OUT/loss_}"
for v in "${VARIANTS[@]}"; do run "tp_$v" 30 "$v"; done

# Phase 2 if it fits: each run's startup (wall time minus its steps) plus LOSS_STEPS at its measured speed.
PLAN=$("$PY" - "$OUT" "$LOSS_STEPS" "${VARIANTS[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, steps2, variants = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
total = 0.0
for v in variants:
    path = out / f"tp_{v}" / "metrics.jsonl"
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r] if path.exists() else []
    if not rows:
        continue  # failed: phase 2 skips it
    step_s = 8 * 2048 / statistics.median(r["tokens_per_sec"] for r in rows[2:] or rows)
    wall = float((out / f"tp_{v}.seconds").read_text())
    total += max(wall - 30 * step_s, 0) + steps2 * step_s
print(round(total))
EOF
)
LEFT=$(( BUDGET_S - (SECONDS - START) ))
if [[ -n "$PLAN" ]] && (( PLAN <= LEFT )); then
    echo "phase 2: ${LOSS_STEPS}-step loss runs, predicted ${PLAN}s of ${LEFT}s left"
    for v in "${VARIANTS[@]}"; do
        [[ -s "$OUT/tp_$v/metrics.jsonl" ]] && run "loss_$v" "$LOSS_STEPS" "$v"
    done
else
    echo "phase 2 skipped: predicted ${PLAN:-?}s, ${LEFT}s left of BUDGET_S=$BUDGET_S"
fi

"$PY" benchmarks/compare_variants.py "$OUT" "${VARIANTS[@]}" --note "float8 experts:"
echo "total ${SECONDS}s; logs and metrics in $OUT"
