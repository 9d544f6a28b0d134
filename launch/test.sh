#!/usr/bin/env bash
# Runs the test suite (CPU; GPU tests are skipped without CUDA). Extra arguments go to pytest.
set -euo pipefail
NEEDS="torch, numpy, sentencepiece, tensorboard, pytest" source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$REPO"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m pytest -q "$@"
