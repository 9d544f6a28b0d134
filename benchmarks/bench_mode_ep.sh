#!/usr/bin/env bash
# MoDE trainer throughput on 2 GPUs: expert parallelism 1 (experts FSDP-sharded with everything else over
# the 2 ranks) against EP 2 (each rank holds 8 of the 16 experts of every layer; tokens travel by
# all-to-all), eager and compiled. Model: the mode_debug flavor resized to d_model 2048, 16 heads (8 KV),
# 4 layers, 16 experts of SwiGLU hidden 1408, top-2, vocabulary 32000; seq 2048, 8 sequences per GPU,
# bf16 (FSDP mixed precision), 30 steps. About 5 minutes on 2 H100/H200.
#
# Usage, from the repository root on a 2-GPU machine: benchmarks/bench_mode_ep.sh [OUT_DIR]
#        --smoke: 2 CPU processes with gloo and a tiny model, to check the script itself.
# Prints one JSON line per run (benchmarks/summarize.py: median tokens/s per GPU after the first two
# logged windows, peak memory, first/last loss) followed by the expert-load keys of the last logged step:
# imbalance = max / mean routed tokens per expert (summed over both ranks), mean and worst over layers.
set -uo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_mode_ep}}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast (NVLS) off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PY:-python3}"
[ -x .venv/bin/python ] && ! "$PY" -c "import torch" 2>/dev/null && PY=.venv/bin/python

if [ "$SMOKE" = 1 ]; then
    export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
    MODEL=(--job.device cpu --model.vocab_size 512 --training.seq_len 64 --training.local_batch_size 2
           --training.steps 10 --metrics.log_freq 2)
    COMPILE_MODES=(false true)  # compiled EP runs on CPU too (experts eager between graphs)
    LIMIT=300
else
    MODEL=(--model.dim 2048 --model.n_heads 16 --model.n_kv_heads 8 --model.n_layers 4 --model.n_experts 16
           --model.top_k 2 --model.moe_hidden 1408 --model.vocab_size 32000 --training.seq_len 2048
           --training.local_batch_size 8 --training.steps 30 --metrics.log_freq 5)
    COMPILE_MODES=(false true)
    LIMIT=240
fi

runs=()
source benchmarks/run_job.sh
run() {
    local name=$1; shift
    run_job "$name" "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m torchtitan_ext.train \
        --config train_configs/mode_debug.toml --data.tokenizer byte \
        --checkpoint.enabled false --eval.steps 0 --metrics.tensorboard false --optimizer.lr 3e-4 \
        --lr_scheduler.warmup_steps 5 "${MODEL[@]}" "$@"
}
for compile in "${COMPILE_MODES[@]}"; do
    suffix=$([ "$compile" = true ] && echo _compiled || echo "")
    run "ep1$suffix" --parallelism.ep 1 --training.compile "$compile"
    run "ep2$suffix" --parallelism.ep 2 --training.compile "$compile"
done

"$PY" benchmarks/summarize.py "${runs[@]}"
"$PY" - "${runs[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path

for folder in map(Path, sys.argv[1:]):
    try:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        continue
    train = [r for r in rows if "loss" in r and "tokens_per_sec" in r]
    if not train:
        continue
    last = train[-1]
    imb = [v for k, v in last.items() if k.startswith("moe/") and k.endswith("/imbalance")]
    out = {"run": folder.name, "step": last["step"]}
    if imb:
        out["imbalance_mean"] = round(statistics.mean(imb), 3)
        out["imbalance_max"] = round(max(imb), 3)
    for key in ("moe/aux_loss", "moe/router_z_loss"):
        if key in last:
            out[key] = round(last[key], 4)
    print(json.dumps(out))
EOF
