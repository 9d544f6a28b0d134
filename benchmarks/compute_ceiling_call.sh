#!/usr/bin/env bash
# One call on a lent H200 for the one-GPU compute ceilings (issue 61): the fused-projection microbenchmark,
# then the trainer's own step profiled per kernel (torch.profiler through [profiling], tabled by
# kernel_table.py) for the scenarios named, each within what is left of BUDGET seconds (default 560).
# Run from the repository root with .whl/ carried; the tables come back in $OUT (k_<scenario>.txt / .json,
# micro.jsonl, <scenario>.log).
# Usage: PROFILE="dense_1b dense_8b_l8 float8_8b_l8" MICRO=1 benchmarks/compute_ceiling_call.sh
set -u
start=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - start) )); }
WHEELS=.whl source benchmarks/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
if [ "${MICRO:-1}" = 1 ]; then
    timeout -k 5 "${MICRO_TIMEOUT:-200}" python3 benchmarks/micro/fused_projections.py > "$OUT/micro.jsonl" 2> "$OUT/micro.err"
    echo "micro: exit $? after $(( $(date +%s) - start )) s"; cat "$OUT/micro.jsonl"; tail -3 "$OUT/micro.err"
fi
for name in ${PROFILE:-}; do
    [ "$(left)" -lt 100 ] && { echo "$name: skipped, $(left) s left"; continue; }
    args=$(python3 -c "
import shlex, sys, tomllib
s = tomllib.load(open('benchmarks/scenarios.toml', 'rb'))
d, c = s['defaults'], s['scenario']['$name']
print(' '.join(['--config', c.get('config', d['config']), d['trainer_args'], c['args'],
                '--training.local_batch_size', str(c['batch']), '--training.seq_len', str(c['seq'])]))")
    # shellcheck disable=SC2086
    timeout -k 5 "$(( $(left) - 10 ))" python3 -m torchtitan_ext.train $args --training.steps 12 \
        --metrics.log_freq 2 --profiling.enabled true --profiling.start_step 10 --profiling.end_step 11 \
        --job.dump_folder "/tmp/prof_$name" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $(( $(date +%s) - start )) s; $(grep -E 'step +1[01]' "$OUT/$name.log" | tail -1)"
    python3 benchmarks/kernel_table.py "/tmp/prof_$name/profile" "$OUT/k_$name" 2>&1 | tail -2
done
echo "call: $(( $(date +%s) - start )) s"
