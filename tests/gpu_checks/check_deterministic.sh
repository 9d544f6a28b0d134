#!/usr/bin/env bash
# training.deterministic on one GPU: two identical 20-step runs (debug model, bf16, attention backend auto)
# must log bitwise-equal losses and gradient norms; a third run without it shows whether the default differs.
# About 1 minute. Usage, from the repository root: tests/gpu_checks/check_deterministic.sh [OUT_DIR]
# --smoke runs the same on CPU (tiny model).
set -uo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/check_deterministic}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run_job() {  # run_job NAME LIMIT_S CMD...: CMD into $OUT/NAME (its dump folder), its output in $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    rm -rf "${OUT:?}/$name"
    timeout "$limit" "$@" --job.dump_folder "$OUT/$name" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "run $name: exit $rc"
    [ $rc = 0 ] || grep -iE "error|exception" "$OUT/$name.log" | tail -n 8
}
ARGS=(--config train_configs/debug.toml --data.tokenizer byte --training.steps 20 --metrics.log_freq 1
      --metrics.tensorboard false --checkpoint.enabled false --eval.steps 0)
[ "$SMOKE" = 1 ] && ARGS+=(--job.device cpu --training.steps 4 --model.dim 64 --model.n_layers 2 --training.seq_len 64)
run_job det_a 200 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --training.deterministic true
run_job det_b 200 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --training.deterministic true
run_job default 200 "$PY" -m torchtitan_ext.train "${ARGS[@]}"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

def read(name):
    path = Path(sys.argv[1]) / name / "metrics.jsonl"
    if not path.exists():
        return None
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]

a, b, default = read("det_a"), read("det_b"), read("default")
if not a or not b:
    print("deterministic runs missing (see the errors above)")
    sys.exit(1)
print(f"deterministic runs bitwise equal: {a == b} ({len(a)} steps; last loss {a[-1][1]!r} vs {b[-1][1]!r})")
if default:
    same = sum(x == y for x, y in zip(a, default))
    print(f"default run equal to them at {same} of {len(a)} steps")
sys.exit(0 if a == b else 1)
EOF
