#!/usr/bin/env bash
# Scaling-law prediction measured (issue 29): fit L(N, D) on a sweep of small runs, each with at most 1/10 of
# the target run's compute (C = 6 N D, N non-embedding), predict the target's final validation loss, train the
# target, compare. Every run goes through `python -m torchtitan_ext.scaling sweep` (-> `python -m
# torchtitan_ext.train`); all of them share one GPU at once (the losses do not depend on the timing).
#
# Data: a corpus made by benchmarks/make_corpus.py (CORPUS; a 512-piece BPE): on the GPU machine, from the text
# found there with the carried tokenizer (`make_corpus.py --out DIR` over a DIR holding tokenizer.model), big
# enough that no run repeats data. The AdamW learning rate follows the width as the standard-parametrization
# sweep measured it (benchmarks/mup_lr_transfer.py: best 2^-8 at width 256, 2^-10 at 1024): lr = 2^-8 x 256 /
# width. The target trains about 20 tokens per parameter (compute-optimal by Chinchilla's rule of thumb), the
# regime the law describes; the small runs lie on both sides of that ratio. Every small run trains at least
# ~1,000 steps (8M tokens): shorter runs sit in the first, warmup-dominated phase of training, outside the law
# (the third attempt's fit over its runs of 2M and 4M tokens missed by 4.8%; refitted without them, 2.5%). The
# widths reach 256, the widest that fits 8M tokens and two budgets under the 1/10 compute cap.
#
# Usage on the GPU machine, from the repository root:
#   benchmarks/scaling_prediction.sh [OUT_DIR] [-- trainer overrides]
#   env CORPUS (bench_data/code_doc_bpe512); SCALE (1: the token budgets below; 0.001 on a CPU smoke test)
#   small (width:parallel:tokens): SMALL, default 64 x 8M 16M 32M 64M; 128 x 8M 16M 32M 48M;
#          192 x 8M 16M 24M; 256 x 8M 14M (the largest: 6 x 3.15M x 14M = 2.6e14 FLOPs)
#   target: TARGET, default width 320 (4.67M non-embedding parameters) x 100M tokens (2.8e15 FLOPs)
#   RUNS: a runs.csv of small runs trained before (an earlier OUT/runs.csv): the fit uses them too. With RUNS,
#         SMALL defaults to none (only the target trains); set SMALL to train more small runs beside them.
#   PREDICT_ONLY=1: train the small runs, fit, write the target's prediction (OUT/fit.json) and stop;
#         OUT/runs.csv then holds every small run, for a later RUNS=OUT/runs.csv call that trains the target
#         (the prediction is on record before the target trains).
#   MUP_BASE: a width (e.g. 256): every run in muP (model.parametrization = mup, mup_base_dim MUP_BASE) at the
#         learning rate muP transferred between widths 256 and 1024 (2^-8; the same for every width, muP
#         scales it per parameter group) instead of the standard-parametrization rule above.
#   LR_SCALE (1): multiplies every run's learning rate (either rule above), to check how far a run sits from
#         its best learning rate.
#   Before anything trains, benchmarks/scaling_check_cap.py checks that every small run (RUNS and SMALL) uses
#   at most 1/10 of the target's compute.
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without the #s
    sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
