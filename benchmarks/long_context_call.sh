#!/usr/bin/env bash
# One call on a lent H200 for the long-context work: the GPU test tier, then the long-context scenarios of
# scenarios.toml (ours, torchtitan 0.2.0 beside long_64k), the most important first, each within what is left
# of BUDGET seconds (default 560). Run from the repository root with .whl/ and .ttbench/ carried; the results
# come back in $OUT (<scenario>.jsonl, logs-N.tar.gz, gpu_tests.log).
# Usage: COMMIT=$(git rev-parse --short HEAD) benchmarks/long_context_call.sh   (env BUDGET, GPU_TEST_TIMEOUT;
# COMMIT is what the lines record: the device's copy of the tree has no git history of its own)
set -u
start=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - start) )); }
WHEELS=.whl source benchmarks/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1
record=(); [ -n "${COMMIT:-}" ] && record=(--commit "$COMMIT")
timeout -k 5 "${GPU_TEST_TIMEOUT:-200}" launch/test.sh -m gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tier: exit $? after $(( $(date +%s) - start )) s; $(tail -1 "$OUT/gpu_tests.log")"
keep_logs() { [ -f "$OUT/logs.tar.gz" ] && mv "$OUT/logs.tar.gz" "$OUT/logs-$1.tar.gz"; }
python3 benchmarks/run.py long_64k --runs ours,torchtitan "${record[@]}" --deadline "$(left)"; keep_logs 1
python3 benchmarks/run.py long_128k long_32k long_64k_eager long_128k_eager long_32k_eager --runs ours "${record[@]}" \
    --deadline "$(left)"; keep_logs 2
[ "$(left)" -gt 150 ] && python3 benchmarks/run.py long_128k --runs torchtitan "${record[@]}" --deadline "$(left)"; keep_logs 3
echo "call: $(( $(date +%s) - start )) s"
