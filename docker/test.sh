#!/usr/bin/env bash
# Proves docker/Dockerfile and docker/run.sh on a Debian machine with root and no Docker engine or registry:
# installs podman, runc and mmdebstrap from Debian, makes a bookworm base (Python in a virtual environment on
# PATH, gcc, g++), builds docker/Dockerfile on it as a CPU image, then inside it runs --help, the default job
# for a few steps, a second run through docker/run.sh that resumes from the mounted outputs as the caller,
# and a small fixed test subset. One line and exit 1 on the first failure; each step's time and the image
# size are printed. Not for CI's time budget: run it before a stop that touches docker/, launch/,
# pyproject.toml or the package's dependencies.
#   docker/test.sh
# TORCH_VERSION (default 2.13.0, CI's) and TORCH_INDEX_URL (default: a local index of pip's find-links
# wheel torch-$TORCH_VERSION+cpu when the host has one, else empty: PyPI) pick the image's torch; WORK
# (default /var/tmp/torchtitan_ext-docker-test) holds the base, the logs and the mounted outputs.
# Host quirks are handled by configuration only: a containers.conf (CONTAINERS_CONF) with runc (crun refuses
# a hybrid cgroup layout) and default_ulimits the host allows; the host's CA bundle is mounted into the
# build (where a network intercepts TLS), never copied into the image.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-/var/tmp/torchtitan_ext-docker-test}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
IMAGE=localhost/torchtitan_ext:cpu-smoke
BASE=localhost/torchtitan_ext-base:bookworm
LOG="$WORK/test.log"
STEPS=4
start=$SECONDS

if [ "$(id -u)" != 0 ]; then
    echo "docker/test.sh: needs root (it installs podman, runc and mmdebstrap with apt-get)" >&2
    exit 2
fi
mkdir -p "$WORK"
: > "$LOG"
step() {
    local what="$1"
    shift
    local t0=$SECONDS
    if ! "$@" >>"$LOG" 2>&1; then
        echo "docker/test.sh: FAILED at '$what' after $((SECONDS - start)) s (log: $LOG)" >&2
        exit 1
    fi
    printf 'docker/test.sh: %-58s %4d s\n' "$what" $((SECONDS - t0))
}

install_tools() {
    dpkg -s podman runc mmdebstrap >/dev/null 2>&1 && return
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends podman runc mmdebstrap
}

# The container's process limit: this shell's hard limit, but not above the kernel's pid_max (such hosts
# refuse a larger RLIMIT_NPROC to runc).
pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
nproc_limit=$(ulimit -Hu)
if [ "$nproc_limit" = unlimited ] || [ "$nproc_limit" -gt "$pid_max" ]; then nproc_limit=$pid_max; fi
cat > "$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$nproc_limit:$nproc_limit"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

make_base() {
    rm -f "$WORK/base.tar"
    mmdebstrap --variant=apt --include=python3,python3-venv,python3-pip,python3-dev,gcc,g++,git,ca-certificates,passwd \
        --customize-hook='chroot "$1" python3 -m venv /opt/venv' bookworm "$WORK/base.tar"
    podman import --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        "$WORK/base.tar" "$BASE"
    rm -f "$WORK/base.tar"
}

# pip's find-links folder on the host may hold a CPU torch wheel: a one-package index of it is mounted into
# the build and given as the extra index that pip prefers for torch.
build_args=(--build-arg "BASE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "COMPILERS=gcc g++")
volumes=()
if [ -z "${TORCH_INDEX_URL+x}" ]; then
    TORCH_INDEX_URL=""
    links="${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}"
    wheel="$(ls "$links"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl 2>/dev/null | head -n 1 || true)"
    if [ -n "$links" ] && [ -n "$wheel" ]; then
        mkdir -p "$WORK/torch-index/torch"
        printf '<a href="%s">%s</a>\n' "$(basename "$wheel")" "$(basename "$wheel")" > "$WORK/torch-index/torch/index.html"
        ln -f "$wheel" "$WORK/torch-index/torch/" 2>/dev/null || cp "$wheel" "$WORK/torch-index/torch/"
        volumes+=(--volume "$WORK/torch-index:/torch-index:ro")
        TORCH_INDEX_URL=file:///torch-index
    fi
fi
build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    volumes+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi

build() {
    podman build --network=host "${build_args[@]}" "${volumes[@]}" -f "$REPO/docker/Dockerfile" -t "$IMAGE" "$REPO"
}

outputs="$WORK/outputs"
in_image() { podman run --rm --network=host "$IMAGE" "$@"; }
first_run() {
    rm -rf "$outputs" "$WORK/cache"
    mkdir -p "$outputs" && chown 1000:1000 "$outputs"
    podman run --rm --network=host -v "$outputs:/workspace/torchtitan_ext/outputs" "$IMAGE" \
        launch/train.sh --training.steps "$STEPS" --checkpoint.interval "$STEPS" --metrics.log_freq 1
    [ "$(stat -c %u "$outputs/debug/checkpoint/step-$STEPS")" = 1000 ]  # the image's own user
}
resume_run() {
    (cd "$WORK" && DOCKER=podman IMAGE="$IMAGE" GPUS=none OUTPUTS="$outputs" CACHE="$WORK/cache" \
        "$REPO/docker/run.sh" launch/train.sh --training.steps $((2 * STEPS)) --checkpoint.interval "$STEPS" \
        --metrics.log_freq 1) > "$WORK/resume.log" 2>&1 || { cat "$WORK/resume.log"; return 1; }
    cat "$WORK/resume.log"
    grep -q "resumed from .*/step-$STEPS" "$WORK/resume.log"
    [ "$(stat -c %u "$outputs/debug/checkpoint/step-$((2 * STEPS))")" = "$(id -u)" ]  # run.sh's --user: the caller
}
unit_tests() {
    in_image python -m pytest -q -p no:cacheprovider tests/unit/test_docs_commands.py \
        tests/unit/quant/test_float8_experts.py::test_float8_mode_layer_compiles_to_one_graph \
        tests/unit/train/test_lr_schedule_and_spike_guard.py
}

step "install podman, runc, mmdebstrap (Debian)" install_tools
step "make the bookworm base ($BASE)" make_base
step "build docker/Dockerfile (torch $TORCH_VERSION, CPU)" build
step "python -m torchtitan_ext.train --help" in_image python -m torchtitan_ext.train --help
step "default job, $STEPS steps, as the image's user (uid 1000)" first_run
step "docker/run.sh resumes to step $((2 * STEPS)) as uid $(id -u)" resume_run
step "tests in the image" unit_tests
size="$(podman image inspect --format '{{.Size}}' "$IMAGE")"
echo "docker/test.sh: passed in $((SECONDS - start)) s; image $IMAGE: $((size / 1000000)) MB"
