#!/usr/bin/env bash
# Issue 15 on one GPU machine (16 CPU cores), in parts (PARTS, default "prepare generate domains"):
#   prepare:  data.prepare throughput 1 -> 8 workers (byte tokens, heuristics + MinHash filters);
#   generate: generation tokens/s with the KV cache for the 1b shape (random init, bf16);
#   domains:  train_configs/domains_debug.toml with static vs adaptive mixing, the same DOMAIN_STEPS (600)
#             steps each, evaluated every 25 steps: per-domain validation bpb and the final weights.
# The domains corpus (code / prose / man) must come from a machine with manual pages (the GPU machine has
# none): build it in the repository's ignored outputs/ folder (about 26 MB, seconds)
#   python -m torchtitan_ext.data.domains_corpus --output outputs/domains_corpus --max-mb 4
# and bring it along (the run tool's carry=["outputs/domains_corpus"]). Without it the script builds one
# where it runs and says which domains that machine has; a missing domain then fails the domains part.
# Usage from the repository root:
#   PARTS="generate domains" benchmarks/bench_data_eval.sh [OUT_DIR] [DOMAIN_STEPS]   # ~3 min on one H100
#   benchmarks/bench_data_eval.sh --smoke [OUT_DIR]   # CPU, tiny shapes: checks the script itself
set -uo pipefail
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_data_eval}}"
STEPS="${2:-600}"
PARTS="${PARTS:-prepare generate domains}"
PY="${PYTHON:-python3}"
CORPUS="${CORPUS:-outputs/domains_corpus}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no GPU"
"$PY" -c "import torch; print('torch', torch.__version__)"
DOMAIN_ARGS=(--eval.interval 25 --eval.steps 4)
if (( SMOKE )); then
    STEPS=20
    DOMAIN_ARGS=(--eval.interval 10 --eval.steps 2 --job.device cpu --model.n_layers 2 --model.dim 64
                 --training.seq_len 64 --training.local_batch_size 4 --data.mixing_rate 0.5)
fi

if [[ " $PARTS " == *" prepare "* ]]; then
    "$PY" benchmarks/bench_data_eval.py prepare "$OUT/prepare" $( ((SMOKE)) && echo --smoke ) 2>&1 \
        | tee "$OUT/prepare.jsonl"
    rm -rf "$OUT/prepare"
fi

if [[ " $PARTS " == *" generate "* ]]; then
    "$PY" benchmarks/bench_data_eval.py generate $( ((SMOKE)) && echo --smoke ) 2>&1 | tee "$OUT/generate.jsonl"
fi

if [[ " $PARTS " == *" domains "* ]]; then
    if [ ! -f "$CORPUS/byte/man/train.bin" ]; then
        echo "no $CORPUS/byte/man: building the corpus here (domains this machine has):"
        CORPUS="$OUT/domains_corpus"
        "$PY" -m torchtitan_ext.data.domains_corpus --output "$CORPUS" --max-mb 4
    fi
    du -sh "$CORPUS"
    sed "s#~/.cache/torchtitan_ext/domains#$CORPUS#" train_configs/domains_debug.toml > "$OUT/domains.toml"
    for mode in static adaptive; do
        t0=$SECONDS
        timeout "${DOMAIN_LIMIT:-240}" "$PY" -m torchtitan_ext.train --config "$OUT/domains.toml" --job.dump_folder "$OUT/dd_$mode" \
            --data.mixing "$mode" --training.steps "$STEPS" --checkpoint.enabled false \
            --metrics.tensorboard false "${DOMAIN_ARGS[@]}" > "$OUT/dd_$mode.log" 2>&1 \
            || { echo "domains $mode failed:"; tail -n 20 "$OUT/dd_$mode.log"; }
        echo "domains $mode: $((SECONDS - t0)) s"
    done
    "$PY" benchmarks/bench_data_eval.py domains "$OUT/dd_static" "$OUT/dd_adaptive" | tee "$OUT/domains.jsonl"
fi
