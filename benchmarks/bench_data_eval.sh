#!/usr/bin/env bash
# Issue 15 on one GPU machine (16 CPU cores): data.prepare throughput 1 -> 8 workers (byte tokens,
# heuristics + MinHash filters), generation tokens/s with the KV cache for the 1b shape (random init,
# bf16), and the domains_debug job with static vs adaptive mixing (per-domain validation bpb after the same
# tokens).
# Usage from the repository root: benchmarks/bench_data_eval.sh [OUT_DIR] [DOMAIN_STEPS]
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_data_eval}}"
STEPS="${2:-150}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__)"
python3 benchmarks/bench_data_eval.py prepare "$OUT/prepare" 2>&1 | tee "$OUT/prepare.jsonl"
rm -rf "$OUT/prepare"
python3 benchmarks/bench_data_eval.py generate 2>&1 | tee "$OUT/generate.jsonl"
python3 -m torchtitan_ext.data.domains_corpus --output "$OUT/domains" --max-mb 8
sed "s#~/.cache/torchtitan_ext/domains#$OUT/domains#" train_configs/domains_debug.toml > "$OUT/domains.toml"
for mode in static adaptive; do
    python3 -m torchtitan_ext.train --config "$OUT/domains.toml" --job.dump_folder "$OUT/dd_$mode" \
        --data.mixing "$mode" --training.steps "$STEPS" --eval.interval 25 --checkpoint.enabled false \
        --metrics.tensorboard false > "$OUT/dd_$mode.log" 2>&1 || { echo "domains $mode failed:"; tail -n 20 "$OUT/dd_$mode.log"; }
    echo "domains_debug $mode, final evaluation:"
    grep '"val_loss"' "$OUT/dd_$mode/metrics.jsonl" | tail -n 1
done
