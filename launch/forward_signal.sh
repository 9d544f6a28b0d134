#!/usr/bin/env bash
# Sends a signal (default USR1) to the training workers on this machine: the torchtitan_ext processes that
# are children of a torchrun agent (`python -m torchtitan_ext.launch`, as launch/train.sh starts it, or
# `python -m torch.distributed.run ... torchtitan_ext...`) of this user; with SLURM_JOB_ID set, of that Slurm
# job only (the agent's environment names it), else every such agent of the user. The agent itself is left
# alone: a plain torchrun agent dies of USR1, and its own forwarding (--signals-to-handle) kills the workers
# after --shutdown-timeout and exits non-zero even when they saved. The workers finish the step in flight, save a checkpoint and exit 0, and
# torchrun then exits 0. launch/slurm.sbatch runs this on every node (srun --overlap); it prints one line per
# machine and exits 0 when no worker runs (the job may be between restarts).
#   launch/forward_signal.sh [SIGNAL]
set -euo pipefail
sig="${1:-USR1}"
me="$(id -u)"
# [-] and [.]: the pattern does not match its own text in a command line that carries it
agents="$(pgrep -u "$me" -d, -f '[-]m torchtitan_ext[.]launch|[-]m torch[.]distributed[.]run .*torchtitan_ext|/torchrun .*torchtitan_ext' || true)"
if [ -n "${SLURM_JOB_ID:-}" ]; then  # this job's agents only (their environment names the job)
    mine=""
    for pid in ${agents//,/ }; do
        if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$SLURM_JOB_ID"; then
            mine="${mine:+$mine,}$pid"
        fi
    done
    agents="$mine"
fi
workers=""
[ -z "$agents" ] || workers="$(pgrep -u "$me" -d' ' -P "$agents" -f 'torchtitan_ext' || true)"
if [ -z "$workers" ]; then
    echo "forward_signal: no torchtitan_ext worker under torchrun on $(hostname); nothing sent"
    exit 0
fi
# shellcheck disable=SC2086  # one argument per pid
kill -s "$sig" $workers
echo "forward_signal: SIG${sig#SIG} sent to $(wc -w <<< "$workers") workers on $(hostname): $workers"
