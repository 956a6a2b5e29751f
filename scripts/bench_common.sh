# Sourced by the benchmark scripts (bench.sh, bench_store.sh): a scratch directory and the processes
# the script starts, all stopped and removed when it exits, however it exits.
#
# Sets $work (a temporary directory) and the array $started: append the pid of every process started.

work=$(mktemp -d)
started=()

stop() { # stop one process this script started, by pid
    local pid=$1
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}
cleanup() {
    for pid in "${started[@]}"; do stop "$pid"; done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
