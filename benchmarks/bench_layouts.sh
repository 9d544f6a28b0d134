#!/usr/bin/env bash
# Every layout on 4 GPUs, ours and torchtitan 0.2.0 in the same call (issue 42): tokens/s per GPU, MFU, peak memory
# and the planner's prediction (python -m torchtitan_ext.plan with the row's own arguments) per row.
#
# Rows: [tt_]MODEL_LAYOUT[_f8]   (tt_: torchtitan 0.2.0 from the wheels in .whl/; _f8: float8 tensorwise, with
#   float8 all-gather wherever FSDP shards; both trainers keep the output head in bf16)
#   MODEL 8b   llama3_8b (d 4096, 32 layers, 32 / 8 heads, SwiGLU 14336, vocabulary 128256), seq 8192, op-level
#              selective AC, compiled, bf16 parameters / fp32 reduce, global batch 4 sequences (PP rows: 16, as 8
#              micro-batches of 1 per pipeline)
#   MODEL 32b  the 32b flavor's shape (d 7168, 56 / 8 heads, SwiGLU 19456, vocabulary 128256) with LAYERS_32B layers
#              (default 16: the planner puts FSDP 4 at 64 GiB, TP 4 at 74; 20 would not fit TP 4) and no QK-norm
#              (torchtitan's llama3 has none), otherwise as 8b
#   LAYOUT     fsdp4, hsdp2x2 (full AC in both trainers: the planner puts selective at 83 GiB), fsdp2_tp2,
#              fsdp2_tp2_async (async TP; the row's log holds Inductor's generated code, and the summary counts
#              the fused all-gather-matmul / matmul-reduce-scatter calls in it), pp2_fsdp2_1f1b, pp2_fsdp2_i1f1b
#              (Interleaved1F1B), pp2_fsdp2_zbv (ZBVZeroBubble; both 2 stages per rank; full AC in both trainers,
#              AC_ZBV: a zero-bubble schedule runs the weight gradients as a second backward pass, which op-level
#              selective AC refuses, "Trying to backward an extra time", seen on CPU; eager in both trainers:
#              neither runs a zero-bubble schedule over compiled blocks, ours says so in one line, torchtitan
#              raises), tp2_pp2 (1F1B), tp4; on 2 GPUs (the rows' NPROC is 2): pp2_i1f1b and pp2_zbv, PP 2
#              alone with a pipeline's batch of pp2_fsdp2 (8 micro-batches of 1), otherwise as pp2_fsdp2_*.
#              8b: all but tp4; 32b: fsdp4, fsdp2_tp2, tp4. torchtitan splits
#              pipeline stages counting the embedding and the head as a layer each; ours splits the blocks evenly.
#              torchtitan 0.2.0 trains tp4 and tp2_pp2 (no FSDP) in float32: its mixed precision goes through
#              FSDP ("Mixed precision training is disabled" in its log), so those rows get no ours / torchtitan
#              ratio.
#              plan: the planner's choice (ours only): `python -m torchtitan_ext.plan --search` on 4 GPUs of the
#              machine's memory, at the model's global batch of 4 sequences, picks layout, schedule, AC and batch;
#              the row trains with its overrides, and the table says whether it is the fastest row of the call.
#
# Usage, from the repository root on a 4-GPU machine (carry .whl: torchao for _f8, torchtitan's wheels for tt_):
#   OUT_DIR=$OUT ROWS="8b_fsdp4 tt_8b_fsdp4 8b_fsdp4_f8 tt_8b_fsdp4_f8" benchmarks/bench_layouts.sh
#   (a 2-GPU machine: the pp2_i1f1b and pp2_zbv rows only)
#   benchmarks/bench_layouts.sh --list        every row with its expected wall time on 4 H100s
#   benchmarks/bench_layouts.sh --smoke       the script's plumbing on CPU: 4 gloo processes, the debug model,
#                                             eager (ROWS default: one row per layout kind; tt_ and _f8 rows
#                                             need CUDA and report so)
# env: ROWS (required on GPUs), STEPS (30; PP rows STEPS_PP, 20), LAYERS_32B (16), AC_HSDP (full), AC_ZBV (full),
#      DEADLINE (560: seconds for the whole script; a row starts only if its expected time fits what is left and
#      is cut at the deadline, so the call returns its results), OUT_DIR (summary.jsonl, table.txt, logs.tar.gz
#      with every run's log and planner output), WORK (/tmp/bench_layouts: run folders), PY (python3), DEVICE_GIB
#      (the plan rows' memory per GPU; default: the card's), EXTRA
#      (trainer overrides added to every row of ours, e.g. EXTRA="--training.gc_freq 0")
# Metrics: the median over the windows ending after step 10 (benchmarks/scale_report.py, logged every 5 steps);
# memory is rank 0's (ours: max allocated and reserved; torchtitan logs max reserved).
set -uo pipefail
SMOKE=0; LIST=0
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        --list) LIST=1 ;;
        -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$arg' (--smoke, --list, --help)"; exit 2 ;;
    esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT_DIR="${OUT_DIR:-/tmp/bench_layouts_out}"
