#!/usr/bin/env bash
# Issue 16's goals in one GPU run: the plain single-file script first, then the trainer at the same shapes,
# then each goal's ratio. Usage on the GPU machine, from the repository root, with the plain script copied
# into the tree (it lives in ../shared, which does not travel):
#   benchmarks/bench_vs_plain.sh PLAIN_SCRIPT [OUT_DIR]
# AFTER overrides the trainer flags of the "after" runs (default: fused Triton kernels + fused linear CE).
# Appends a dated section (figures, top kernels of the 1b step before and after) to benchmarks/RESULTS.md
# and copies it to OUT_DIR/section.md.
set -uo pipefail
PLAIN="$1"
OUT="${2:-${OUT:-/tmp/bench_vs_plain}}"
AFTER="${AFTER:---training.kernels triton --training.fused_linear_ce true --training.fused_linear_ce_chunk 4096}"
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import torchao" 2>/dev/null; then
    pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${STEPS:-15}"

plain() {  # name, args
    local name=$1; shift
    python3 "$PLAIN" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err" || { echo "plain $name failed"; tail -5 "$OUT/$name.err"; }
    cat "$OUT/$name.json"
}
trainer() {  # name, args (benchmarks/profile_step.py: tokens/s, peak memory, losses, top kernels)
    local name=$1; shift
    python3 benchmarks/profile_step.py "$name" --config train_configs/debug.toml --data.tokenizer byte \
        --training.compile true --checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false \
        --metrics.log_freq 1000 --optimizer.lr 3e-4 --training.steps "$STEPS" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err" \
        || { echo "trainer $name failed"; tail -20 "$OUT/$name.err"; }
    grep '^{"run"' "$OUT/$name.txt"
}
ONE_B=(--model.flavor 1b --training.seq_len 2048 --training.local_batch_size 16)
EIGHT_B=(--model.flavor llama3_8b --model.n_layers 4 --model.vocab_size 32000 --training.seq_len 4096
         --training.local_batch_size 4)
FP8=(--float8.enabled true --float8.recipe tensorwise)

plain plain_1b --shape 1b --batch 16
plain plain_8b --shape 8b_layers4 --batch 4
plain plain_8b_fp8 --shape 8b_layers4 --batch 4 --float8 tensorwise
trainer before_1b "${ONE_B[@]}"
# shellcheck disable=SC2086
trainer after_1b "${ONE_B[@]}" $AFTER
trainer after_1b_ce_only "${ONE_B[@]}" --training.fused_linear_ce true --training.fused_linear_ce_chunk 4096
# shellcheck disable=SC2086
trainer after_8b "${EIGHT_B[@]}" $AFTER
# shellcheck disable=SC2086
trainer after_8b_fp8 "${EIGHT_B[@]}" "${FP8[@]}" $AFTER

python3 - "$OUT" "$AFTER" <<'PY' | tee "$OUT/section.md"
import json, sys
from pathlib import Path
out, after = Path(sys.argv[1]), sys.argv[2]
def load(name, ext):
    try:
        return json.loads(next(x for x in (out / f"{name}.{ext}").read_text().splitlines() if x.startswith("{")))
    except Exception:
        return {}
p1, p8, p8f = load("plain_1b", "json"), load("plain_8b", "json"), load("plain_8b_fp8", "json")
b1, a1, a8, a8f, ce = (load(n, "txt") for n in ("before_1b", "after_1b", "after_8b", "after_8b_fp8",
                                                 "after_1b_ce_only"))
def ratio(a, b, key="tokens_per_sec", bkey="tok_s"):
    return f"{a[key] / b[bkey]:.3f}x" if a.get(key) and b.get(bkey) else "n/a"
print(f"### bench_vs_plain.sh (trainer 'after' flags: `{after}`)\n")
print("| goal | plain script | trainer | ratio | target |\n|---|---|---|---|---|")
print(f"| 1b bf16 tokens/s (before) | {p1.get('tok_s')} | {b1.get('tokens_per_sec')} | {ratio(b1, p1)} | |")
print(f"| 1b bf16 tokens/s (after) | {p1.get('tok_s')} | {a1.get('tokens_per_sec')} | {ratio(a1, p1)} | >= 1.10x |")
print(f"| 1b bf16 tokens/s (fused linear CE only) | {p1.get('tok_s')} | {ce.get('tokens_per_sec')} | {ratio(ce, p1)} | |")
print(f"| 1b peak memory GiB (before -> after) | {p1.get('peak_gib')} | {b1.get('peak_memory_gib')} -> "
      f"{a1.get('peak_memory_gib')} (CE only {ce.get('peak_memory_gib')}) | | <= 40 |")
print(f"| 8B-shaped 4 layers bf16 tokens/s | {p8.get('tok_s')} | {a8.get('tokens_per_sec')} | {ratio(a8, p8)} | >= 1.05x |")
print(f"| same, float8 tensorwise | {p8f.get('tok_s')} | {a8f.get('tokens_per_sec')} | {ratio(a8f, p8f)} | |")
print(f"| float8 over our own bf16 | | {a8f.get('tokens_per_sec')} / {a8.get('tokens_per_sec')} | "
      f"{ratio(a8f, a8, bkey='tokens_per_sec')} | >= 1.35x |")
print(f"\nLosses of the 1b runs per step (same data and seed): before {b1.get('losses')}, after {a1.get('losses')}\n")
for name in ("before_1b", "after_1b"):
    path = out / f"{name}.txt"
    if path.exists():
        lines = path.read_text().splitlines()
        top = [i for i, x in enumerate(lines) if x.startswith("top kernels")]
        print("```\n" + "\n".join(lines[top[0]:] if top else ["(no profile)"]) + "\n```")
PY
{ echo; echo "## Issue 16: trainer vs the plain script, one run ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"; echo;
  echo "Command: \`benchmarks/bench_vs_plain.sh plain_llama.py\` (STEPS=$STEPS, 5 untimed)."; echo; cat "$OUT/section.md"; } >> benchmarks/RESULTS.md
