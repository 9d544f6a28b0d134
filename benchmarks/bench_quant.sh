#!/usr/bin/env bash
# One GPU: bf16 vs INT8 forward vs QAT (static / dynamic clamp) vs float8 tensorwise on the 1b shape with
# FEWER LAYERS (LAYERS, default 4) and squared-ReLU FFNs (QAT needs them; every variant uses them), not
# compiled, STEPS (40) steps each: tokens/s (median of the logged windows after the first) and the loss.
# Then the teacher pass (distill/teacher.py) of the bf16 run's checkpoint over a shard of TEACHER_TOKENS
# (1M) byte tokens at k = 32: tokens/s and sidecar bytes per token against a dense bf16 distribution.
# Usage from the repository root: benchmarks/bench_quant.sh [OUT_DIR]; --smoke: debug flavor on CPU.
set -uo pipefail
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_quant}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
shopt -s nullglob
WHEELS=(.whl/torchao-*.whl)
if (( ${#WHEELS[@]} )) && (( ! SMOKE )); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS[@]}" \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if (( SMOKE )); then
    SHAPE=(--model.flavor debug --training.seq_len 64 --training.local_batch_size 4 --job.device cpu)
    STEPS=${STEPS:-6}; TEACHER_TOKENS=${TEACHER_TOKENS:-20000}; VOCAB=320
else
    SHAPE=(--model.flavor 1b --model.n_layers "${LAYERS:-4}" --training.seq_len 2048
           --training.local_batch_size "${BATCH:-8}")
    STEPS=${STEPS:-40}; TEACHER_TOKENS=${TEACHER_TOKENS:-1000000}; VOCAB=32000
fi
COMMON=(--data.tokenizer byte --model.activation relu2 --training.compile false --eval.steps 0
        --metrics.log_freq 5 --metrics.tensorboard false --optimizer.lr 3e-4 --training.steps "$STEPS"
        --lr_scheduler.warmup_steps $(( STEPS / 10 )) --checkpoint.enabled false)
run() {  # run NAME OVERRIDES...
    local name=$1 t0=$SECONDS; shift
    "$PY" -m torchtitan_ext.train --job.dump_folder "$OUT/$name" "${SHAPE[@]}" "${COMMON[@]}" "$@" \
        > "$OUT/$name.log" 2>&1 || { echo "run $name failed:"; tail -n 8 "$OUT/$name.log"; }
    echo "run $name: $(( SECONDS - t0 )) s"
}
run bf16 --checkpoint.enabled true --checkpoint.interval "$STEPS"
run int8 --quant.int8_forward true --model.residual_scalars true
run qat_static --quant.qat int8 --quant.clamp static
run qat_dynamic --quant.qat int8 --quant.clamp dynamic
run float8_tensorwise --float8.enabled true --float8.recipe tensorwise
"$PY" - "$OUT" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'variant':20s} {'tokens/s':>12s} {'loss@end':>9s} {'mean loss last 10 st':>18s}")
for name in ("bf16", "int8", "qat_static", "qat_dynamic", "float8_tensorwise"):
    f = out / name / "metrics.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines() if '"loss"' in x] if f.exists() else []
    if not rows:
        print(f"{name:20s} failed"); continue
    tps = statistics.median(r["tokens_per_sec"] for r in rows[1:] or rows)
    print(f"{name:20s} {tps:12,.0f} {rows[-1]['loss']:9.4f} {statistics.mean(r['loss'] for r in rows[-2:]):18.4f}")
PYEOF
# Teacher pass: the bf16 run's checkpoint over one shard cut from the built-in byte corpus.
"$PY" - "$OUT" "$TEACHER_TOKENS" <<'PYEOF'
import sys
from pathlib import Path
import numpy as np
from torchtitan_ext.data.corpus import builtin_shards
from torchtitan_ext.data.tokenizers import open_tokenizer
from torchtitan_ext.data.shards import read_shard, write_shard
cache = Path("~/.cache/torchtitan_ext").expanduser()
train, _ = builtin_shards(open_tokenizer("byte", 4096, cache), cache)
(Path(sys.argv[1]) / "teacher_data").mkdir(exist_ok=True)
write_shard(Path(sys.argv[1]) / "teacher_data" / "t_0.bin", np.asarray(read_shard(train)[:int(sys.argv[2])]))
PYEOF
t0=$SECONDS
"$PY" -m torchtitan_ext.distill.teacher "${SHAPE[@]}" "${COMMON[@]}" --job.dump_folder "$OUT/bf16" \
    --data.dataset shards --data.train_path "$OUT/teacher_data" --data.tokenizer none \
    --model.vocab_size "$VOCAB" --output "$OUT/sidecars" --k 32 --batch "${TEACHER_BATCH:-16}" \
    > "$OUT/teacher.log" 2>&1 || { echo "teacher pass failed:"; tail -n 8 "$OUT/teacher.log"; }
echo "teacher pass: $(( SECONDS - t0 )) s"; grep "teacher pass:" "$OUT/teacher.log"
ls -l "$OUT/sidecars"
