# Sourced by the benchmark scripts. run_job NAME LIMIT_S CMD...: run CMD (a trainer command without its
# dump folder) into $OUT/NAME, log to $OUT/NAME.log, append the folder to the array `runs`, print the exit
# code and wall time, and on failure the log's error lines. budget NAME: for scripts with a DEADLINE (seconds
# since T_START), RUN_LIMIT and SUMMARY: set LIMIT to the seconds left, at most RUN_LIMIT; false, with a JSON
# line in SUMMARY, when under 60 s are left (a run is not started then).
run_job() {
    local name=$1 limit=$2; shift 2
    runs+=("$OUT/$name")
    rm -rf "${OUT:?}/$name"
    local t0=$SECONDS
    timeout "$limit" "$@" --job.dump_folder "$OUT/$name" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "run $name: exit $rc after $((SECONDS - t0)) s"
    if [ $rc != 0 ]; then grep -v "^\s*$" "$OUT/$name.log" | grep -iE "error|exception|unsupported" | tail -n 8; fi
}
budget() {
    local left=$(( DEADLINE - (SECONDS - T_START) ))
    if [ "$left" -lt 60 ]; then
        echo "{\"run\": \"$1\", \"error\": \"skipped: $left s left of DEADLINE=$DEADLINE\"}" | tee -a "$SUMMARY"
        return 1
    fi
    LIMIT=$(( RUN_LIMIT < left ? RUN_LIMIT : left ))
}
