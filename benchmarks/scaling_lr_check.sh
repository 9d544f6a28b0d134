#!/usr/bin/env bash
# Issue 29, a diagnosis: do the scaling sweep's small runs sit at their best learning rate? Each of SCALES
# multiplies the sweep's learning-rate rule (benchmarks/scaling_prediction.sh: 2^-8 x 256 / width) for the
# SMALL runs (default: width 128 x 16M tokens and width 448 x 13.2M, a narrow and a wide run of attempt 6);
# all of them share the GPU at once. Prints each run's final validation loss per scale.
# Usage on the GPU machine, from the repository root:  benchmarks/scaling_lr_check.sh [OUT_DIR [-- overrides]]
#   env CORPUS (as scaling_prediction.sh), SCALES ("0.5 1 2"), SMALL ("128:1:16e6 448:1:13.2e6"), SCALE (1)
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without the #s
    sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for s in ${SCALES:-0.5 1 2}; do
    [[ "$s" =~ ^[0-9]*\.?[0-9]+$ && ! "$s" =~ ^[0.]+$ ]] || { echo "error: SCALES: '$s' is not a positive number" >&2; exit 2; }
done
OUT="${1:-/tmp/scaling_lr_check}"
shift $(( $# > 0 ? 1 : 0 ))
mkdir -p "$OUT"
for s in ${SCALES:-0.5 1 2}; do
    # PREDICT_ONLY trains the small runs and stops; its fit of fewer than 5 runs is refused, which is expected.
    LR_SCALE=$s PREDICT_ONLY=1 TARGET=512:100e6 SMALL="${SMALL:-128:1:16e6 448:1:13.2e6}" \
        benchmarks/scaling_prediction.sh "$OUT/lr$s" "$@" > "$OUT/lr$s.log" 2>&1 &
done
wait
for s in ${SCALES:-0.5 1 2}; do
    echo "lr x $s:"
    [ -f "$OUT/lr$s/runs.csv" ] && tail -n +2 "$OUT/lr$s/runs.csv" || tail -n 5 "$OUT/lr$s.log"
done
