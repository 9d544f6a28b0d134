#!/usr/bin/env bash
# What compiling a MoDE block around its experts costs, on one GPU. Under expert parallelism (and MoDE under
# TP) the trainer compiles attention, routing and combine as graphs and runs the experts (grouped GEMMs,
# all-to-all, their FSDP unit) eagerly between them (torchtitan_ext/parallel/compile.py); on one GPU without
# EP the whole block is one graph. This runs the model of bench_mode_ep.sh (d_model 2048, 4 MoDE layers of
# 16 experts, top-2, seq 2048, 8 sequences, bf16) on one GPU three ways, 30 steps each: whole-block graphs,
# graphs around eager experts (the EP path's compilation forced on), and eager.
#
# Usage, from the repository root on a GPU machine: benchmarks/bench_mode_compile.sh [OUT_DIR [OVERRIDES...]]
# (overrides go to every run, after the model's settings). ONLY="name ..." picks runs: whole_block,
# around_experts, eager, whole_block_ce (fused linear cross-entropy), whole_block_triton (Triton kernels),
# whole_block_cpp (inductor's C++ wrapper), whole_block_cudagraphs (mode "reduce-overhead"),
# whole_block_autotune (TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1), whole_model / whole_model_cudagraphs (one graph for
# the whole model, plain or as a CUDA graph), hostprof_whole_block (py-spy of the host over 200 steps, PYSPY=the
# binary), and profile_whole_block / profile_around_experts (benchmarks/profile_step.py: 5 untimed + 10 timed steps,
# then the 15 kernels with the most GPU time of 2 profiled steps; with TRACE_GAPS=1 also where the GPU
# waited for the host, and with SYNC_DEBUG=1 every host sync while a step is queued). Default: the first three.
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_mode_compile}}"
shift || true
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PY:-python3}"

ARGS=(--config train_configs/mode_debug.toml --parallelism.ep 1 --parallelism.dp_shard 1
      --data.tokenizer byte --checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false
      --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5
      --model.dim 2048 --model.n_heads 16 --model.n_kv_heads 8 --model.n_layers 4 --model.n_experts 16
      --model.top_k 2 --model.moe_hidden 1408 --model.vocab_size 32000 --training.seq_len 2048
      --training.local_batch_size 8 --training.steps 30 --metrics.log_freq 5 "$@")
# apply_compile told that the experts cannot join the graph (the EP path's compilation, on one GPU).
FORCE_AROUND='
import torchtitan_ext.parallel.compile as compile_module
import torchtitan_ext.parallel.parallelize as parallelize
parallelize.apply_compile = lambda model, experts_in_graph, **kwargs: compile_module.apply_compile(
    model, experts_in_graph=False, **kwargs)'
AROUND_EXPERTS="$FORCE_AROUND"'
import sys
from torchtitan_ext.train.__main__ import main
sys.exit(main(sys.argv[1:]))'
CUDAGRAPHS='
import sys
import torch
compile_fn = torch.compile
torch.compile = lambda *args, **kwargs: compile_fn(*args, **{**kwargs, "mode": "reduce-overhead"})
from torchtitan_ext.train.__main__ import main
sys.exit(main(sys.argv[1:]))'
# benchmarks/profile_step.py, preceded by FORCE_AROUND for the "around_experts" profile.
RUN_PROFILE='
import runpy
import sys
sys.argv[0] = "benchmarks/profile_step.py"
runpy.run_path("benchmarks/profile_step.py", run_name="__main__")'
ONLY="${ONLY:-whole_block around_experts eager}"
wanted() { [[ " $ONLY " == *" $1 "* ]]; }

runs=()
source benchmarks/run_job.sh
wanted whole_block && run_job whole_block 240 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --training.compile true
wanted around_experts && run_job around_experts 240 "$PY" -c "$AROUND_EXPERTS" "${ARGS[@]}" --training.compile true
wanted eager && run_job eager 240 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --training.compile false
wanted whole_block_ce && run_job whole_block_ce 240 "$PY" -m torchtitan_ext.train "${ARGS[@]}" \
    --training.compile true --training.fused_linear_ce true --training.fused_linear_ce_chunk 4096
# Host launch overhead: inductor's C++ wrapper, and CUDA graphs (torch.compile mode "reduce-overhead");
# GEMM choice: inductor's autotuned GEMM templates against cuBLAS.
wanted whole_block_cpp && TORCHINDUCTOR_CPP_WRAPPER=1 run_job whole_block_cpp 300 "$PY" -m torchtitan_ext.train \
    "${ARGS[@]}" --training.compile true
wanted whole_block_autotune && TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 run_job whole_block_autotune 400 "$PY" -m \
    torchtitan_ext.train "${ARGS[@]}" --training.compile true
wanted whole_block_cudagraphs && run_job whole_block_cudagraphs 300 "$PY" -c "$CUDAGRAPHS" "${ARGS[@]}" \
    --training.compile true
# The whole model as one graph (benchmarks/compile_scope.py), plain and as a CUDA graph.
wanted whole_model && run_job whole_model 300 "$PY" benchmarks/compile_scope.py default train "${ARGS[@]}" \
    --training.compile true
wanted whole_model_cudagraphs && run_job whole_model_cudagraphs 300 "$PY" benchmarks/compile_scope.py \
    reduce-overhead train "${ARGS[@]}" --training.compile true
# Where the host spends a whole-block step: py-spy samples of steps 10-30 (PYSPY: the py-spy binary).
if wanted hostprof_whole_block && [ -x "${PYSPY:-}" ]; then
    "$PYSPY" record -r 250 -f raw --threads -o "$OUT/hostprof.txt" --nonblocking -- "$PY" -m torchtitan_ext.train \
        "${ARGS[@]}" --training.compile true --training.steps 200 --metrics.log_freq 50 --job.dump_folder "$OUT/hostprof" \
        > "$OUT/hostprof.log" 2>&1
    echo "hostprof: exit $?"
    "$PY" benchmarks/host_profile.py "$OUT/hostprof.txt" | cut -c1-160
fi
wanted whole_block_triton && run_job whole_block_triton 240 "$PY" -m torchtitan_ext.train "${ARGS[@]}" \
    --training.compile true --training.kernels triton
[ ${#runs[@]} -gt 0 ] && "$PY" benchmarks/summarize.py "${runs[@]}"
for way in whole_block around_experts; do
    if wanted "profile_$way"; then
        code="$RUN_PROFILE"; [ "$way" = around_experts ] && code="$FORCE_AROUND$RUN_PROFILE"
        timeout 240 "$PY" -c "$code" "$way" "${ARGS[@]}" --training.compile true --training.steps 15 \
            --job.dump_folder "$OUT/profile_$way" 2>&1 | grep -E '^\{|^top kernels|^  |Warning|^GPU busy' | cut -c1-150
    fi
done
