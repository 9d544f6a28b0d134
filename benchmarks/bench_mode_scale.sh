#!/usr/bin/env bash
# MoDE trainer at a Zen-like MoE shape on 4 GPUs: expert parallelism 1, 2 and 4 (FSDP over the rest), torchtitan
# 0.2.0's qwen3 MoE at the same shape under EP 4, and a per-kernel profile of our EP 4 step. Model: mode_debug resized
# to d_model 2048, 16 heads (8 KV, head_dim 128), 8 layers, every layer MoDE with 64 SwiGLU experts of hidden 1408,
# top-2, no shared expert, Switch aux loss 0.01 + router z-loss 0.001 (the flavor's), no qk-norm, untied head,
# vocabulary 32000 (4,662,003,712 parameters, 371,230,720 active per token incl. the input table; torchtitan's model
# has exactly as many, and both count the same 2.237e9 training FLOPs per token for MFU); seq 2048, 8 sequences per GPU, bf16 (FSDP mixed precision,
# fp32 reduce), compiled, 25 steps, log every 5, byte tokenizer, no checkpoint, no eval.
#
# Usage, from the repository root on a 4-GPU machine (carry .whl for tt_ep4):
#   OUT_DIR=$OUT RUNS="ep1 ep2 ep4 tt_ep4 profile" benchmarks/bench_mode_scale.sh
#   RUNS       any of ep1 ep2 ep4 (ours, EP N), tt_ep4 (torchtitan), profileN (ours, EP N, steps 8-9 profiled on
#              every rank; the rank-0 table is written as profile_epN; profile = profile4); default
#              "ep1 ep2 ep4 tt_ep4 profile"
#   OLD=DIR    also run each epN with the package in DIR (a checkout of other code; named old_epN), alternated
#              old, new on the same machine
#   OUT_DIR    where the small result files go (summary.jsonl, profile_ep4.{txt,json}, logs.tar.gz); the run
#              folders stay in WORK (default /tmp/bench_mode_scale)
#   EXTRA      trainer overrides added to every run of ours, e.g. EXTRA="--model.bias_update_rate 0.001", or
#              EXTRA="--model.force_balanced_routing true" (round-robin experts: the EP path at perfect balance,
#              apart from the router's load imbalance early in training)
#   NPROC      processes (GPUs), default 4; NPROC=1 runs ep1 and profile1 on one GPU (tt_ep4 needs 4). With
#              EXTRA="--model.n_experts 16" one GPU computes what one EP 4 rank computes at perfect balance (16
#              experts, 2,048 rows each on average, the same active FLOPs): the bound the EP 4 run's MFU has
#              without any communication; with "--profiling.with_stack true" in EXTRA, profileN also writes
#              gaps_epN.txt (benchmarks/trace_gaps.py: the host code running while rank 0's GPU idles)
#   STEPS (25), COMPILE (true), LIMIT (seconds per run, default 170), DEADLINE (seconds for the whole script,
#              default 560: a run starts only with 60 s left and is cut at the deadline, so the call returns results)
#   --smoke    2 CPU processes with gloo and a tiny model (mode_debug's own shape, vocabulary 512, seq 64), eager;
#              RUNS default "ep1 ep2 profile" (EP 2 at most; tt needs CUDA and is skipped)
#   --help     this text
# Prints one JSON line per run (benchmarks/scale_report.py): median tokens/s per GPU and MFU over the windows after
# step 10, peak memory (allocated, reserved), first/last loss, expert load imbalance (max / mean routed tokens per
# expert at the last logged step, mean and worst over layers), parameter counts, wall time.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench_args.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT_DIR="${OUT_DIR:-${1:-/tmp/bench_mode_scale_out}}"
WORK="${WORK:-/tmp/bench_mode_scale}"
source benchmarks/bench_env.sh

if [ "$SMOKE" = 1 ]; then
    export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
    NPROC=2
    MODEL=(--job.device cpu --model.vocab_size 512 --training.seq_len 64 --training.local_batch_size 2
           --metrics.log_freq 5)
    STEPS="${STEPS:-15}"
    COMPILE="${COMPILE:-false}"
    RUN_LIMIT="${LIMIT:-400}"
    RUNS="${RUNS:-ep1 ep2 profile}"
else
    NPROC="${NPROC:-4}"
    case $NPROC in
        1|2|3|4|5|6|7|8) ;;
        *) echo "error: NPROC='$NPROC': expected a number of GPUs, 1 to 8" >&2; exit 2 ;;
    esac
    MODEL=(--model.dim 2048 --model.n_heads 16 --model.n_kv_heads 8 --model.n_layers 8 --model.n_experts 64
           --model.top_k 2 --model.moe_hidden 1408 --model.vocab_size 32000 --training.seq_len 2048
           --training.local_batch_size 8 --metrics.log_freq 5)
    STEPS="${STEPS:-25}"
    COMPILE="${COMPILE:-true}"
    RUN_LIMIT="${LIMIT:-170}"
    RUNS="${RUNS:-ep1 ep2 ep4 tt_ep4 profile}"
