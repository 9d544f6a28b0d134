#!/usr/bin/env bash
# Time to quality (issue 28) on one GPU: the baseline (train_configs/base_200m.toml: AdamW, bf16, cosine,
# compiled) sets the target, its final validation bits per byte (mean over seeds); the candidate
# (train_configs/fast_200m.toml) and its ablations (one part removed each) are timed to that target. Every run
# is `python -m torchtitan_ext.train`, one after another on the same card; benchmarks/time_to_loss.py reads
# their metrics.jsonl (training time without evaluations; compile excluded and included).
#
# Data: the corpus benchmarks/make_corpus.py made with --vocab 8192 (carried in bench_data/code_doc_bpe8k:
# 24.6M training tokens of Python sources and Debian documentation, 0.55M validation tokens held out by
# document). torchao: carry .whl and `WHEELS=.whl source benchmarks/device_prelude.sh` first.
#
# Usage from the repository root on the GPU machine:
#   benchmarks/time_to_loss.sh OUT PHASE... [-- overrides for every run]
#   PHASE: base (seeds $SEEDS), fast (seeds $SEEDS), ablate (seed 0: each of $ABLATIONS), report
#   env: CORPUS (bench_data/code_doc_bpe8k), SEEDS ("0 1"), ABLATIONS (all of the list below), SMOKE=1 (the
#        debug size on a CPU for a few steps, no float8: checks the script)
# A phase skips runs whose metrics.jsonl already ends with the final evaluation (so calls can share OUT).
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without the #s
    sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
OUT="${1:?usage: time_to_loss.sh OUT PHASE... [-- overrides]}"; shift
PHASES=()
while (( $# )) && [ "$1" != "--" ]; do PHASES+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
CORPUS="${CORPUS:-bench_data/code_doc_bpe8k}"
SEEDS="${SEEDS:-0 1}"
# name: the overrides that remove one part of the recipe
declare -A ABLATE=(
    [no_muon]="--optimizer.name adamw --optimizer.lr 6e-4"
    [no_float8]="--float8.enabled false"
    [no_float8_head]="--float8.include_output false"
    [no_qk_norm]="--model.qk_norm false"
    [no_softcap]="--model.logit_softcap 0"
    [no_z_loss]="--training.z_loss 0"
    [wsd]="--lr_scheduler.name wsd --lr_scheduler.warmup_steps 50 --lr_scheduler.decay_fraction 0.3 --lr_scheduler.min_lr_ratio 0"
)
ABLATIONS="${ABLATIONS:-${!ABLATE[*]}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DATA=(--data.dataset shards --data.train_path "$CORPUS/train_*.bin" --data.val_path "$CORPUS/val_*.bin"
      --data.tokenizer "$CORPUS/tokenizer.model")
if [ "${SMOKE:-0}" = 1 ]; then
    DATA+=(--model.flavor debug --training.seq_len 128 --training.local_batch_size 2 --training.compile false
           --training.steps 8 --eval.interval 4 --eval.steps 2 --metrics.log_freq 2 --float8.enabled false
           --lr_scheduler.warmup_steps 2 --job.device cpu)
else
    python3 -c "import torchao" 2>/dev/null \
        || { echo "time_to_loss: torchao is not importable (source benchmarks/device_prelude.sh first)"; exit 1; }
fi
[ -f "$CORPUS/tokenizer.model" ] || { echo "time_to_loss: no corpus in $CORPUS (benchmarks/make_corpus.py)"; exit 1; }

finished() { [ -f "$1/metrics.jsonl" ] && tail -n 1 "$1/metrics.jsonl" | grep -q '"val_bpb"'; }
train() {  # train NAME CONFIG [overrides...]
    local name=$1 config=$2; shift 2
    local dir="$OUT/$name"
    if finished "$dir"; then echo "$name: done before"; return 0; fi
    local t0=$SECONDS
    python3 -m torchtitan_ext.train --config "$config" --job.dump_folder "$dir" --job.overwrite true \
        "${DATA[@]}" "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1 \
        || { echo "$name: failed"; tail -n 15 "$OUT/$name.log"; return 1; }
    echo "$name: $((SECONDS - t0)) s wall; final val loss $(grep -o ' val [0-9.]*' "$OUT/$name.log" | tail -n 1 | cut -c6-)"
}

for phase in "${PHASES[@]}"; do
    case $phase in
        base) for s in $SEEDS; do train "base_s$s" train_configs/base_200m.toml --job.seed "$s" || exit 1; done ;;
        fast) for s in $SEEDS; do train "fast_s$s" train_configs/fast_200m.toml --job.seed "$s" || exit 1; done ;;
        ablate) for a in $ABLATIONS; do
                    # shellcheck disable=SC2086
                    train "fast_$a" train_configs/fast_200m.toml --job.seed 0 ${ABLATE[$a]} || exit 1
                done ;;
        report) base=(); runs=()
                for d in "$OUT"/base_s*; do [ -d "$d" ] && base+=("$d"); done
                for d in "$OUT"/fast_*; do [ -d "$d" ] && runs+=("$d"); done
                python3 benchmarks/time_to_loss.py --baseline "${base[@]}" --runs "${runs[@]}" \
                    --json "$OUT/time_to_loss.json" ;;
        *) echo "time_to_loss: unknown phase $phase (base, fast, ablate, report)"; exit 2 ;;
    esac
done
