#!/usr/bin/env bash
# Expert placement by load (parallelism.ep_rebalance_steps) against the fixed placement, on the MoDE Zen shape of
# bench_mode_scale.sh: EP NPROC without and with rebalancing, alternated (fixed, placed, fixed, placed), then EP 1,
# all in one call on the same GPUs. Each run's metrics.jsonl comes back as OUT_DIR/NAME.jsonl; one line per run
# prints its median tokens/s per GPU over the windows after step 10 (scale_report.py), and for the placed runs
# the experts moved and the most loaded rank's share of the routed tokens before and after, at the last log.
# Usage, on a 2- or 4-GPU machine: OUT_DIR=$OUT benchmarks/bench_expert_placement.sh
#   env: NPROC (2), STEPS (100), EVERY (25: ep_rebalance_steps), LIMIT (seconds per run, 120), SMOKE=1 (the
#        plumbing on CPU: bench_mode_scale.sh --smoke)
set -uo pipefail
case ${1:-} in
    -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "error: unknown argument '$1' (settings come from the environment; --help lists them)" >&2; exit 2 ;;
esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${OUT_DIR:?set OUT_DIR}
NPROC=${NPROC:-2}; STEPS=${STEPS:-100}; EVERY=${EVERY:-25}; LIMIT=${LIMIT:-120}
for key in NPROC STEPS EVERY LIMIT; do
    [[ ${!key} =~ ^[1-9][0-9]*$ ]] || { echo "error: $key='${!key}': expected a positive whole number" >&2; exit 2; }
done
mkdir -p "$OUT_DIR"
one() {  # one NAME EP EXTRA...
    local name=$1 ep=$2; shift 2
    NPROC=$NPROC STEPS=$STEPS LIMIT=$LIMIT DEADLINE=$((LIMIT + 70)) OUT_DIR=/tmp/bep_out/$name WORK=/tmp/bep/$name \
        RUNS="ep$ep" EXTRA="$*" bash benchmarks/bench_mode_scale.sh ${SMOKE:+--smoke} > "/tmp/bep_$name.log" 2>&1
    cp "/tmp/bep/$name/ep$ep/metrics.jsonl" "$OUT_DIR/$name.jsonl" 2>/dev/null
    python3 - "$name" "/tmp/bep_out/$name/summary.jsonl" "$OUT_DIR/$name.jsonl" <<'PY'
import json, sys
name, summary, metrics = sys.argv[1:]
row = json.loads(open(summary).readline() or "{}")
try:
    last = [json.loads(line) for line in open(metrics)][-1]
except (OSError, IndexError):
    last = {}
placed = {k.split("/")[-1]: round(v, 4) for k, v in last.items() if k.startswith("moe/placement/")}
print(json.dumps({"run": name, **{k: row.get(k) for k in ("tokens_per_sec_per_device", "mfu", "peak_memory_gib",
                  "last_loss", "imbalance_mean", "error")}, **placed}))
PY
}
one fixed_a "$NPROC"
one placed_a "$NPROC" --parallelism.ep_rebalance_steps "$EVERY"
one fixed_b "$NPROC"
one placed_b "$NPROC" --parallelism.ep_rebalance_steps "$EVERY"
one ep1 1