OUT="${1:-/tmp/scaling_prediction}"
shift $(( $# > 0 ? 1 : 0 ))
[ "${1:-}" = "--" ] && shift
CORPUS="${CORPUS:-bench_data/code_doc_bpe512}"
SCALE="${SCALE:-1}"
RUNS="${RUNS:-}"
DEFAULT_SMALL="64:2:8e6,64e6,16e6,32e6 128:2:8e6,48e6,16e6,32e6 192:3:8e6,16e6,24e6 256:2:8e6,14e6"
[ -n "$RUNS" ] && DEFAULT_SMALL=""
SMALL="${SMALL-$DEFAULT_SMALL}"
TARGET="${TARGET:-320:100e6}"
PREDICT_ONLY="${PREDICT_ONLY:-0}"
MUP_BASE="${MUP_BASE:-}"
[[ -z "$MUP_BASE" || "$MUP_BASE" =~ ^[1-9][0-9]*$ ]] || { echo "MUP_BASE=$MUP_BASE: expected a width (a whole number)"; exit 1; }
LR_SCALE="${LR_SCALE:-1}"
[[ "$LR_SCALE" =~ ^[0-9]*\.?[0-9]+$ && ! "$LR_SCALE" =~ ^[0.]+$ ]] || { echo "LR_SCALE=$LR_SCALE: expected a positive number"; exit 1; }
[ -z "$RUNS" ] || [ -f "$RUNS" ] || { echo "RUNS=$RUNS: no such runs.csv"; exit 1; }
[ -f "$CORPUS/tokenizer.model" ] || { echo "no corpus in $CORPUS: run benchmarks/make_corpus.py and carry it"; exit 1; }
COMMON=(--data.dataset shards --data.train_path "$CORPUS/train_*.bin" --data.val_path "$CORPUS/val_*.bin"
        --data.tokenizer "$CORPUS/tokenizer.model" --training.local_batch_size 32 --training.seq_len 256
        --lr_scheduler.warmup_steps 50 --checkpoint.enabled false --metrics.tensorboard false
        --metrics.log_freq 200 --eval.steps 40)
[ -n "$MUP_BASE" ] && COMMON+=(--model.parametrization mup --model.mup_base_dim "$MUP_BASE")
COMMON+=("$@")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/*.py import the package
t0=$SECONDS
tokens() { python3 -c "import sys; print(*(int(float(t) * $SCALE) for t in sys.argv[1:]))" "$@"; }
sweep() {  # sweep NAME WIDTH PARALLEL TOKENS...: one width's runs at its learning rate
    local name=$1 width=$2 parallel=$3; shift 3
    local lr
    lr=$(python3 -c "print($LR_SCALE * 2 ** -8 * (256 / $width if '$MUP_BASE' == '' else 1))")
    # shellcheck disable=SC2046
    python3 -m torchtitan_ext.scaling sweep --config train_configs/debug.toml --widths "$width" \
        --tokens $(tokens "$@") --parallel "$parallel" --out "$OUT/$name" -- "${COMMON[@]}" --optimizer.lr "$lr" \
        > "$OUT/$name.log" 2>&1 || { echo "sweep $name failed:"; tail -n 20 "$OUT/$name.log"; return 1; }
    echo "$name (width $width, lr $lr): done at $((SECONDS - t0)) s"
}
python3 benchmarks/scaling_check_cap.py "$SCALE" "$TARGET" "$SMALL" "$RUNS" -- "${COMMON[@]}" > "$OUT/cap.txt" \
    || { tail -n 1 "$OUT/cap.txt"; exit 1; }
tail -n +2 "$OUT/cap.txt"
# The tokenizer's vocabulary is checked and the shards scanned once, before the runs start at once.
python3 -m torchtitan_ext.train --config train_configs/debug.toml "${COMMON[@]}" --training.steps 1 \
    --job.dump_folder "$OUT/warmup" > "$OUT/warmup.log" 2>&1 || { tail -n 20 "$OUT/warmup.log"; exit 1; }
pids=()
target_width=${TARGET%%:*}
(( PREDICT_ONLY )) || { sweep target "$target_width" 1 "${TARGET#*:}" & pids+=($!); }
widths=()
for spec in $SMALL; do  # WIDTH:PARALLEL:T1,T2,...
    IFS=: read -r w par toks <<< "$spec"
    widths+=("$w")
    # shellcheck disable=SC2086
    sweep "small_w$w" "$w" "$par" ${toks//,/ } & pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
(( failed )) && exit 1
{ echo "params,tokens,loss,run"; [ -z "$RUNS" ] || tail -n +2 "$RUNS" | tr -d '\r' | cut -d, -f1-4
  for w in "${widths[@]}"; do tail -n +2 "$OUT/small_w$w/runs.csv" | tr -d '\r'; done; } > "$OUT/runs.csv"
cat "$OUT/runs.csv"
n_d=$(head -n 1 "$OUT/cap.txt"); n=${n_d%,*}; d=${n_d#*,}
python3 -m torchtitan_ext.scaling fit --input "$OUT/runs.csv" --predict "$n,$d" --plot "$OUT/fit.png" \
    > "$OUT/fit.json" || exit 1
cat "$OUT/fit.json"
if (( PREDICT_ONLY )); then
    echo "predicted for the target $TARGET (N $n, D $d); train it with RUNS=$OUT/runs.csv. total: $((SECONDS - t0)) s"
    exit 0
fi
target=$(tail -n 1 "$OUT/target/runs.csv" | tr -d '\r')
echo "target run (params,tokens,loss,run): $target"
python3 -m torchtitan_ext.scaling fit --input "$OUT/runs.csv" --flops "$(python3 -c "print(6 * $n * $d)")"  # its split
python3 - "$OUT/fit.json" "$target" <<'EOF'
import json, sys
fit, measured = json.load(open(sys.argv[1])), float(sys.argv[2].split(",")[2])
predicted = fit["prediction"]["loss"] if isinstance(fit.get("prediction"), dict) else fit["prediction"]
print(json.dumps({"predicted": round(predicted, 4), "measured": round(measured, 4),
                  "miss_percent": round(100 * (predicted - measured) / measured, 2)}))
EOF
echo "total: $((SECONDS - t0)) s"
