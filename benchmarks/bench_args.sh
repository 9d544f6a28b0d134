# Sourced first by bench_mode_scale.sh and bench_mode_235b.sh (their own positional arguments): sets SMOKE from
# --smoke (and shifts it off), prints the calling script's header for -h / --help and exits 0, and refuses any
# other option in one line with exit 2. What remains in $1 is OUT_DIR, if given.
SMOKE=0
case ${1:-} in
    -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --smoke) SMOKE=1; shift ;;
    -*) echo "error: unknown argument '$1' (--smoke, --help; OUT_DIR as the argument or in the environment)" >&2
        exit 2 ;;
esac
