#!/usr/bin/env bash
# Squinch across nodes: HSDP dp_replicate 2 x dp_shard 2 on two emulated nodes of one 4-GPU host
# (benchmarks/two_nodes.sh: two torchrun agents with their own NCCL_HOSTID, so the replicate all-reduce
# crosses NET/Socket and the reduce-scatter stays on NVLink), then the same job on one node (no host ids: all
# NVLink) with Squinch off and on. Same seed and data in every run; one JSON line per run, then a table.
#
# Usage from the repository root:  bash benchmarks/bench_squinch_hsdp.sh [--smoke] [OUT_DIR]
#   env: STEPS (40) LAYERS (4) SEQ (2048) BATCH (4) FLAVOR (1b) PROFILE (0; 1: a torch.profiler trace of steps
#        PROFILE_STEPS (20,21) in each run's profile/ folder) RUNS (all: a space-separated subset) PYTHON (python3)
#   --smoke: the script itself on CPU (gloo, two agents of 2 processes, the debug model, 3 steps, the two-node
#            bf16 and Squinch runs only).
#
# Runs:
#   nodes2_bf16     two nodes, uncompressed HSDP, gradients reduced in bf16 (training.mixed_precision_reduce)
#   nodes2_fp32     two nodes, uncompressed HSDP, float32 reduce (the default)
#   nodes2_squinch  two nodes, Squinch on the replicate all-reduce (per module, overlapped with the backward),
#                   the reduce-scatter inside a node native in bf16
#   node1_bf16      one node, uncompressed HSDP, bf16 reduce (compression off: the default)
#   node1_squinch   one node, Squinch as in nodes2_squinch (its cost where the link is fast)
# JSON fields: tokens_per_sec (the job's, median over the logged windows after the first), step_ms, loss (last
# step), bytes_sent / bytes_uncompressed per step and rank (Squinch runs: the replicate all-reduce's; others:
# the replicate all-reduce's input, parameters / dp_shard x the reduce dtype's size), wall_s, transport (the
# two_nodes.sh verdict line). Each run gets 150 s at most (timeout), the whole script about 8 minutes on 4 H100s.
set -uo pipefail
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT="${1:-${OUT:-/tmp/bench_squinch_hsdp}}"
PY="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
START=$SECONDS
mkdir -p "$OUT"
if (( SMOKE )); then
    SHAPE=(--model.flavor debug --training.seq_len 64 --training.local_batch_size 1 --job.device cpu
           --metrics.log_freq 1)
    STEPS=${STEPS:-3}; MODE=(--cpu); LIMIT=${LIMIT:-900}
    RUNS=${RUNS:-nodes2_bf16 nodes2_squinch}
else
    SHAPE=(--model.flavor "${FLAVOR:-1b}" --model.n_layers "${LAYERS:-4}" --training.seq_len "${SEQ:-2048}"
           --training.local_batch_size "${BATCH:-4}" --job.device cuda --metrics.log_freq 5)
    STEPS=${STEPS:-40}; MODE=(); LIMIT=${LIMIT:-150}
    RUNS=${RUNS:-nodes2_bf16 nodes2_fp32 nodes2_squinch node1_bf16 node1_squinch}
fi
COMMON=(--config train_configs/debug.toml --data.tokenizer byte --checkpoint.enabled false --eval.steps 0
        --metrics.tensorboard false --job.seed 0 --training.steps "$STEPS" --lr_scheduler.warmup_steps 4
        --optimizer.lr 3e-4 --parallelism.dp_replicate 2 --parallelism.dp_shard 2 "${SHAPE[@]}")
if [[ "${PROFILE:-0}" == 1 ]]; then
    IFS=, read -r p0 p1 <<< "${PROFILE_STEPS:-20,21}"
    COMMON+=(--profiling.enabled true --profiling.start_step "$p0" --profiling.end_step "$p1")
