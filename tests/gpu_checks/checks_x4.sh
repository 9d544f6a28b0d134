#!/usr/bin/env bash
# The correctness checks of a stop on one 4-GPU machine, side by side (none of them is timed, so they share
# the GPUs): the multigpu test tier, Squinch's 300-step loss on the two-node bed (bf16 reduce vs Squinch)
# and the multi-node faults on the bed (tests/gpu_checks/two_nodes_faults.py). Speeds printed by the bed runs here are not measurements (the GPUs are shared).
#
# Usage (repository root, torchao importable for the float8 tests):  bash tests/gpu_checks/checks_x4.sh OUT_DIR
#   env: DEADLINE_S (560): every part is stopped by then; PARTS (all: "suite squinch faults");
#        SUITE_K: a pytest -k expression selecting part of the multigpu tier; SUITE_PARTS instead: parts run
#        side by side as separate pytest processes, "PATH|K-EXPRESSION" each, separated by ";" (e.g.
#        "tests/multigpu/test_squinch_nccl.py;tests/multigpu/test_layouts_nccl.py|zb or killed"). Part N
#        writes OUT_DIR/suite_N.log and junit_N.xml; the tier's job logs (each torchrun job's output, finished
#        or not) come back in OUT_DIR/suite_logs.tgz
set -uo pipefail
case ${1:-} in
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    ""|-*) echo "usage: bash tests/gpu_checks/checks_x4.sh OUT_DIR (--help for more)" >&2; exit 2 ;;
esac
OUT=$1
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
DEADLINE=${DEADLINE_S:-560}
PARTS=${PARTS:-suite squinch faults}
for part in $PARTS; do  # every name checked before any part starts
    case $part in suite|squinch|faults) ;;
        *) echo "checks_x4: unknown part '$part' in PARTS (expected suite, squinch, faults)" >&2; exit 2 ;;
    esac
done
W=$(mktemp -d /tmp/checks_x4.XXXXXX)
# The tier through python3's pytest where python3 has what it needs (a lent machine's image, which is what
# launch/test.sh would choose too): on two lent machines launch/test.sh looked for /work/main/.venv instead of
# the copy it ran from and tried to build it from the package index.
if python3 -c "import torch, pytest, xdist, torchao" >/dev/null 2>&1; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    tier=(python3 -m pytest -m multigpu --timeout=0)
else
    tier=(launch/test.sh -m multigpu)
fi
pids=()
for part in $PARTS; do
    case $part in
        suite) # SUITE_K alone: one part, the whole tier filtered by it
               IFS=';' read -ra suite_parts <<< "${SUITE_PARTS:-|${SUITE_K:-}}"
               mkdir -p "$W/suite"
               i=0
               for one in "${suite_parts[@]}"; do
                   i=$((i + 1))
                   path=${one%%|*}; kexpr=${one#*|}; [ "$kexpr" = "$one" ] && kexpr=""
                   MULTIGPU_REPORT=$OUT/multigpu.jsonl timeout "$DEADLINE" "${tier[@]}" -q -rA --durations=15 \
                       --junitxml="$OUT/junit_$i.xml" --basetemp="$W/suite/p$i" $path ${kexpr:+-k "$kexpr"} \
                       > "$OUT/suite_$i.log" 2>&1 &
                   pids+=("$!")
               done
               continue ;;
        squinch) timeout "$DEADLINE" python3 benchmarks/run.py nodes2_bf16 nodes2_squinch --steps 300 \
                   --deadline "$DEADLINE" --out "$OUT/squinch" --work "$W/squinch" > "$OUT/squinch.log" 2>&1 & ;;
        faults) timeout "$DEADLINE" python3 tests/gpu_checks/two_nodes_faults.py "$W/faults" > "$OUT/faults.log" 2>&1 & ;;
    esac
    pids+=("$!")
done
for pid in "${pids[@]}"; do wait "$pid"; done
# The per-step losses of the bed runs, small enough to bring back.
find "$W" -name metrics.jsonl -not -path "$W/suite/*" | tar czf "$OUT/metrics.tgz" -T - 2>/dev/null
[ -d "$W/suite" ] && find "$W/suite" \( -name "*.log" -o -name "*.stacks" \) | tar czf "$OUT/suite_logs.tgz" -T - 2>/dev/null
echo "checks_x4: done after $SECONDS s; $(ls "$OUT")"
