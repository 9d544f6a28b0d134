#!/usr/bin/env bash
# One GPU (issue 13): FlexAttention masks against the dense path, then tokens/s and memory of the compiled
# 1b shape with causal SDPA, FlexAttention with a causal mask, and document masking (mean document length
# 512), at seq 2048 (16 layers) and seq 8192 (4 layers); then the loss of a small model after 300 steps with
# attention Z-reg on and off. Usage on the GPU machine, from the repository root:
#   benchmarks/bench_attention.sh [OUT_DIR]          (about 5 minutes)
set -uo pipefail
OUT="${1:-${OUT:-/tmp/bench_attention}}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 120 python3 benchmarks/micro/attention.py check 2>&1 | grep -E "^check|Error" | tail -5
timeout 200 python3 benchmarks/micro/attention.py speed 2048 16 4 2>&1 | grep -vi warn | tail -4
timeout 150 python3 benchmarks/micro/attention.py speed 8192 4 1 2>&1 | grep -vi warn | tail -4
zreg() {
    local name=$1; shift
    timeout 200 python3 -m torchtitan_ext.train --model.flavor debug --data.tokenizer byte --training.seq_len 512 \
        --training.local_batch_size 16 --training.steps 300 --training.compile true --checkpoint.enabled false \
        --eval.steps 0 --metrics.log_freq 50 --metrics.tensorboard false --optimizer.lr 3e-3 \
        --job.dump_folder "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 || { echo "run $name failed"; tail -n 5 "$OUT/$name.log"; }
    python3 - "$OUT/$name/metrics.jsonl" "$name" <<'PY'
import json, sys
rec = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line][-1]
lse = [v for k, v in rec.items() if k.startswith("attn/lse/")]
print(f"{sys.argv[2]:10s} step {rec['step']} loss {rec['loss']:.4f} mean attention LSE {sum(lse) / len(lse):.3f} "
      f"tokens/s {rec['tokens_per_sec']:,.0f}")
PY
}
zreg zreg_off
zreg zreg_on --training.attention_z_reg 1e-2
