#!/usr/bin/env bash
# Sourced at the start of a call on a lent GPU machine, from a `git archive` copy of the repository one level
# below the carried wheels (WHEELS, default ../.whl): installs torchao (float8) and py-spy (the multigpu tier's
# stacks of a hung job) into /tmp/site, puts them on PYTHONPATH / PATH, keeps NVLink multicast off, and checks
# that python3 has what launch/test.sh needs (else the script would try to build a virtual environment from
# the package index, which the machine cannot reach): a missing package is one line and a non-zero status.
# Usage: source benchmarks/device_prelude.sh   (env WHEELS: the carried wheels' folder)
case ${1:-} in -h|--help) sed -n '2,7p' "${BASH_SOURCE[0]}"; return 0 2>/dev/null || exit 0 ;; esac
WHEELS=${WHEELS:-../.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/torchao-*.whl "$WHEELS"/py_spy-*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0
if ! missing=$(python3 -c "import torch, numpy, sentencepiece, tensorboard, pytest, triton, torchao" 2>&1); then
    echo "device_prelude: python3 lacks a package launch/test.sh needs: ${missing##*$'\n'}" >&2
    return 1 2>/dev/null || exit 1
fi
