#!/usr/bin/env bash
# One call on a lent H200 for issue 61's float8 goal: the float8 GPU tests, then the 8-layer llama3_8b proxy
# in bf16, float8 (blocks), float8 with the head, ours and the previous commit's float8, each within what is
# left of BUDGET seconds (default 560). Run from the repository root with .whl/ carried and .bench_previous/
# prepared (python benchmarks/run.py --prepare-previous REF); results in $OUT (<scenario>.jsonl, gpu_tests.log).
# Usage: COMMIT=$(git rev-parse --short HEAD) benchmarks/float8_call.sh   (env BUDGET, GPU_TEST_TIMEOUT)
set -u
start=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - start) )); }
WHEELS=.whl source benchmarks/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
record=(); [ -n "${COMMIT:-}" ] && record=(--commit "$COMMIT")
TEST_WORKERS=0 timeout -k 5 "${GPU_TEST_TIMEOUT:-150}" launch/test.sh -m gpu -p no:cacheprovider -v \
    tests/unit/ops/test_projections.py tests/unit/quant/test_float8.py -k "projections or tracks_bf16" \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $? after $(( $(date +%s) - start )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -8
keep_logs() { [ -f "$OUT/logs.tar.gz" ] && mv "$OUT/logs.tar.gz" "$OUT/logs-$1.tar.gz"; }
python3 benchmarks/run.py float8_head_8b_l8 dense_8b_l8 float8_8b_l8 --runs ours "${record[@]}" --deadline "$(left)"; keep_logs 1
python3 benchmarks/run.py float8_8b_l8 --runs previous "${record[@]}" --deadline "$(left)"; keep_logs 2
echo "call: $(( $(date +%s) - start )) s"