fi
flags() {  # the overrides of one run
    case $1 in
        *_bf16) echo "--training.mixed_precision_reduce bfloat16" ;;
        *_fp32) echo "--training.mixed_precision_reduce float32" ;;
        *_squinch) echo "--training.mixed_precision_reduce bfloat16 --comm.gradient_compression squinch" ;;
    esac
}
for name in $RUNS; do
    rm -rf "${OUT:?}/$name"
    t0=$SECONDS
    hostid=(); [[ $name == node1_* ]] && hostid=(--no-hostid)
    # shellcheck disable=SC2046
    timeout "$LIMIT" bash "$REPO/benchmarks/two_nodes.sh" "${MODE[@]}" "${hostid[@]}" --logs "$OUT/$name.logs" -- \
        "${COMMON[@]}" $(flags "$name") --job.dump_folder "$OUT/$name" > "$OUT/$name.verdict" 2>&1
    echo "$? $(( SECONDS - t0 ))" > "$OUT/$name.status"
    echo "$name: exit $(cut -d' ' -f1 "$OUT/$name.status") after $(( SECONDS - t0 )) s: $(tail -n 1 "$OUT/$name.verdict")"
done

"$PY" - "$OUT" "$RUNS" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out, runs = Path(sys.argv[1]), sys.argv[2].split()
summary = {}
for name in runs:
    rc, wall = (out / f"{name}.status").read_text().split()
    verdict = (out / f"{name}.verdict").read_text().strip().splitlines()
    row = {"run": name, "exit": int(rc), "wall_s": int(wall), "transport": verdict[-1] if verdict else ""}
    metrics = out / name / "metrics.jsonl"
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if metrics.exists() else []
    if rows:
        cfg = (out / name / "config.toml").read_text()
        get = lambda key: next(x.split("=")[1].strip().strip('"') for x in cfg.splitlines()  # noqa: E731
                               if x.strip().startswith(key + " "))
        tokens = 4 * int(get("local_batch_size")) * int(get("seq_len"))  # 4 data-parallel ranks
        steady = rows[1:] or rows  # the first window holds the warm-up
        tps = statistics.median(r["tokens_per_sec"] for r in steady)
        row.update(steps=rows[-1]["step"], tokens_per_sec=round(tps), step_ms=round(1e3 * tokens / tps, 1),
                   loss=round(rows[-1]["loss"], 4))
        if "comm/bytes_sent" in rows[-1]:
            row["bytes_sent"] = round(statistics.median(r["comm/bytes_sent"] for r in steady))
            row["bytes_uncompressed"] = round(statistics.median(r["comm/bytes_uncompressed"] for r in steady))
        else:
            log = "".join(p.read_text(errors="replace") for p in (out / f"{name}.logs").glob("agent-*.log"))
            params = re.search(r"model \S+: ([\d,]+) parameters", log)
            if params:  # one rank's replicate all-reduce input: its shard in the reduce dtype
                size = 2 if get("mixed_precision_reduce") == "bfloat16" else 4
                row["bytes_sent"] = row["bytes_uncompressed"] = int(params.group(1).replace(",", "")) // 2 * size
    summary[name] = row
    print(json.dumps(row))
for base, other in (("nodes2_bf16", "nodes2_squinch"), ("nodes2_bf16", "nodes2_fp32"), ("node1_bf16", "node1_squinch")):
    a, b = summary.get(base, {}), summary.get(other, {})
    if "step_ms" in a and "step_ms" in b:
        b[f"step_vs_{base}"] = round(b["step_ms"] / a["step_ms"], 3)
        b[f"loss_vs_{base}_pct"] = round(100 * (b["loss"] / a["loss"] - 1), 3)
cols = ["tokens_per_sec", "step_ms", "loss", "bytes_sent", "step_vs_nodes2_bf16", "step_vs_node1_bf16", "wall_s"]
print(f"{'run':<16}" + "".join(f"{c:>20}" for c in cols))
for name, row in summary.items():
    print(f"{name:<16}" + "".join(f"{row.get(c, '-')!s:>20}" for c in cols))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
echo "total $(( SECONDS - START )) s; logs and metrics in $OUT"
