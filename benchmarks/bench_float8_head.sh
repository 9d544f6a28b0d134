#!/usr/bin/env bash
# float8 with the output head in float8 (`float8.include_output`) against bf16 over 300 steps on one GPU: the
# 8B-shaped 4-layer model of RESULTS.md's "FP8" section (batch 4 x 4096, builtin tokenizer, compiled), with the
# vocabulary 32000 and the real 128256 (where the head is a quarter of the FLOPs). Prints tokens/s, peak memory
# and the mean loss of steps 255-300 per run. Then one short debug run with profiling and a CUDA memory snapshot
# (checks that both files are written). About 7 minutes on one H100. Usage from the repository root:
#   benchmarks/bench_float8_head.sh [OUT_DIR]
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_float8_head}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if [ -d .whl ] && ! "$PY" -c "import torchao" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
runs=()
source benchmarks/run_job.sh
STEPS="${STEPS:-300}"
BASE=(--config train_configs/llama3_8b_float8.toml --model.n_layers 4 --training.local_batch_size 4
      --training.seq_len 4096 --training.steps "$STEPS" --checkpoint.enabled false --eval.steps 0
      --metrics.tensorboard false)
for vocab in 32000 128256; do
    run_job "bf16_v$vocab" 200 "$PY" -m torchtitan_ext.train "${BASE[@]}" --model.vocab_size "$vocab" \
        --float8.enabled false
    run_job "fp8_head_v$vocab" 200 "$PY" -m torchtitan_ext.train "${BASE[@]}" --model.vocab_size "$vocab" \
        --float8.enabled true --float8.recipe tensorwise --float8.include_output true
done
"$PY" - "${runs[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
print(f"{'run':18s} {'tokens/s':>10s} {'peak GiB':>9s} {'loss 255-300':>13s}")
for folder in map(Path, sys.argv[1:]):
    f = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []
    rows = [r for r in rows if "loss" in r]
    if not rows:
        print(f"{folder.name:18s} failed"); continue
    tps = statistics.median(r["tokens_per_sec"] for r in rows[len(rows) // 2:])
    tail = [r["loss"] for r in rows if r["step"] > 250] or [rows[-1]["loss"]]
    print(f"{folder.name:18s} {tps:10,.0f} {rows[-1].get('memory_gib', 0):9.2f} {statistics.mean(tail):13.4f}")
PY
run_job profile_snapshot 200 "$PY" -m torchtitan_ext.train --config train_configs/debug.toml --training.steps 6 \
    --checkpoint.enabled false --profiling.enabled true --profiling.start_step 3 --profiling.end_step 4 \
    --profiling.memory_snapshot true
find "$OUT/profile_snapshot" -path '*profile*' -type f -printf '%P %s bytes\n'
