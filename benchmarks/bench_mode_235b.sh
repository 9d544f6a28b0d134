#!/usr/bin/env bash
# MoDE at mode_235b's shape on 4 GPUs (issue 40, deliverable 4): d_model 7168, 56 heads / 8 KV, QK-norm, every layer
# 128 SwiGLU experts of hidden 864, top-2, vocabulary 151,936, with LAYERS layers (the full model has 94), seq 4096,
# full activation checkpointing, compiled, bf16 (FSDP mixed precision), byte-tokenized built-in corpus. Per run:
# tokens/s per GPU, MFU, peak memory (rank 0 and the largest over the ranks) and the planner's predicted peak for
# the same arguments (python -m torchtitan_ext.plan --device-memory <this GPU's memory>).
#
# Usage, from the repository root on a 4-GPU machine:
#   OUT_DIR=$OUT RUNS="ep4 pp2_ep2 resume" benchmarks/bench_mode_235b.sh
#   RUNS       any of
#              ep4      FSDP 4 with the experts over EP 4, 4 sequences per GPU
#              pp2_ep2  PP 2 (1F1B, 8 micro-batches of 1 sequence) x FSDP 2 with the experts over EP 2 (the same
#                       tokens per GPU as ep4)
#              resume   one layer of the shape (vocabulary 32000, seq 2048, eager): EP 4 for 10 steps with a
#                       checkpoint at step 5, then EP 2 from that checkpoint; the losses of steps 6-10 compared
#              default "ep4 pp2_ep2 resume"
#   LAYERS     layers of the throughput runs (default 8 on a GPU with more than 120 GiB, else 4)
#   STEPS (20), LIMIT (seconds per run, 200), DEADLINE (seconds for the whole script, 560: a run starts only with
#              60 s left), WORK (run folders, /tmp/bench_mode_235b)
#   --smoke    4 CPU processes with gloo and the shape shrunk (d 64, 8 experts, vocabulary 512, seq 64, eager): checks
#              the script and the resume path here
#   --help     this text
# Prints one JSON line per run (benchmarks/layouts_report.py row; resume: benchmarks/scale_report.py resume) and
# appends it to OUT_DIR/summary.jsonl; OUT_DIR/logs.tar.gz holds the logs and the planner's outputs.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench_args.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT_DIR:-${1:-/tmp/bench_mode_235b_out}}"
WORK="${WORK:-/tmp/bench_mode_235b}"
source benchmarks/bench_env.sh
if [ "$SMOKE" = 1 ]; then
    GPU_MIB=81920
    export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
elif ! GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1) \
        || [ -z "$GPU_MIB" ]; then
    echo "error: bench_mode_235b.sh needs 4 GPUs (nvidia-smi found none)" >&2
    exit 2
fi
GPU_GIB=$(( GPU_MIB / 1024 ))
LAYERS="${LAYERS:-$([ "$GPU_GIB" -gt 120 ] && echo 8 || echo 4)}"
STEPS="${STEPS:-20}"
RUN_LIMIT="${LIMIT:-200}"
DEADLINE="${DEADLINE:-560}"
RUNS="${RUNS:-ep4 pp2_ep2 resume}"
SUMMARY=$OUT_DIR/summary.jsonl
: > "$SUMMARY"
T_START=$SECONDS
runs=()
source benchmarks/run_job.sh

COMMON=(--config train_configs/mode_235b.toml --data.dataset builtin --data.train_path "" --data.val_path ""
        --data.tokenizer byte --data.cache_dir "$WORK/cache" --eval.steps 0 --metrics.tensorboard false
        --checkpoint.async_mode disabled --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5
        --training.global_batch_size -1)
SEQ=4096 COMPILE=true RESUME_SEQ=2048 RESUME_VOCAB=32000
if [ "$SMOKE" = 1 ]; then
    COMMON+=(--job.device cpu --model.dim 64 --model.n_heads 4 --model.n_kv_heads 2 --model.n_experts 8
             --model.moe_hidden 32)
    SEQ=64 COMPILE=false RESUME_SEQ=64 RESUME_VOCAB=512
fi
THROUGHPUT=(--model.n_layers "$LAYERS" --training.seq_len "$SEQ" --training.compile "$COMPILE"
            --checkpoint.enabled false --training.steps "$STEPS" --metrics.log_freq 5)
declare -A LAYOUT=(
    [ep4]="--parallelism.pp 1 --parallelism.dp_shard 4 --parallelism.ep 4 --training.local_batch_size 4"
    [pp2_ep2]="--parallelism.pp 2 --parallelism.pp_schedule 1F1B --parallelism.pp_virtual_stages 1
               --parallelism.pp_microbatches 8 --parallelism.dp_shard 2 --parallelism.ep 2
               --training.local_batch_size 8"
)
# resume: one layer, a smaller vocabulary and sequence (a checkpoint of 3.0e9 parameters, 36 GB with AdamW)
RESUME=(--model.n_layers 1 --model.vocab_size "$RESUME_VOCAB" --training.seq_len "$RESUME_SEQ" --training.compile false
        --training.local_batch_size 2 --parallelism.pp 1 --parallelism.dp_shard 4 --training.steps 10
        --metrics.log_freq 1 --checkpoint.enabled true --checkpoint.interval 5 --checkpoint.keep_latest_k 0)

train() {  # train NAME ARGS...: our trainer on 4 GPUs into $WORK/NAME
    local name=$1; shift
    run_job "$name" "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 \
        -m torchtitan_ext.train "$@"
}

for r in $RUNS; do
    case $r in
        ep4|pp2_ep2)
            budget "$r" || continue
            read -r -a layout <<< "$(echo ${LAYOUT[$r]})"
            args=("${COMMON[@]}" "${THROUGHPUT[@]}" "${layout[@]}")
            "$PY" -m torchtitan_ext.plan --gpus 4 --device-memory "$GPU_GIB" "${args[@]}" > "$WORK/$r.plan.txt" 2>&1
            t0=$SECONDS
            train "$r" "${args[@]}"
            "$PY" benchmarks/layouts_report.py row "b235_$r" "$WORK/$r" --plan "$WORK/$r.plan.txt" \
                --wall $((SECONDS - t0)) | tee -a "$SUMMARY"
            ;;
        resume)
            budget "$r" || continue
            train resume_ep4 "${COMMON[@]}" "${RESUME[@]}" --parallelism.ep 4
            budget "$r" || continue
            # the EP 2 job starts in a folder holding only the EP 4 job's step-5 checkpoint (a link to it)
            rm -rf "$WORK/resume_ep2" && mkdir -p "$WORK/resume_ep2/checkpoint"
            ln -s "$WORK/resume_ep4/checkpoint/step-5" "$WORK/resume_ep2/checkpoint/step-5"
            t0=$SECONDS
            timeout "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 -m torchtitan_ext.train \
                "${COMMON[@]}" "${RESUME[@]}" --parallelism.ep 2 --job.dump_folder "$WORK/resume_ep2" \
                > "$WORK/resume_ep2.log" 2>&1
            echo "run resume_ep2: exit $? after $((SECONDS - t0)) s"
            "$PY" benchmarks/scale_report.py resume "$WORK/resume_ep4" "$WORK/resume_ep2" | tee -a "$SUMMARY"
            ;;
        *) echo "unknown run '$r': expected ep4 pp2_ep2 resume" ;;
    esac
done
(cd "$WORK" && tar czf "$OUT_DIR/logs.tar.gz" ./*.log ./*.plan.txt 2>/dev/null)
echo "total $((SECONDS - T_START)) s; GPU ${GPU_GIB} GiB, ${LAYERS} layers; results in $OUT_DIR"
