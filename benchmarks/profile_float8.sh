#!/usr/bin/env bash
# One H100/H200: where a float8 step's time goes, per kernel (benchmarks/profile_step.py: 15 steps, the last 10
# timed, 2 profiled; TOP_KERNELS rows each) for each of VARIANTS on one SHAPE:
#   SHAPE=mode (default): the MoDE bench shape of bench_float8_mode.sh (d_model 2048, 4 MoDE layers of 16
#     experts, top-2, moe_hidden 1408, vocabulary 32000, 8 x 2048 tokens, compiled); VARIANTS "bf16 float8"
#     (also float8_linears: tensorwise linears, bf16 experts; float8: + float8.experts)
#   SHAPE=8b: the 4-layer llama3_8b shape of bench_float8.sh (seq 4096, batch 2, compiled); VARIANTS
#     "bf16 tensorwise blockwise" (any float8.recipe)
# Usage from the repository root:  benchmarks/profile_float8.sh [OVERRIDES...]
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without the #s
    sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ "${TOP_KERNELS:-30}" =~ ^[1-9][0-9]*$ ]] || { echo "error: TOP_KERNELS='$TOP_KERNELS': expected a whole number >= 1" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOP_KERNELS="${TOP_KERNELS:-30}"
case "${SHAPE:-mode}" in
    mode) ARGS=(--config train_configs/mode_debug.toml --parallelism.ep 1 --parallelism.dp_shard 1
                --data.tokenizer byte --optimizer.lr 3e-4 --model.dim 2048 --model.n_heads 16
                --model.n_kv_heads 8 --model.n_layers 4 --model.n_experts 16 --model.top_k 2
                --model.moe_hidden 1408 --model.vocab_size 32000 --training.seq_len 2048
                --training.local_batch_size 8)
          DEFAULT_VARIANTS="bf16 float8" ;;
    8b) ARGS=(--config train_configs/llama3_8b_float8.toml --model.n_layers 4 --training.seq_len 4096
              --training.local_batch_size 2)
        DEFAULT_VARIANTS="bf16 tensorwise blockwise" ;;
    *) echo "error: SHAPE='$SHAPE': expected mode or 8b" >&2; exit 2 ;;
esac
source benchmarks/torchao_wheel.sh
use_torchao_wheel profile_float8 || exit 1
ARGS+=(--checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false --training.steps 15
       --training.compile true "$@")
for variant in ${VARIANTS:-$DEFAULT_VARIANTS}; do
    case $variant in
        bf16) flags=(--float8.enabled false) ;;
        float8) flags=(--float8.enabled true --float8.recipe tensorwise --float8.experts true) ;;
        float8_linears) flags=(--float8.enabled true --float8.recipe tensorwise --float8.experts false) ;;
        *) flags=(--float8.enabled true --float8.recipe "$variant") ;;
    esac
    timeout 240 "${PYTHON:-python3}" benchmarks/profile_step.py "$variant" "${ARGS[@]}" "${flags[@]}" 2>&1 \
        | grep -v "Failed to load" | grep -v "^\[rank" | tail -n $(( TOP_KERNELS + 4 ))
done
