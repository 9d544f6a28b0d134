#!/usr/bin/env bash
# One call on a lent H200 for issue 61's float8 goal: 300 steps of the 8-layer llama3_8b proxy in bf16 and in
# float8 with the head, two seeds (the loss_*_8b_l8 scenarios), and float8_8b_l8 ours against the previous
# commit, within BUDGET seconds (default 540). Run from the repository root with .whl/ carried and
# .bench_previous/ prepared; results in $OUT.
# Usage: COMMIT=$(git rev-parse --short HEAD) benchmarks/float8_loss_call.sh
set -u
start=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - start) )); }
WHEELS=.whl source benchmarks/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
record=(); [ -n "${COMMIT:-}" ] && record=(--commit "$COMMIT")
keep_logs() { [ -f "$OUT/logs.tar.gz" ] && mv "$OUT/logs.tar.gz" "$OUT/logs-$1.tar.gz"; }
python3 benchmarks/run.py loss_float8_head_8b_l8 loss_bf16_8b_l8 --runs ours "${record[@]}" --deadline "$(left)"; keep_logs 1
python3 benchmarks/run.py float8_8b_l8 --runs ours,previous "${record[@]}" --deadline "$(left)"; keep_logs 2
python3 benchmarks/run.py loss_float8_head_8b_l8_s1 loss_bf16_8b_l8_s1 --runs ours "${record[@]}" --deadline "$(left)"; keep_logs 3
echo "call: $(( $(date +%s) - start )) s"
