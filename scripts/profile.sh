#!/usr/bin/env bash
# Profiles admitd (or the floor) under closed-loop load and prints where its CPU time per request goes,
# by phase (scripts/phases.py). Needs `perf` (Debian package linux-perf) and a release build.
#
#   scripts/profile.sh NAME [loadgen args...]
#   scripts/profile.sh one --tenants 1 --subjects 1
#   scripts/profile.sh spread --tenants 1000 --subjects 100
#   scripts/phases.py target/profile/one.txt CPU1 target/profile/spread.txt CPU2   # side by side
#
# Environment: CONFIG [benches/throughput.toml, the benchmark's generous limits], SERVER=floor to
# profile the floor instead, SECS [5] recorded seconds, FREQ [1999] samples per second, OUT [target/profile], SERVER_CPU [0],
# CLIENT_CPU [1], PORT [19480].

set -euo pipefail
cd "$(dirname "$0")/.."

NAME=${1:?usage: scripts/profile.sh NAME [loadgen args...]}
shift
SECS=${SECS:-5}
FREQ=${FREQ:-1999}
OUT=${OUT:-target/profile}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
PORT=${PORT:-19480}
CLK_TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)

for tool in perf taskset curl jq python3; do
    command -v "$tool" >/dev/null || { echo "profile.sh: $tool is required" >&2; exit 1; }
done
LOADGEN=$(ls -t target/release/deps/loadgen-* 2>/dev/null | grep -v '\.d$' | head -n 1 || true)
[[ -x target/release/admitd && -n $LOADGEN ]] ||
    { echo "profile.sh: build first: cargo build --release && cargo bench --bench loadgen --no-run" >&2; exit 1; }
mkdir -p "$OUT"

config=${CONFIG:-benches/throughput.toml}
server_pid=""
trap '[[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null; true' EXIT

if [[ ${SERVER:-admitd} == floor ]]; then
    taskset -c "$SERVER_CPU" "$LOADGEN" --floor-only "$PORT" --lifetime 600 >/dev/null 2>&1 &
    path=/floor
else
    taskset -c "$SERVER_CPU" target/release/admitd serve --listen "127.0.0.1:$PORT" --config "$config" \
        >"$OUT/$NAME.log" 2>&1 &
    path=/healthz
fi
server_pid=$!
for _ in $(seq 50); do
    curl -s -o /dev/null --max-time 1 -H 'Content-Type: application/json' \
        -d '{"tenant":"t0","subject":"s0","tool":"tool0"}' "http://127.0.0.1:$PORT$path" && break
    sleep 0.1
done

# The recording lies inside the load's measured window (from 2 s to SECS + 4 s), after its warm-up, so
# perf sees only steady state and the CPU per request it is scaled by covers the same load.
taskset -c "$CLIENT_CPU" "$LOADGEN" --url "http://127.0.0.1:$PORT" --server-pid "$server_pid" \
    --clk-tck "$CLK_TCK" --connections 64 --warmup 2 --duration $((SECS + 2)) --json "$@" \
    >"$OUT/$NAME.json" 2>/dev/null &
load_pid=$!
sleep 2.5
perf record -q -F "$FREQ" --call-graph dwarf,16384 -p "$server_pid" -o "$OUT/$NAME.perf" -- sleep "$SECS" \
    >/dev/null 2>&1
wait "$load_pid"
perf script -i "$OUT/$NAME.perf" -F tid,ip,sym 2>/dev/null >"$OUT/$NAME.txt"

cpu=$(jq -r '.server_cpu_us_per_req' "$OUT/$NAME.json")
echo "$NAME: $(jq -r '"\(.rps) req/s, \(.server_cpu_us_per_req) us CPU per request, steal \(.steal_ms) ms"' "$OUT/$NAME.json")"
scripts/phases.py "$OUT/$NAME.txt" "$cpu"
