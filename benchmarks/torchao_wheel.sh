# Sourced by the benchmark scripts: `use_torchao_wheel NAME [OPTIONAL]` installs the torchao wheel carried in
# .whl/ (the GPU machine has no package index) into /tmp/site and puts it on PYTHONPATH, with $PY (python3).
# Without a wheel it fails with one line naming the script, unless OPTIONAL is 1 (CPU smoke runs).
use_torchao_wheel() {
    local name=$1 optional=${2:-0} wheels
    shopt -s nullglob
    wheels=(.whl/torchao-*.whl)
    if (( ${#wheels[@]} )); then
        "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" \
            || { echo "$name: installing ${wheels[*]} failed"; return 1; }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    elif (( ! optional )); then
        echo "$name: no torchao wheel in .whl/ (expected .whl/torchao-0.17.0-cp310-abi3-manylinux_2_24_x86_64."
        echo "  manylinux_2_28_x86_64.whl); carry it to the GPU machine, or pip install torchao where an index is"
        echo "  reachable"
        return 1
    fi
}
