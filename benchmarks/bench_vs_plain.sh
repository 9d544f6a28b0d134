#!/usr/bin/env bash
# Issue 16's goals in one GPU run: the plain single-file script first, then the trainer at the same shapes,
# then each goal's ratio. Usage on the GPU machine, from the repository root, with the plain script copied
# into the tree (it lives in ../shared, which does not travel):
#   benchmarks/bench_vs_plain.sh PLAIN_SCRIPT [OUT_DIR]
# AFTER overrides the trainer flags of the "after" runs (default: fused Triton kernels + fused linear CE).
# ONLY="name ..." runs only those runs (e.g. ONLY="plain_1b sac_1b" for a short call); ratios whose runs are
# missing print n/a.
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
ONLY="${ONLY:-}"
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

plain() {  # name, args
    local name=$1; shift
    wanted "$name" || return 0
    python3 "$PLAIN" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err" || { echo "plain $name failed"; tail -5 "$OUT/$name.err"; }
    cat "$OUT/$name.json"
}
trainer() {  # name, args (benchmarks/profile_step.py: tokens/s, peak memory, losses, top kernels)
    local name=$1; shift
    wanted "$name" || return 0
    local entry=(benchmarks/profile_step.py)  # model_*: the whole model one graph, model_cg_*: a CUDA graph
    case "$name" in
        model_cg_*) entry=(benchmarks/compile_scope.py reduce-overhead profile) ;;
        model_*) entry=(benchmarks/compile_scope.py default profile) ;;
    esac
    python3 "${entry[@]}" "$name" --config train_configs/debug.toml --data.tokenizer byte \
        --training.compile true --checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false \
        --metrics.log_freq 1000 --optimizer.lr 3e-4 --training.steps "$STEPS" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err" \
        || { echo "trainer $name failed"; tail -20 "$OUT/$name.err"; }
    grep '^{"run"' "$OUT/$name.txt"
}
ONE_B=(--model.flavor 1b --training.seq_len 2048 --training.local_batch_size 16)
EIGHT_B=(--model.flavor llama3_8b --model.n_layers 4 --model.vocab_size 32000 --training.seq_len 4096
         --training.local_batch_size 4)
FP8=(--float8.enabled true --float8.recipe tensorwise)
CE=(--training.fused_linear_ce true --training.fused_linear_ce_chunk 4096)
# Op-level selective AC: keep GEMM and attention outputs, recompute norms, RoPE, SwiGLU product and casts.
SAC=(--activation_checkpoint.mode selective --activation_checkpoint.selective_every 0)

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
trainer sac_1b "${ONE_B[@]}" "${CE[@]}" "${SAC[@]}"
# The float8 head cannot combine with the fused linear CE (it bypasses the head's Float8Linear): all three plain.
trainer bf16_8b "${EIGHT_B[@]}"
trainer fp8_8b "${EIGHT_B[@]}" "${FP8[@]}"
trainer fp8_8b_head "${EIGHT_B[@]}" "${FP8[@]}" --float8.include_output true
trainer model_1b "${ONE_B[@]}"
trainer model_cg_1b "${ONE_B[@]}"
trainer model_cg_8b "${EIGHT_B[@]}"
trainer sac_1b_b24 --model.flavor 1b --training.seq_len 2048 --training.local_batch_size 24 "${CE[@]}" "${SAC[@]}"

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
s1, s24, b8, f8, f8h = (load(n, "txt") for n in ("sac_1b", "sac_1b_b24", "bf16_8b", "fp8_8b", "fp8_8b_head"))
m1, mc1, mc8 = (load(n, "txt") for n in ("model_1b", "model_cg_1b", "model_cg_8b"))
print(f"| 1b, whole model one graph | {p1.get('tok_s')} | {m1.get('tokens_per_sec')} | {ratio(m1, p1)} | |")
print(f"| 1b, whole model one CUDA graph | {p1.get('tok_s')} | {mc1.get('tokens_per_sec')} | {ratio(mc1, p1)} | |")
print(f"| 8B-shaped, whole model one CUDA graph | {p8.get('tok_s')} | {mc8.get('tokens_per_sec')} | {ratio(mc8, p8)} | |")
print(f"| 1b, fused linear CE + op-level selective AC, tokens/s | {p1.get('tok_s')} | {s1.get('tokens_per_sec')} | "
      f"{ratio(s1, p1)} | |")
print(f"| same, peak memory GiB | {p1.get('peak_gib')} | {s1.get('peak_memory_gib')} | | <= 40 |")
print(f"| same at batch 24: tokens/s, peak GiB | | {s24.get('tokens_per_sec')}, {s24.get('peak_memory_gib')} | "
      f"{ratio(s24, p1)} | |")
print(f"| 8B-shaped float8: head in float8 over head in bf16 (no fused CE) | | {f8h.get('tokens_per_sec')} / "
      f"{f8.get('tokens_per_sec')} | {ratio(f8h, f8, bkey='tokens_per_sec')} | |")
print(f"| same flags, float8 (head too) over our own bf16 | | {f8h.get('tokens_per_sec')} / {b8.get('tokens_per_sec')} | "
      f"{ratio(f8h, b8, bkey='tokens_per_sec')} (blocks only {ratio(f8, b8, bkey='tokens_per_sec')}) | >= 1.35x |")
print(f"\nLosses of the 1b runs per step (same data and seed): before {b1.get('losses')}, after {a1.get('losses')}, "
      f"selective AC {s1.get('losses')}\n")
for name in ("before_1b", "after_1b", "sac_1b"):
    path = out / f"{name}.txt"
    if path.exists():
        lines = path.read_text().splitlines()
        top = [i for i, x in enumerate(lines) if x.startswith("top kernels")]
        print("```\n" + "\n".join(lines[top[0]:] if top else ["(no profile)"]) + "\n```")
PY
{ echo; echo "## Issue 16: trainer vs the plain script, one run ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"; echo;
  echo "Command: \`benchmarks/bench_vs_plain.sh plain_llama.py\` (STEPS=$STEPS${ONLY:+, ONLY=\"$ONLY\"}, 5 untimed)."; echo; cat "$OUT/section.md"; } >> benchmarks/RESULTS.md