fi
# EXTRA: more trainer overrides for every run of ours (e.g. "--model.bias_update_rate 0.001")
read -r -a extra <<< "${EXTRA:-}"
MODEL+=("${extra[@]}")
MAX_EP=$NPROC
SUMMARY=$OUT_DIR/summary.jsonl
: > "$SUMMARY"
T_START=$SECONDS

runs=()
source benchmarks/run_job.sh
ours() {  # ours NAME TREE ARGS...: our trainer from the package in TREE
    local name=$1 tree=$2; shift 2
    local t0=$SECONDS
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" run_job "$name" "$LIMIT" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node "$NPROC" -m torchtitan_ext.train \
        --config "$tree/train_configs/mode_debug.toml" --data.tokenizer byte --data.cache_dir "$WORK/cache" \
        --checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false --optimizer.lr 3e-4 \
        --lr_scheduler.warmup_steps 5 --training.compile "$COMPILE" --training.steps "$STEPS" "${MODEL[@]}" "$@")
    "$PY" benchmarks/scale_report.py ours "$WORK/$name" --wall $((SECONDS - t0)) | tee -a "$SUMMARY"
}

tt_run() {  # torchtitan 0.2.0, EP 4 (EP = NPROC), from the carried wheels
    local name=$1 t0=$SECONDS
    local site=/tmp/tt_site assets=$WORK/tt_assets
    if ! ls .whl/torchtitan-0.2.0-*.whl >/dev/null 2>&1; then
        echo "{\"run\": \"$name\", \"error\": \"no .whl/torchtitan-0.2.0 wheel (carry .whl)\"}" | tee -a "$SUMMARY"
        return
    fi
    if [ ! -d "$site/torchtitan" ]; then
        "$PY" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl > "$WORK/$name.pip.log" 2>&1 \
            || { echo "pip install failed:"; tail -n 5 "$WORK/$name.pip.log"; }
    fi
    if [ ! -f "$assets/c4_local/train.jsonl" ]; then
        "$PY" benchmarks/torchtitan/make_assets.py "$assets" > "$WORK/$name.assets.log" 2>&1 \
            || { echo "make_assets failed:"; tail -n 5 "$WORK/$name.assets.log"; }
    fi
    rm -rf "$WORK/$name"
    (cd benchmarks/torchtitan && PYTHONPATH="$site:$PWD" timeout "$LIMIT" "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node "$NPROC" -m torchtitan.train --job.config_file qwen3_moe_ep4.toml \
        --job.dump_folder "$WORK/$name" --model.hf_assets_path "$assets/tokenizer" \
        --training.dataset_path "$assets/c4_local" --training.steps "$STEPS" \
        --parallelism.expert_parallel_degree "$NPROC") > "$WORK/$name.log" 2>&1
    local rc=$?
    echo "run $name: exit $rc after $((SECONDS - t0)) s"
    if [ $rc != 0 ]; then grep -v "^\s*$" "$WORK/$name.log" | grep -iE "error|exception|unsupported" | tail -n 8; fi
    "$PY" benchmarks/scale_report.py tt "$name" "$WORK/$name.log" --wall $((SECONDS - t0)) | tee -a "$SUMMARY"
}

DEADLINE="${DEADLINE:-560}"  # seconds for the whole script: a run starts only with 60 s left, and is cut at the deadline
for r in $RUNS; do
    case $r in
        ep[0-9]*)
            ep=${r#ep}
            if [ "$ep" -gt "$MAX_EP" ]; then echo "skip $r: EP $ep > $NPROC processes"; continue; fi
            [ -n "${OLD:-}" ] && budget "old_$r" && ours "old_$r" "$(cd "$OLD" && pwd)" --parallelism.ep "$ep"
            budget "$r" && ours "$r" "$ROOT" --parallelism.ep "$ep"
            ;;
        tt_ep4)
            if [ "$SMOKE" = 1 ]; then echo "skip $r: torchtitan needs CUDA (not in --smoke)"; continue; fi
            if [ "$NPROC" != 4 ]; then echo "skip $r: EP 4 needs NPROC=4"; continue; fi
            budget "$r" && tt_run "$r"
            ;;
        profile|profile[0-9]*)
            ep=${r#profile}; ep=${ep:-4}; ep=$(( MAX_EP < ep ? MAX_EP : ep ))
            budget "$r" || continue
            ours "$r" "$ROOT" --parallelism.ep "$ep" --training.steps 10 --profiling.enabled true \
                --profiling.start_step 8 --profiling.end_step 9
            "$PY" benchmarks/scale_report.py profile "$WORK/$r" "$OUT_DIR/profile_ep$ep" | tee -a "$SUMMARY"
            if [[ " ${extra[*]} " == *" --profiling.with_stack true "* && "$SMOKE" != 1 ]]; then  # where the GPU idles
                "$PY" benchmarks/trace_gaps.py "$(ls "$WORK/$r"/profile/rank0_*.json | head -n 1)" 20 \
                    > "$OUT_DIR/gaps_ep$ep.txt" 2>&1
            fi
            ;;
        *) echo "unknown run '$r': expected ep1 ep2 ep4 tt_ep4 profile profileN" ;;
    esac
done
tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls *.log */config.toml 2>/dev/null) 2>/dev/null
echo "total $((SECONDS - T_START)) s; results in $OUT_DIR: $(cd "$OUT_DIR" && ls | tr '\n' ' ')"
