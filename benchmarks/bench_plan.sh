#!/usr/bin/env bash
# The memory planner against the measured peak: three single-GPU trainer runs of different size, 8 steps each
# (bf16, compiled, as in RESULTS.md's earlier runs), then `torch.cuda.max_memory_allocated` (metrics.jsonl's
# memory_gib) next to `python -m torchtitan_ext.plan` for the same arguments. About 4 minutes on one H100.
# Usage, from the repository root:
#   benchmarks/bench_plan.sh [OUT_DIR]            # on the GPU machine
#   benchmarks/bench_plan.sh --smoke [OUT_DIR]    # CPU, tiny models: checks the script itself (no memory figure)
# SNAPSHOT=1 also writes a CUDA memory snapshot of step 6 of each run (profiling.memory_snapshot).
set -uo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_plan}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
runs=()
source benchmarks/run_job.sh

COMMON=(--training.steps 8 --checkpoint.enabled false --eval.steps 0 --metrics.log_freq 1
        --metrics.tensorboard false --data.tokenizer byte)
if [ "$SMOKE" = 1 ]; then
    COMMON+=(--job.device cpu --training.steps 3 --model.dim 64 --model.n_layers 2 --model.n_heads 4
             --model.n_kv_heads 2 --model.ffn_hidden 128 --model.vocab_size 512 --training.seq_len 64)
    LIMIT=120
else
    COMMON+=(--training.compile true)
    LIMIT=100
fi
if [ "${SNAPSHOT:-0}" = 1 ]; then
    step=$([ "$SMOKE" = 1 ] && echo 2 || echo 6)
    COMMON+=(--profiling.enabled true --profiling.start_step "$step" --profiling.end_step "$step"
             --profiling.memory_snapshot true)
fi
declare -A ARGS=(
    [600m_bs8]="--config train_configs/debug.toml --model.flavor 600m --training.seq_len 2048 --training.local_batch_size 8"
    [1b_bs16]="--config train_configs/debug.toml --model.flavor 1b --training.seq_len 2048 --training.local_batch_size 16"
    [8b4l_bs4]="--config train_configs/llama3_8b_float8.toml --float8.enabled false --model.n_layers 4 --model.vocab_size 32000 --training.local_batch_size 4 --training.seq_len 4096"
)
NAMES=(600m_bs8 1b_bs16 8b4l_bs4)
for name in "${NAMES[@]}"; do
    # shellcheck disable=SC2206
    extra=(${ARGS[$name]})
    [ "$SMOKE" = 1 ] && extra=(--config "${extra[1]}" --training.local_batch_size 2 --float8.enabled false)  # tiny shapes above
    echo "${extra[*]} ${COMMON[*]}" > "$OUT/$name.args"
    run_job "$name" "$LIMIT" "$PY" -m torchtitan_ext.train "${extra[@]}" "${COMMON[@]}"
    if [ -f "$OUT/$name.log" ] && ! grep -q "^training" "$OUT/$name.log"; then tail -n 15 "$OUT/$name.log"; fi
    "$PY" -m torchtitan_ext.plan "${extra[@]}" "${COMMON[@]}" > "$OUT/$name.plan" 2>&1 \
        || { echo "plan $name failed:"; tail -n 5 "$OUT/$name.plan"; }
done

"$PY" - "$OUT" "${NAMES[@]}" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<10} {'measured GiB':>13} {'planned GiB':>12} {'plan/measured':>14}")
for name in sys.argv[2:]:
    measured = None
    metrics = out / name / "metrics.jsonl"
    if metrics.exists():
        values = [r["memory_gib"] for r in map(json.loads, metrics.read_text().splitlines()) if "memory_gib" in r]
        measured = max(values) if values else None
    plan_file = out / f"{name}.plan"
    m = re.search(r"\(([\d.]+) GiB predicted peak", plan_file.read_text()) if plan_file.exists() else None
    planned = float(m.group(1)) if m else None
    ratio = f"{planned / measured:.3f}" if planned and measured else "n/a"
    fmt = lambda v: f"{v:.2f}" if v is not None else "n/a"  # noqa: E731
    print(f"{name:<10} {fmt(measured):>13} {fmt(planned):>12} {ratio:>14}")
EOF
