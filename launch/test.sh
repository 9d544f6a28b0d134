#!/usr/bin/env bash
# Runs the test suite (CPU; GPU tests are skipped without CUDA). Extra arguments go to pytest.
#   launch/test.sh                 the CI tier: everything but the `slow` tier (convergence comparisons)
#   launch/test.sh --all           every tier, `slow` included
#   launch/test.sh -m multigpu     the NCCL tests, on a machine with 2+ GPUs, in one pytest process (any -m
#                                  replaces the default)
# An existing python3 is used only if it also has triton and torchao: otherwise the Triton-interpreter and
# float8 tests would skip silently, so the virtual environment (its dev extra pins both) is used instead.
set -euo pipefail
NEEDS="torch, numpy, sentencepiece, tensorboard, pytest, triton, torchao" source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$REPO"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers (pytest-xdist, in the dev extra), one test file each at a time: on the 2-core CI machine the
# suite's single-process tests and process start-ups overlap. TEST_WORKERS=0 runs it in one process.
case "${TEST_WORKERS:-2}" in
    *[!0-9]*) echo "error: TEST_WORKERS='$TEST_WORKERS': expected a number of workers (0: one process)" >&2; exit 2 ;;
esac
workers=()
if [ "${TEST_WORKERS:-2}" != 0 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
    workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)
fi
tier=(-m "not slow")
args=()
for arg in "$@"; do
    case "$arg" in
        --all) tier=() ;;
        -m|-m=*) tier=(); args+=("$arg") ;;
        # one process: its JobPool shares the GPUs among all jobs, each with its own deadline (a test may wait
        # for its job longer than the CI tier's per-test limit)
        multigpu*) args+=("$arg" --timeout=0); workers=() ;;
        *) args+=("$arg") ;;
    esac
done
exec "$PY" -m pytest -q "${workers[@]}" "${tier[@]}" "${args[@]}"
