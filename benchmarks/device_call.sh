#!/usr/bin/env bash
# One call on a lent GPU machine: the steps given, in order, each within what is left of BUDGET seconds
# (default 560). Run from the repository root with .whl/ carried (and .ttbench/ for torchtitan or the plain
# script, .bench_previous/ for `--runs previous`: python benchmarks/run.py --prepare-previous REF). A step is
# one argument, a word and its arguments (split at spaces, no quoting):
#   tests ARGS...      launch/test.sh ARGS (one pytest process), at most TEST_TIMEOUT s (default 200); log in
#                      $OUT/tests-N.log
#   micro SCRIPT ARGS  python3 SCRIPT ARGS (a benchmarks/micro/ script), at most MICRO_TIMEOUT s (default 200);
#                      its lines in $OUT/micro-N.jsonl
#   profile SCENARIO [TREE [ARGS...]]  12 steps of the scenario through the trainer of TREE (default .: this
#                      one; e.g. .bench_previous) with ARGS added, steps 10-11 traced by [profiling] and tabled
#                      per kernel by kernel_table.py: $OUT/k_SCENARIO-N.txt / .json, $OUT/SCENARIO-N.log (N: the
#                      step's number); with --profiling.with_stack true also the GPU's idle time by host frame
#                      (trace_gaps.py): $OUT/gaps_SCENARIO-N.txt
#   run ARGS...        python3 benchmarks/run.py ARGS (scenarios, --runs ...): $OUT/<scenario>.jsonl, logs-N.tar.gz
# Usage: COMMIT=$(git rev-parse --short HEAD) benchmarks/device_call.sh 'tests -m gpu' \
#            'profile mode_ep_rank' 'run mode_ep_rank --runs ours,previous'
# COMMIT is what the results record: the device's copy of the tree has no git history of its own. Every file
# named above lands in a scratch folder that $OUT/call.tar.gz holds after each step (the machine returns a
# few files only, and a call cut by its limit keeps what the steps before wrote).
case ${1:-} in -h|--help) sed -n '2,20p' "$0"; exit 0 ;; esac
set -u
start=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - start) )); }
WHEELS=.whl source benchmarks/device_prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
record=(); [ -n "${COMMIT:-}" ] && record=(--commit "$COMMIT")
results=$OUT; OUT=$(mktemp -d)

scenario_args() {  # the trainer's arguments of scenario $1, from benchmarks/run.py's own reading of it
    python3 -c "
import sys
sys.path.insert(0, 'benchmarks')
from run import load_scenarios
scenarios = load_scenarios()
if sys.argv[1] not in scenarios:
    sys.exit(f'device_call.sh: profile: no scenario {sys.argv[1]!r} in benchmarks/scenarios.toml')
s = scenarios[sys.argv[1]]
print(' '.join(s.trainer_args(s.config)))" "$1"  # words without spaces: read -a splits them
}

n=0
for step in "$@"; do
    n=$((n + 1))
    read -r -a words <<< "$step"
    kind=${words[0]}; rest=("${words[@]:1}")
    if [ "$(left)" -lt 60 ]; then echo "step $n ($step): skipped, $(left) s left"; continue; fi
    case $kind in
        tests)
            TEST_WORKERS=0 timeout -k 5 "$(( $(left) < ${TEST_TIMEOUT:-200} ? $(left) : ${TEST_TIMEOUT:-200} ))" \
                launch/test.sh -p no:cacheprovider "${rest[@]}" > "$OUT/tests-$n.log" 2>&1
            echo "step $n tests: exit $?; $(tail -1 "$OUT/tests-$n.log")" ;;
        micro)
            timeout -k 5 "$(( $(left) < ${MICRO_TIMEOUT:-200} ? $(left) : ${MICRO_TIMEOUT:-200} ))" \
                python3 "${rest[@]}" > "$OUT/micro-$n.jsonl" 2> "$OUT/micro-$n.err"
            echo "step $n micro: exit $?"; cat "$OUT/micro-$n.jsonl"; tail -3 "$OUT/micro-$n.err" ;;
        profile)
            name=${rest[0]:-}; tree=${rest[1]:-.}; tag=$name-$n
            scenario=$(scenario_args "$name") || exit 2
            read -r -a args <<< "$scenario"
            (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout -k 5 "$(( $(left) - 10 ))" python3 -m torchtitan_ext.train \
                "${args[@]}" --training.steps 12 --metrics.log_freq 2 \
                --profiling.enabled true --profiling.start_step 10 --profiling.end_step 11 \
                --job.dump_folder "/tmp/prof_$tag" "${rest[@]:2}") > "$OUT/$tag.log" 2>&1
            echo "step $n profile $name ($tree ${rest[*]:2}): exit $?; $(grep -E 'step +1[01]' "$OUT/$tag.log" | tail -1)"
            python3 benchmarks/kernel_table.py "/tmp/prof_$tag/profile" "$OUT/k_$tag" 2>&1 | tail -2
            if [[ " ${rest[*]} " == *" --profiling.with_stack true "* ]]; then  # the GPU's idle time by host frame
                python3 benchmarks/trace_gaps.py /tmp/prof_"$tag"/profile/rank0_*.json 20 > "$OUT/gaps_$tag.txt" 2>&1
                head -16 "$OUT/gaps_$tag.txt"
            fi ;;
        run)
            OUT=$OUT python3 benchmarks/run.py "${rest[@]}" "${record[@]}" --deadline "$(left)"
            [ -f "$OUT/logs.tar.gz" ] && mv "$OUT/logs.tar.gz" "$OUT/logs-$n.tar.gz" ;;
        *) echo "device_call.sh: step $n: unknown kind '$kind' (tests, micro, profile or run)" >&2; exit 2 ;;
    esac
    tar czf "$results/call.tar.gz" -C "$OUT" .
done
echo "call: $(( $(date +%s) - start )) s"
