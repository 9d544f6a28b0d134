#!/usr/bin/env bash
# Two "nodes" on one host: two torchrun agents started exactly as launch/train.sh starts them on two real
# nodes (NNODES=2, a c10d rendezvous on MASTER_ADDR=127.0.0.1), each with its own GPUs and its own
# NCCL_HOSTID, so NCCL takes them for two hosts: inside an agent the GPUs talk over NVLink (P2P), between
# the agents over the network transport (NET/Socket, InfiniBand off). NCCL_DEBUG=INFO goes to each agent's
# log; after the job the script checks that some channels run `via NET/Socket` (only inter-agent links can:
# the host ids differ) and, on GPUs, some `via P2P` (intra-agent), and fails with one line if not.
#
# Usage (repository root):  benchmarks/two_nodes.sh [OPTIONS] [--] TRAINER_ARGS...
#   --cpu           2 gloo processes per agent on CPU (no NCCL, no transport check): tests the script here
#   --no-hostid     no NCCL_HOSTID: NCCL sees one host (all NVLink); then no channel may go `via NET`
#   --logs DIR      where agent-a.log / agent-b.log go (default: a new folder under /tmp)
#   env: NPROC_PER_NODE (2), GPUS_A (0,1), GPUS_B (2,3), MASTER_PORT (a free port), MAX_RESTARTS (0),
#        NCCL_IB_DISABLE (1), GRACE_S (30: how long the other agent may run on after one fails), any
#        NCCL_* / trainer environment passes through.
# Exit code: the first failing agent's, 4 when the transport check fails, 2 on bad usage.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CPU=0 HOSTID=1 LOGS=""
while (( $# )); do
    case $1 in
        --cpu) CPU=1 ;;
        --no-hostid) HOSTID=0 ;;
        --logs) LOGS=${2:?--logs needs a folder}; shift ;;
        --) shift; break ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) break ;;
    esac
    shift
done
LOGS=${LOGS:-$(mktemp -d /tmp/two_nodes.XXXXXX)}
mkdir -p "$LOGS"
PORT=${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export NNODES=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT RDZV_ID="two_nodes-$$" NPROC_PER_NODE=${NPROC_PER_NODE:-2} \
    MAX_RESTARTS=${MAX_RESTARTS:-0} PYTHONUNBUFFERED=1
if (( CPU )); then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    export NCCL_DEBUG=INFO NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
fi

agent() {  # agent NAME GPUS: one torchrun agent in the background, its pid in $!
    local name=$1 gpus=$2
    shift 2
    (
        if (( CPU )); then export CUDA_VISIBLE_DEVICES=""; else export CUDA_VISIBLE_DEVICES=$gpus; fi
        if (( HOSTID )) && (( ! CPU )); then export NCCL_HOSTID="two_nodes-$name"; fi
        exec bash "$REPO/launch/train.sh" "$@"
    ) > "$LOGS/agent-$name.log" 2>&1 &
}
agent a "${GPUS_A:-0,1}" "$@"
pid_a=$!
agent b "${GPUS_B:-2,3}" "$@"
pid_b=$!
# When one agent fails, the other may wait in the rendezvous or a collective: stop it after a grace period.
while kill -0 "$pid_a" 2>/dev/null && kill -0 "$pid_b" 2>/dev/null; do sleep 1; done
if kill -0 "$pid_a" 2>/dev/null; then wait "$pid_b"; rc_b=$?; first=b; else wait "$pid_a"; rc_a=$?; first=a; fi
rc_first=rc_$first
if (( ${!rc_first} != 0 )); then
    for (( i = 0; i < ${GRACE_S:-30}; i++ )); do
        kill -0 "$pid_a" 2>/dev/null || kill -0 "$pid_b" 2>/dev/null || break
        sleep 1
    done
    kill -TERM "$pid_a" "$pid_b" 2>/dev/null
fi
if [ "$first" = a ]; then wait "$pid_b"; rc_b=$?; else wait "$pid_a"; rc_a=$?; fi
for n in a b; do
    rc_var=rc_$n
    if (( ${!rc_var} != 0 )); then
        echo "two_nodes: agent $n exited ${!rc_var}: $(grep -iE 'error|exception' "$LOGS/agent-$n.log" | tail -n 1 | cut -c1-300) (log: $LOGS/agent-$n.log)"
        exit "${!rc_var}"
    fi
done
(( CPU )) && { echo "two_nodes: both agents done (gloo on CPU, no transport check); logs in $LOGS"; exit 0; }

net=$(cat "$LOGS"/agent-*.log | grep -c ' via NET/' || true)
socket=$(cat "$LOGS"/agent-*.log | grep -c ' via NET/Socket' || true)
p2p=$(cat "$LOGS"/agent-*.log | grep -c ' via P2P' || true)
if (( HOSTID )); then
    if (( socket == 0 )); then
        other=$(cat "$LOGS"/agent-*.log | grep -oE ' via [A-Za-z/]+' | sort | uniq -c | tr -s ' \n' ' ')
        echo "two_nodes: no channel via NET/Socket between the agents in the NCCL log (seen:${other:- none}); logs in $LOGS"
        exit 4
    fi
    if (( p2p == 0 )); then
        echo "two_nodes: no intra-agent channel via P2P in the NCCL log (NVLink not used inside an agent); logs in $LOGS"
        exit 4
    fi
    echo "two_nodes: transport ok: $socket channel lines via NET/Socket (between agents), $p2p via P2P (inside each); logs in $LOGS"
else
    if (( net > 0 )); then
        echo "two_nodes: $net channel lines via NET although both agents share a host id; logs in $LOGS"
        exit 4
    fi
    echo "two_nodes: transport ok: one host, $p2p channel lines via P2P, none via NET; logs in $LOGS"
fi