WORK="${WORK:-/tmp/bench_layouts}"
STEPS="${STEPS:-30}"
STEPS_PP="${STEPS_PP:-20}"
LAYERS_32B="${LAYERS_32B:-16}"
AC_HSDP="${AC_HSDP:-full}"
AC_ZBV="${AC_ZBV:-full}"
DEADLINE="${DEADLINE:-560}"
LAYOUTS_8B="fsdp4 hsdp2x2 fsdp2_tp2 fsdp2_tp2_async pp2_fsdp2_1f1b pp2_fsdp2_i1f1b pp2_fsdp2_zbv tp2_pp2 pp2_i1f1b
            pp2_zbv"
LAYOUTS_32B="fsdp4 fsdp2_tp2 tp4"
ALL_ROWS=""
for m in 8b 32b; do
    [ $m = 8b ] && layouts=$LAYOUTS_8B || layouts=$LAYOUTS_32B
    for l in $layouts; do for p in "" _f8; do ALL_ROWS+=" ${m}_$l$p tt_${m}_$l$p"; done; done
    ALL_ROWS+=" ${m}_plan ${m}_plan_f8"
done

# Expected wall seconds of a row on 4 H100s (start-up, model build and compile, then the steps): 8b about 90 s
# to start (torchtitan alike) and 0.9 s a step at batch 4 (PP rows: 16 sequences, about 3.5 s a step); 32b
# (16 layers) about 100 s and 1.2 s a step; float8 steps about 0.8x. Rough until measured: the table's wall_s.
estimate() {
    local row=${1#tt_} start step steps=$STEPS
    case $row in
        8b_pp2_fsdp2_*) start=100; step=35; steps=$STEPS_PP ;;  # tenths of a second
        8b_pp2_*) start=100; step=40; steps=$STEPS_PP ;;
        8b_tp2_pp2*) start=100; step=20; steps=$STEPS_PP ;;
        8b_hsdp2x2*) start=90; step=12 ;;
        8b_plan*) start=95; step=9 ;;
        8b_*) start=90; step=9 ;;
        32b_tp4*) start=100; step=14 ;;
        32b_*) start=100; step=12 ;;
    esac
    [[ $row == *_f8 ]] && step=$(( step * 8 / 10 ))
    echo $(( start + (steps * step + 9) / 10 ))
}
if (( LIST )); then
    for r in $ALL_ROWS; do printf "%-28s %4d s\n" "$r" "$(estimate "$r")"; done
    exit 0
fi

if (( SMOKE )); then
    ROWS="${ROWS:-8b_fsdp4 8b_hsdp2x2 8b_fsdp2_tp2 8b_pp2_fsdp2_zbv 8b_tp2_pp2 32b_tp4 8b_fsdp4_f8 tt_8b_fsdp4}"
    STEPS=12; STEPS_PP=12; DEADLINE="${DEADLINE_SMOKE:-1500}"
    export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
elif [ -z "${ROWS:-}" ]; then
    echo "error: set ROWS to some of (benchmarks/bench_layouts.sh --list gives each one's expected time):"
    echo "$ALL_ROWS" | fold -s -w 110
    exit 2
fi
for r in $ROWS; do
    [[ " $ALL_ROWS " == *" $r "* ]] || { echo "error: unknown row '$r' (benchmarks/bench_layouts.sh --list)"; exit 2; }
