#!/usr/bin/env bash
# What compiling a MoDE block around its experts costs, on one GPU. Under expert parallelism (and MoDE under
# TP) the trainer compiles attention, routing and combine as graphs and runs the experts (grouped GEMMs,
# all-to-all, their FSDP unit) eagerly between them (torchtitan_ext/parallel/compile.py); on one GPU without
# EP the whole block is one graph. This runs the model of bench_mode_ep.sh (d_model 2048, 4 MoDE layers of
# 16 experts, top-2, seq 2048, 8 sequences, bf16) on one GPU three ways, 30 steps each: whole-block graphs,
# graphs around eager experts (the EP path's compilation forced on), and eager.
#
# Usage, from the repository root on a GPU machine: benchmarks/bench_mode_compile.sh [OUT_DIR [OVERRIDES...]]
# (overrides go to every run, after the model's settings)
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
# The trainer's entry point with apply_compile told that the experts cannot join the graph.
AROUND_EXPERTS='
import sys
import torchtitan_ext.parallel.compile as compile_module
import torchtitan_ext.parallel.parallelize as parallelize
from torchtitan_ext.train.__main__ import main
parallelize.apply_compile = lambda model, experts_in_graph, tensor_parallel: compile_module.apply_compile(
    model, experts_in_graph=False, tensor_parallel=tensor_parallel)
sys.exit(main(sys.argv[1:]))'

runs=()
source benchmarks/run_job.sh
run_job whole_block 240 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --training.compile true
run_job around_experts 240 "$PY" -c "$AROUND_EXPERTS" "${ARGS[@]}" --training.compile true
run_job eager 240 "$PY" -m torchtitan_ext.train "${ARGS[@]}" --training.compile false
"$PY" benchmarks/summarize.py "${runs[@]}"
