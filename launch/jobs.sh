# Sourced by the quickstarts: independent runs side by side. A quickstart's model is small, and its second thread
# buys little: a digits student ran 360 cycles in 250 s on 2 threads and in 357 s on 1 beside another run. So two
# runs on one thread each end sooner than the same two one after the other on two threads. Results do not depend
# on the thread count (the same seed gives the same samples bit for bit).
#   jobs_init        reads NPROC and JOBS (runs at once; default the cores, at most 4; 1 when NPROC > 1: each
#                    torchrun spreads over the cores itself); each run gets OMP_NUM_THREADS = cores / JOBS; logs go
#                    to $RUN_DIR/logs. Prints the choice.
#   job NAME CMD...  runs CMD (a command or a function) once a slot is free: with JOBS > 1 in the background, its
#                    lines prefixed "[NAME] " and kept in $RUN_DIR/logs/NAME.log; with JOBS = 1 in the foreground,
#                    as a plain command. Either way it ends with "[NAME] done in Ns".
#   jobs_wait        waits for every job.
# A job that fails stops the script: the others are killed, and the message names the job, its exit status and
# its log, with the log's last lines.

jobs_init() {
    local cores
    cores=$(nproc)
    if [ "${NPROC:-1}" -gt 1 ]; then
        JOBS=1
    fi
    JOBS="${JOBS:-$((cores < 4 ? cores : 4))}"
    if ! [[ "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: JOBS must be a positive integer (runs at once), got '$JOBS'" >&2
        exit 2
    fi
    JOB_THREADS=$((cores / JOBS > 0 ? cores / JOBS : 1))
    JOB_LOGS="$RUN_DIR/logs"
    mkdir -p "$JOB_LOGS"
    _JOB_PIDS=()
    _JOB_NAMES=()
    if [ "$JOBS" -gt 1 ]; then
        echo "> independent runs: $JOBS at once, $JOB_THREADS thread(s) each ($cores cores; JOBS=1: one at a time)"
    fi
}

job() {
    local name=$1 start=$SECONDS
    shift
    if [ "$JOBS" -eq 1 ]; then
        "$@"
        echo "[$name] done in $((SECONDS - start))s"
        return
    fi
    while [ "${#_JOB_PIDS[@]}" -ge "$JOBS" ]; do
        _job_reap
    done
    (
        set +e
        start=$SECONDS  # from its start, not from its turn in the queue
        export OMP_NUM_THREADS="$JOB_THREADS"
        # errexit inside, as in the foreground: a function's failed step ends the job with its status
        (set -e; "$@") 2>&1 | tee "$JOB_LOGS/$name.log" | sed -u "s/^/[$name] /"
        rc=${PIPESTATUS[0]}
        [ "$rc" -eq 0 ] && echo "[$name] done in $((SECONDS - start))s"
        exit "$rc"
    ) &
    _JOB_PIDS+=("$!")
    _JOB_NAMES+=("$name")
}

jobs_wait() {
    while [ "${#_JOB_PIDS[@]}" -gt 0 ]; do
        _job_reap
    done
}

# waits until one job has ended and takes it off the list; a failed one stops the script
_job_reap() {
    local i rc
    while :; do
        for i in "${!_JOB_PIDS[@]}"; do
            if ! kill -0 "${_JOB_PIDS[$i]}" 2>/dev/null; then
                rc=0
                wait "${_JOB_PIDS[$i]}" || rc=$?
                if [ "$rc" -ne 0 ]; then
                    _job_fail "${_JOB_NAMES[$i]}" "$rc"
                fi
                unset "_JOB_PIDS[$i]" "_JOB_NAMES[$i]"
                _JOB_PIDS=("${_JOB_PIDS[@]}")
                _JOB_NAMES=("${_JOB_NAMES[@]}")
                return
            fi
        done
        sleep 1
    done
}

_job_fail() {
    local name=$1 rc=$2 pid
    for pid in "${_JOB_PIDS[@]}"; do
        _kill_tree "$pid"
    done
    echo "error: run '$name' failed (exit $rc); the other runs were stopped." \
        "Its log: $JOB_LOGS/$name.log; last lines:" >&2
    tail -n 20 "$JOB_LOGS/$name.log" >&2
    exit 1
}

# stops a job and everything it started. The whole tree is listed first and frozen (SIGSTOP) before any of it is
# killed: killing the leaves first let a parent shell run its next command ('sleep 40; touch done' touched) in the
# moment between its child's death and its own.
_kill_tree() {
    local pids
    pids=$(_tree_pids "$1")
    kill -STOP $pids 2>/dev/null || true
    kill -TERM $pids 2>/dev/null || true
    kill -CONT $pids 2>/dev/null || true
}

# the pid and all its descendants, parents before children
_tree_pids() {
    local child
    echo "$1"
    for child in $(pgrep -P "$1" 2>/dev/null); do
        _tree_pids "$child"
    done
}