done

source benchmarks/bench_env.sh
SUMMARY=$OUT_DIR/summary.jsonl
# the plan rows' memory budget: this machine's card (GiB), 80 on CPU
DEVICE_GIB=${DEVICE_GIB:-$("$PY" -c "import torch; c = torch.cuda.is_available(); \
print(int(torch.cuda.get_device_properties(0).total_memory / 2**30) if c else 80)" 2>/dev/null || echo 80)}
: > "$SUMMARY"
T_START=$SECONDS
runs=()
source benchmarks/run_job.sh
if [[ " $ROWS " == *_f8\ * ]]; then
    source benchmarks/torchao_wheel.sh
    use_torchao_wheel bench_layouts "$SMOKE" || exit 1
fi

# ---- our trainer ----
ours_args() {  # ours_args ROW: the trainer's arguments for ROW into the array A
    local row=$1 model layout f8=0 fsdp=1
    [[ $row == *_f8 ]] && { f8=1; row=${row%_f8}; }
    model=${row%%_*}; layout=${row#*_}
    A=(--data.tokenizer byte --data.cache_dir "$WORK/cache" --checkpoint.enabled false --eval.steps 0
       --metrics.tensorboard false --metrics.log_freq 5 --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5
       --activation_checkpoint.mode selective --activation_checkpoint.selective_every 0)
    if (( SMOKE )); then
        A+=(--job.device cpu --model.flavor debug --model.n_layers 4 --model.n_kv_heads 4 --training.seq_len 64
            --training.compile false)
    elif [ "$model" = 8b ]; then
        A+=(--model.flavor llama3_8b --training.seq_len 8192 --training.compile true)
    else
        A+=(--model.flavor 32b --model.n_layers "$LAYERS_32B" --model.qk_norm false --training.seq_len 8192
            --training.compile true)
    fi
    local steps=$STEPS
    NPROC=4
    case $layout in
        fsdp4|plan) A+=(--parallelism.dp_shard 4 --training.local_batch_size 1) ;;
        hsdp2x2) A+=(--parallelism.dp_replicate 2 --parallelism.dp_shard 2 --training.local_batch_size 1
                     --activation_checkpoint.mode "$AC_HSDP") ;;
        fsdp2_tp2) A+=(--parallelism.dp_shard 2 --parallelism.tp 2 --training.local_batch_size 2) ;;
        fsdp2_tp2_async) A+=(--parallelism.dp_shard 2 --parallelism.tp 2 --training.local_batch_size 2
                             --parallelism.async_tp true) ;;
        pp2_*)  # pp2_fsdp2_SCHEDULE on 4 GPUs; pp2_SCHEDULE, PP 2 alone, on 2
            local sched=1F1B virtual=1 shard=2
            [[ $layout == pp2_fsdp2_* ]] || { shard=1; fsdp=0; NPROC=2; }
            case ${layout##*_} in i1f1b) sched=Interleaved1F1B; virtual=2 ;; zbv) sched=ZBVZeroBubble; virtual=2 ;; esac
            A+=(--parallelism.pp 2 --parallelism.dp_shard "$shard" --training.local_batch_size 8
                --parallelism.pp_microbatches 8 --parallelism.pp_schedule "$sched"
                --parallelism.pp_virtual_stages "$virtual"); steps=$STEPS_PP
            [ "$sched" = ZBVZeroBubble ] && A+=(--activation_checkpoint.mode "$AC_ZBV" --training.compile false) ;;
        tp2_pp2) A+=(--parallelism.tp 2 --parallelism.pp 2 --parallelism.dp_shard 1 --training.local_batch_size 8
                     --parallelism.pp_microbatches 8 --parallelism.pp_schedule 1F1B); steps=$STEPS_PP; fsdp=0 ;;
        tp4) A+=(--parallelism.tp 4 --parallelism.dp_shard 1 --training.local_batch_size 4); fsdp=0 ;;
    esac
    A+=(--training.steps "$steps")
    read -r -a extra <<< "${EXTRA:-}"
    A+=("${extra[@]}")
    if (( f8 )); then
        A+=(--float8.enabled true --float8.recipe tensorwise)
        (( fsdp )) && A+=(--float8.enable_fsdp_float8_all_gather true
                          --float8.precompute_float8_dynamic_scale_for_fsdp true)
    fi
}

