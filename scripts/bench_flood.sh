#!/usr/bin/env bash
# Flood benchmark (docs/BENCHMARKS.md, "Flood"): one tenant floods POST /v1/admit in a closed loop on
# many connections while a light tenant calls 20 times a second on one connection (open loop, so a
# stalled server is charged for every call that queued). Measured: the light tenant's latency idle
# and under the flood, its calls lost to overload (503) or errors, admitd's RSS idle and at its peak
# under the flood, and the longest flood call (no held admission may outlive max_wait = 100 ms).
# Both tenants release every lease (admit-release). The flood's tenant budget (1000/s, burst 100)
# makes most of its calls fast 429s and holds some for up to max_wait.
#
#   scripts/bench_flood.sh                      # build, then idle + two floods, DURATION s each
#   FLOODS="64 512" DURATION=10 scripts/bench_flood.sh
#
# Environment: DURATION [10] s per run; FLOODS ["64 512"] flood connection counts; SERVER_CPU [0],
# CLIENT_CPU [1]; PORT [19480]; OUT [target/bench-flood]; SKIP_BUILD=1 to use what is built;
# TENANT_IN_DECISION [8]: `[overload] tenant_in_decision` (0 turns the per-worker tenant gate off);
# LIGHT_PRIORITY [rt]: `rt` runs the light tenant's load generator at real-time priority (chrt -f 10;
# it needs CAP_SYS_NICE, and falls back to `normal` with a warning without it), `normal` at the
# default priority. Both load generators share the client core, and the flood's keeps it busy: at
# normal priority the light one waits for that core after each answer arrives, and its latency then
# includes the client core's scheduling delay, which says nothing of admitd.
# Output: a Markdown table on stdout and in $OUT/results.md, the runs' JSON lines in $OUT/runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
FLOODS=${FLOODS:-"64 512"}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
PORT=${PORT:-19480}
TENANT_IN_DECISION=${TENANT_IN_DECISION:-8}
LIGHT_PRIORITY=${LIGHT_PRIORITY:-rt}
OUT=${OUT:-target/bench-flood}
for tool in taskset curl jq; do
    command -v "$tool" >/dev/null || { echo "bench_flood.sh: $tool is required" >&2; exit 1; }
done
mkdir -p "$OUT"
: >"$OUT/runs.jsonl"
light_prio=()
case $LIGHT_PRIORITY in
    rt)
        if chrt -f 10 true 2>/dev/null; then
            light_prio=(chrt -f 10)
        else
            echo "bench_flood.sh: cannot use real-time priority (chrt -f 10); the light tenant runs at normal priority" >&2
            LIGHT_PRIORITY=normal
        fi
        ;;
    normal) ;;
    *) echo "bench_flood.sh: LIGHT_PRIORITY must be rt or normal, not '$LIGHT_PRIORITY'" >&2; exit 2 ;;
esac

if [[ -z ${SKIP_BUILD:-} ]]; then
    cargo build --release --bin admitd
    cargo bench --bench loadgen --no-run
fi
LOADGEN=$(ls -t target/release/deps/loadgen-* 2>/dev/null | grep -v '\.d$' | head -n 1 || true)
[[ -n $LOADGEN && -x $LOADGEN ]] || { echo "bench_flood.sh: cannot find the loadgen binary" >&2; exit 1; }

config=$(mktemp)
trap 'kill "$admitd" 2>/dev/null || true; rm -f "$config"' EXIT
cat >"$config" <<EOF
[overload]
tenant_in_decision = $TENANT_IN_DECISION
[server]
max_wait = "100ms"
[limits.subject]
rate = "100000/s"
burst = 100000
concurrency = 100000
[limits.tenant]
rate = "1000/s"
burst = 100
concurrency = 100000
EOF
ulimit -n "$(ulimit -Hn)" || true
taskset -c "$SERVER_CPU" target/release/admitd serve --config "$config" --listen "127.0.0.1:$PORT" \
    2>"$OUT/admitd.log" &
admitd=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break; sleep 0.1; done

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$admitd/status"; }

# light LABEL: the light tenant at 20 calls/s for DURATION seconds; its JSON line on stdout.
light() {
    "${light_prio[@]}" taskset -c "$CLIENT_CPU" "$LOADGEN" --url "http://127.0.0.1:$PORT" --tenant-prefix light \
        --mode admit-release --tenants 1 --subjects 20 --rate 20 --connections 1 --warmup 1 --duration "$DURATION" \
        --label "$1" --json 2>/dev/null | tee -a "$OUT/runs.jsonl"
}

idle_rss=$(rss_kib)
idle=$(light idle)
rows=()
for conns in $FLOODS; do
    peak_file=$(mktemp)
    (while kill -0 "$admitd" 2>/dev/null; do rss_kib >>"$peak_file"; sleep 0.5; done) &
    sampler=$!
    taskset -c "$CLIENT_CPU" "$LOADGEN" --url "http://127.0.0.1:$PORT" --tenant-prefix flood \
        --mode admit-release --tenants 1 --connections "$conns" --warmup 1 --duration $((DURATION + 2)) \
        --label "flood-$conns" --json 2>/dev/null >"$OUT/flood-$conns.json" &
    flood=$!
    sleep 1
    under=$(light "light-under-$conns")
    wait "$flood"
    kill "$sampler" 2>/dev/null || true
    cat "$OUT/flood-$conns.json" >>"$OUT/runs.jsonl"
    peak=$(sort -n "$peak_file" | tail -n 1)
    rm -f "$peak_file"
    f=$(cat "$OUT/flood-$conns.json")
    rows+=("| $conns | $(jq -r '.rps | floor' <<<"$f") | $(jq -r '.shed_429' <<<"$f") | $(jq -r '.latency.max_us / 1000 | . * 10 | round / 10' <<<"$f") | $(jq -r '.latency.p99_us / 1000 | . * 100 | round / 100' <<<"$under") | $(jq -r '.other_status + .errors' <<<"$under") | $((peak / 1024)) |")
    sleep 1
done

{
    echo "light tenant's load generator at $LIGHT_PRIORITY priority"
    echo "light tenant idle: p50 $(jq -r '.latency.p50_us / 10 | round / 100' <<<"$idle") ms, p99 $(jq -r '.latency.p99_us / 10 | round / 100' <<<"$idle") ms, $(jq -r '.requests' <<<"$idle") calls, $(jq -r '.other_status + .errors' <<<"$idle") lost; admitd RSS idle $((idle_rss / 1024)) MiB"
    echo
    echo "| flood connections | flood calls/s | flood 429s | longest flood call (ms) | light p99 (ms) | light calls lost (503/error) | peak RSS (MiB) |"
    echo "|---|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} | tee "$OUT/results.md"
