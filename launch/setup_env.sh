#!/usr/bin/env bash
# Finds or builds a Python environment for the project; sourced by train.sh and test.sh, it leaves PY
# pointing at the interpreter to use. If `python3` already has torch and the project's dependencies
# (a GPU image, the Docker image), it is used as it is, with the repository on PYTHONPATH. Otherwise the
# virtual environment .venv is created or reused, TORCH_SPEC (default torch==2.13.0; several words allowed)
# from TORCH_INDEX_URL when set (CPU wheels: https://download.pytorch.org/whl/cpu, CUDA 12.8:
# https://download.pytorch.org/whl/cu128) and the package (editable, with the dev extra) are installed into it.
# The build holds a lock (flock on $VENV.lock), so nodes sharing the checkout (Slurm) build it once: the
# others wait, then reuse it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
NEEDS="${NEEDS:-torch, numpy, sentencepiece, tensorboard}"
if [ ! -x "$VENV/bin/python" ] && "$PYTHON" -c "import $NEEDS" >/dev/null 2>&1; then
    PY="$(command -v "$PYTHON")"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    exec 9>"$VENV.lock"
    if command -v flock >/dev/null && ! flock -n 9; then
        echo "setup_env: another process is building $VENV; waiting for it" >&2
        flock 9
    fi
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    PY="$VENV/bin/python"
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        read -r -a torch_spec <<< "${TORCH_SPEC:-torch==2.13.0}"
        "$PY" -m pip install -q "${torch_spec[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    stamp="$VENV/.installed-$(cksum < "$REPO/pyproject.toml" | cut -d' ' -f1)"
    if [ ! -f "$stamp" ]; then
        "$PY" -m pip install -q -e "$REPO[dev]"
        touch "$stamp"
    fi
    exec 9>&-  # the lock goes with the descriptor
fi
export PY REPO