# The async TP rows log Inductor's generated code (TORCH_LOGS=output_code), so layouts_report.py can count the
# fused collective-matmul calls in it: Inductor's micro-pipeline pass skips a pattern it cannot fuse silently.
# inductor_code_log ROW: the command prefix that does so for ROW (nothing for the others: an empty TORCH_LOGS
# makes torch fail at import)
inductor_code_log() { [[ $1 == *_async* ]] && echo env TORCH_LOGS=output_code; return 0; }

# ours ROW LIMIT: the planner on the row's arguments (plan rows: its search, whose chosen layout's overrides come
# last, so they win), then the trainer
ours() {
    local row=$1 limit=$2 t0=$SECONDS
    local plan="$WORK/$row.plan.txt"
    ours_args "$row"
    if [[ $row == *_plan* ]]; then
        "$PY" -m torchtitan_ext.plan --gpus "$NPROC" --device-memory "$DEVICE_GIB" --search "${A[@]}" > "$plan" 2>&1
        local chosen; chosen=$(sed -n 's/^  its overrides: //p' "$plan")
        if [ -z "$chosen" ]; then
            local why; why=$(tail -n 1 "$plan" | tr -d '"\\')
            echo "{\"row\": \"$row\", \"error\": \"the planner's search chose no layout: $why\"}" | tee -a "$SUMMARY"
            return 0
        fi
        read -r -a extra <<< "$chosen"
        A+=("${extra[@]}")
    else
        "$PY" -m torchtitan_ext.plan --gpus "$NPROC" "${A[@]}" > "$plan" 2>&1
    fi
    # shellcheck disable=SC2046  # the prefix's words are meant to split (none is a glob)
    run_job "$row" "$limit" $(inductor_code_log "$row") "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node "$NPROC" -m torchtitan_ext.train "${A[@]}"
    "$PY" benchmarks/layouts_report.py row "$row" "$WORK/$row" --plan "$plan" \
        --wall $((SECONDS - t0)) | tee -a "$SUMMARY"
}

