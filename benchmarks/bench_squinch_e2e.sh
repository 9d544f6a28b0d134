#!/usr/bin/env bash
# Two GPUs of one host, NCCL forced onto its socket transport (no P2P/NVLink, no shared memory), so the
# gradient reduction is bandwidth-bound: the trainer uncompressed vs with Squinch 6-bit gradients, same
# seed and data, a fixed number of steps. Prints per run the step time (from metrics.jsonl tokens_per_sec),
# the final loss and the gradient bytes per step, and writes summary.json.
#
# Usage from the repository root:  bash benchmarks/bench_squinch_e2e.sh [--smoke] [OUT_DIR]
#   env: STEPS (30) LAYERS (4) SEQ (1024) BATCH (2) BUDGET_S (330: the second pair runs only if its
#        predicted time fits what is left) PYTHON (python3) PROFILE (0; 1: a torch.profiler trace of steps
#        PROFILE_STEPS (20,21) per rank in each run's profile/ folder: encode / decode kernels, all-to-all and
#        stream waits of the Squinch reduce-scatter against the bf16 one)
#   --smoke: 2 gloo processes on CPU, the debug model, a few steps, to check the script itself.
#
# Pairs (FSDP first, then DDP when the budget allows):
#   fsdp_bf16 / fsdp_squinch: FSDP2 reduce-scatter in bf16 (--training.mixed_precision_reduce bfloat16)
#                             vs the Squinch reduce-scatter (6 bytes per 8 values, float32 sums);
#   ddp_plain / ddp_squinch:  DDP's own all-reduce vs the Squinch DDP hook. DDP reduces the gradients in
#                             their own dtype, float32 here (mixed_precision_reduce is an FSDP setting).
# Bytes per step are one rank's, handed to the collectives (not bytes on the wire): for Squinch runs
# comm/bytes_sent and comm/bytes_uncompressed (what the same collectives would carry uncompressed: for DDP an
# all-to-all plus an all-gather, 1.5x the gradient on 2 ranks); for the uncompressed runs, parameters x the
# reduce dtype's size (the reduce-scatter or all-reduce input). Step time is the median over the logged
# windows after the first (warm-up).
set -uo pipefail
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_squinch_e2e}}"
PY="${PYTHON:-python3}"
START=$SECONDS
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Socket path between the two GPUs, and no NVLink multicast / symmetric-memory multicast.
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1

if (( SMOKE )); then
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
    SHAPE=(--model.flavor debug --training.seq_len 64 --training.local_batch_size 4 --job.device cpu
           --metrics.log_freq 2)
    STEPS=${STEPS:-6}; BUDGET_S=${BUDGET_S:-600}
else
    SHAPE=(--model.flavor 1b --model.n_layers "${LAYERS:-4}" --training.seq_len "${SEQ:-1024}"
           --training.local_batch_size "${BATCH:-2}" --job.device cuda --metrics.log_freq 5)
    STEPS=${STEPS:-30}; BUDGET_S=${BUDGET_S:-330}
fi
COMMON=(--config train_configs/debug.toml --data.tokenizer byte --checkpoint.enabled false --eval.steps 0
        --metrics.tensorboard false --job.seed 0 --training.steps "$STEPS"
        --lr_scheduler.warmup_steps $(( STEPS / 10 )) --optimizer.lr 3e-4 "${SHAPE[@]}")
if [[ "${PROFILE:-0}" == 1 ]]; then
    IFS=, read -r p0 p1 <<< "${PROFILE_STEPS:-20,21}"
    COMMON+=(--profiling.enabled true --profiling.start_step "$p0" --profiling.end_step "$p1")
fi
flags() {  # the overrides of one run
    case $1 in
        fsdp_bf16) echo "--parallelism.dp_mode fsdp --training.mixed_precision_reduce bfloat16" ;;
        fsdp_squinch) echo "--parallelism.dp_mode fsdp --training.mixed_precision_reduce bfloat16" \
                           "--comm.gradient_compression squinch" ;;
        ddp_plain) echo "--parallelism.dp_mode ddp" ;;
        ddp_squinch) echo "--parallelism.dp_mode ddp --comm.gradient_compression squinch" ;;
    esac
}
run() {  # run NAME: one torchrun job on 2 ranks; its wall time goes to NAME.seconds
    local name=$1 t0=$SECONDS
    rm -rf "${OUT:?}/$name"
    # shellcheck disable=SC2046
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m torchtitan_ext.train \
        --job.dump_folder "$OUT/$name" "${COMMON[@]}" $(flags "$name") > "$OUT/$name.log" 2>&1 \
        || { echo "run $name failed:"; tail -n 15 "$OUT/$name.log"; }
    echo $(( SECONDS - t0 )) > "$OUT/$name.seconds"
    echo "$name: $(( SECONDS - t0 ))s"
}