# ---- torchtitan 0.2.0 ----
TT_SITE=/tmp/tt_site
TT_ASSETS=$WORK/tt_assets
tt_ready() {  # the wheels installed and the assets built, once; false with a JSON line for ROW otherwise
    if (( SMOKE )); then
        echo "{\"row\": \"$1\", \"error\": \"torchtitan rows need CUDA (smoke run)\"}" | tee -a "$SUMMARY"; return 1
    fi
    if ! ls .whl/torchtitan-0.2.0-*.whl >/dev/null 2>&1; then
        echo "{\"row\": \"$1\", \"error\": \"no .whl/torchtitan-0.2.0 wheel (carry .whl)\"}" | tee -a "$SUMMARY"; return 1
    fi
    if [ ! -d "$TT_SITE/torchtitan" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$TT_SITE" .whl/*.whl \
            > "$WORK/tt_pip.log" 2>&1 || { echo "pip install failed:"; tail -n 5 "$WORK/tt_pip.log"; }
    fi
    if [ ! -f "$TT_ASSETS/c4_local/train.jsonl" ]; then
        PYTHONPATH="$TT_SITE:$PYTHONPATH" "$PY" benchmarks/torchtitan/make_assets.py "$TT_ASSETS" \
            > "$WORK/tt_assets.log" 2>&1 || { echo "make_assets failed:"; tail -n 5 "$WORK/tt_assets.log"; }
    fi
}

tt_args() {  # tt_args ROW: torchtitan's arguments for ROW (without tt_) into the array A
    local row=$1 model layout f8=0 fsdp=1 steps=$STEPS
    [[ $row == *_f8 ]] && { f8=1; row=${row%_f8}; }
    model=${row%%_*}; layout=${row#*_}
    NPROC=4
    A=(--job.config_file llama3.toml --model.hf_assets_path "$TT_ASSETS/tokenizer"
       --training.dataset_path "$TT_ASSETS/c4_local")
    [ "$model" = 32b ] && A+=(--model.flavor 32b_shape)
    case $layout in
        fsdp4) A+=(--parallelism.data_parallel_shard_degree 4 --training.local_batch_size 1) ;;
        hsdp2x2) A+=(--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2
                     --training.local_batch_size 1 --activation_checkpoint.mode "$AC_HSDP") ;;
        fsdp2_tp2) A+=(--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
                       --training.local_batch_size 2) ;;
        fsdp2_tp2_async) A+=(--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
                             --training.local_batch_size 2 --parallelism.enable_async_tensor_parallel) ;;
        pp2_*)  # as ours
            local sched=1F1B shard=2
            [[ $layout == pp2_fsdp2_* ]] || { shard=1; fsdp=0; NPROC=2; }
            case ${layout##*_} in i1f1b) sched=Interleaved1F1B ;; zbv) sched=ZBVZeroBubble ;; esac
            A+=(--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree "$shard"
                --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 1
                --parallelism.pipeline_parallel_schedule "$sched"); steps=$STEPS_PP
            [ "$sched" = ZBVZeroBubble ] && A+=(--activation_checkpoint.mode "$AC_ZBV" --compile.no-enable) ;;
        tp2_pp2) A+=(--parallelism.pipeline_parallel_degree 2 --parallelism.tensor_parallel_degree 2
                     --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 8
                     --parallelism.pipeline_parallel_microbatch_size 1 --parallelism.pipeline_parallel_schedule 1F1B)
                 steps=$STEPS_PP; fsdp=0 ;;
        tp4) A+=(--parallelism.tensor_parallel_degree 4 --parallelism.data_parallel_shard_degree 1
                 --training.local_batch_size 4); fsdp=0 ;;
    esac
    A+=(--training.steps "$steps")
    if (( f8 )); then  # tensorwise is torchao's default recipe; recipe_name cannot go with the float8 all-gather
        A+=(--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output)
        (( fsdp )) && A+=(--quantize.linear.float8.enable_fsdp_float8_all_gather
                          --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)
    fi
}

tt() {  # tt ROW LIMIT
    local row=$1 limit=$2 t0=$SECONDS
    tt_ready "$row" || return 0
    tt_args "${row#tt_}"
    rm -rf "${WORK:?}/$row"
    (cd benchmarks/torchtitan && TT_32B_LAYERS=$LAYERS_32B PYTHONPATH="$TT_SITE:$PWD:$PYTHONPATH" \
        timeout "$limit" $(inductor_code_log "$row") "$PY" -m torch.distributed.run --standalone \
        --nproc_per_node "$NPROC" --tee 3 \
        -m torchtitan.train "${A[@]}" --job.dump_folder "$WORK/$row") > "$WORK/$row.log" 2>&1
    local rc=$?
    echo "run $row: exit $rc after $((SECONDS - t0)) s"
    if [ $rc != 0 ]; then grep -v "^\s*$" "$WORK/$row.log" | grep -iE "error|exception|unsupported" | tail -n 8; fi
    "$PY" benchmarks/layouts_report.py row "$row" "$WORK/$row" --wall $((SECONDS - t0)) | tee -a "$SUMMARY"
}

for row in $ROWS; do
    left=$(( DEADLINE - (SECONDS - T_START) ))
    need=$(estimate "$row")
    (( SMOKE )) && need=200  # CPU: minutes a row on a busy machine
    if (( left < need )); then
        echo "{\"row\": \"$row\", \"error\": \"skipped: expected ${need} s, ${left} s left of DEADLINE=$DEADLINE\"}" \
            | tee -a "$SUMMARY"
        continue
    fi
    limit=$(( left < 2 * need ? left : 2 * need ))  # a row may take twice its estimate, never past the deadline
    if [[ $row == tt_* ]]; then tt "$row" "$limit"; else ours "$row" "$limit"; fi
done

"$PY" benchmarks/layouts_report.py table "$SUMMARY" | tee "$OUT_DIR/table.txt"
(cd "$WORK" && tar czf "$OUT_DIR/logs.tar.gz" ./*.log ./*.plan.txt 2>/dev/null)
echo "total: $((SECONDS - T_START)) s"