run fsdp_bf16
run fsdp_squinch
# The DDP pair if it fits: its predicted time is the FSDP pair's wall time.
PAIR=$(( $(cat "$OUT/fsdp_bf16.seconds") + $(cat "$OUT/fsdp_squinch.seconds") ))
LEFT=$(( BUDGET_S - (SECONDS - START) ))
if (( PAIR <= LEFT )); then
    run ddp_plain
    run ddp_squinch
else
    echo "DDP pair skipped: predicted ${PAIR}s, ${LEFT}s left of BUDGET_S=$BUDGET_S"
    rm -rf "$OUT/ddp_plain" "$OUT/ddp_squinch"
fi

"$PY" - "$OUT" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
RUNS = {"fsdp_bf16": ("fsdp", 2), "fsdp_squinch": ("fsdp", 2), "ddp_plain": ("ddp", 4), "ddp_squinch": ("ddp", 4)}

def toml_int(cfg: str, key: str) -> int:
    return int(next(x.split("=")[1] for x in cfg.splitlines() if x.strip().startswith(key + " ")))

summary = {}
for name, (mode, reduce_bytes) in RUNS.items():
    folder = out / name
    log = out / f"{name}.log"
    if not log.exists():
        continue
    rows = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r] \
        if (folder / "metrics.jsonl").exists() else []
    if not rows:
        lines = [x for x in log.read_text().splitlines() if x.strip()]
        summary[name] = {"error": lines[-1][:200] if lines else "no output"}
        continue
    cfg = (folder / "config.toml").read_text()
    tokens_per_step = 2 * toml_int(cfg, "local_batch_size") * toml_int(cfg, "seq_len")  # 2 data-parallel ranks
    steady = rows[1:] or rows  # the first window holds the warm-up
    tps = statistics.median(r["tokens_per_sec"] for r in steady)
    row = {"mode": mode, "steps": rows[-1]["step"], "step_ms": round(1e3 * tokens_per_step / tps, 1),
           "tokens_per_sec": round(tps), "final_loss": round(rows[-1]["loss"], 4),
           "wall_s": int((out / f"{name}.seconds").read_text())}
    if "comm/bytes_sent" in rows[-1]:
        row["bytes_sent_per_step"] = round(statistics.median(r["comm/bytes_sent"] for r in steady))
        row["bytes_uncompressed_per_step"] = round(statistics.median(r["comm/bytes_uncompressed"] for r in steady))
    else:
        params = re.search(r"model \S+: ([\d,]+) parameters", log.read_text())
        if params:  # FSDP's dim-0 padding to a multiple of 2 left out
            row["bytes_sent_per_step"] = int(params.group(1).replace(",", "")) * reduce_bytes
    summary[name] = row
for plain, squinch in (("fsdp_bf16", "fsdp_squinch"), ("ddp_plain", "ddp_squinch")):
    a, b = summary.get(plain, {}), summary.get(squinch, {})
    if "step_ms" in a and "step_ms" in b:
        b["speedup"] = round(a["step_ms"] / b["step_ms"], 3)
        b["loss_vs_plain_pct"] = round(100 * (b["final_loss"] / a["final_loss"] - 1), 2)
        if "bytes_sent_per_step" in a:
            b["bytes_vs_plain"] = round(b["bytes_sent_per_step"] / a["bytes_sent_per_step"], 4)
cols = {"step_ms": "step_ms", "tokens_per_sec": "tokens/s", "speedup": "speedup", "final_loss": "final_loss",
        "loss_vs_plain_pct": "loss_vs_plain%", "bytes_sent_per_step": "bytes_sent/step",
        "bytes_uncompressed_per_step": "uncompressed/step", "bytes_vs_plain": "bytes_vs_plain", "wall_s": "wall_s"}
print(f"{'run':<14}" + "".join(f"{h:>18}" for h in cols.values()))
for name, row in summary.items():
    cells = "".join(f"{row.get(c, '-')!s:>18}" for c in cols)
    print(f"{name:<14}{cells}" + (f"  {row['error']}" if "error" in row else ""))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
echo "total $(( SECONDS - START ))s; logs and metrics in $OUT"
