#!/usr/bin/env bash
# Shared-store benchmark (docs/BENCHMARKS.md, "Shared store (Redis)"): admitd on `[store] kind =
# "redis"` next to the default memory store in the same run, on the same load: 64 connections, closed
# loop, keys spread over loadgen's 1 000 tenants x 100 subjects x 8 tools, the generous limits of
# benches/throughput.toml (nothing is shed). For every Redis run it also reads Redis's
# `INFO commandstats` and CPU time around the measured window: store round trips (EVALSHA calls) and
# the commands the script runs inside Redis, per admission, and Redis's CPU per admission.
#
# Layout, as scripts/bench.sh and the reference measurement of Limitador ("server and Redis on one
# core, the load generator on the other"): admitd and redis-server pinned to SERVER_CPU, the load
# generator to CLIENT_CPU. One redis-server, started here on a free loopback port without persistence
# (`--save "" --appendonly no`), emptied (FLUSHALL) before each Redis run; each run gets a fresh admitd.
# Memory and Redis runs alternate (which goes first swaps every round), for admit-only and admit +
# release, so slow drift of the machine hits both alike.
#
#   scripts/bench_store.sh                           # build, then ROUNDS rounds (about 4 minutes)
#   SKIP_BUILD=1 ROUNDS=2 DURATION=10 scripts/bench_store.sh
#   STORES=redis MODES=admit ROUNDS=1 SKIP_BUILD=1 scripts/bench_store.sh   # one Redis run
#
# Environment (defaults in brackets): DURATION [10] measured seconds per run, after WARMUP [2] seconds
# of the same load (a run of its own, so that the measured run's requests are exactly what the
# counters around it saw); ROUNDS [3]; CONNECTIONS [64]; MODES ["admit admit-release"];
# STORES ["memory redis"]; SERVER_CPU [0], CLIENT_CPU [1]; REDIS_CPU [SERVER_CPU] (the load generator's
# core instead shows what Redis sharing admitd's core costs admitd); RATE [closed loop] requests/s in
# total, open loop, for both stores alike (CPU per request falls as load rises, since wake-ups and
# reads carry more requests each: at one rate below Redis mode's saturation the two stores' CPU per
# request compare at the same load); PORT [19490] for admitd; REDIS_PORT [the
# first free port from 19491]; OUT [target/bench-store]; SKIP_BUILD=1 to use what is built; ADMITD
# [target/release/admitd] (another build, e.g. to compare two versions of src/store/admitd.lua, which
# is compiled into the binary).
# Output: a Markdown table on stdout and in $OUT/results.md, one JSON line per run in
# $OUT/results.jsonl (loadgen's report plus `store` and, for Redis runs, `redis`: the deltas of every
# command's calls and microseconds, and Redis's CPU ticks), admitd's log in $OUT/admitd.log, Redis's
# in $OUT/redis.log.

set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
MODES=${MODES:-"admit admit-release"}
STORES=${STORES:-"memory redis"}
SERVER_CPU=${SERVER_CPU:-0}
REDIS_CPU=${REDIS_CPU:-$SERVER_CPU}
CLIENT_CPU=${CLIENT_CPU:-1}
PORT=${PORT:-19490}
OUT=${OUT:-target/bench-store}
CLK_TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)

for tool in taskset curl jq redis-server redis-cli; do
    command -v "$tool" >/dev/null || {
        echo "bench_store.sh: $tool is required (redis-server and redis-cli: Debian package redis-server)" >&2
        exit 1
    }
done

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd) # absolute: Redis is told where to log from its own directory
# $work, $started, stop and the exit traps.
source scripts/bench_common.sh

# ---- build ----------------------------------------------------------------------------------------

if [[ -z ${SKIP_BUILD:-} ]]; then
    cargo build --release --bin admitd
    cargo bench --bench loadgen --no-run
fi
LOADGEN=$(ls -t target/release/deps/loadgen-* 2>/dev/null | grep -v '\.d$' | head -n 1 || true)
[[ -n $LOADGEN && -x $LOADGEN ]] || { echo "bench_store.sh: cannot find the loadgen binary" >&2; exit 1; }
ADMITD=${ADMITD:-target/release/admitd}
[[ -x $ADMITD ]] || { echo "bench_store.sh: $ADMITD is not built" >&2; exit 1; }

# ---- Redis ----------------------------------------------------------------------------------------

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
rcli() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }

: >"$OUT/redis.log"
redis_pid=""
if [[ " $STORES " == *" redis "* ]]; then
    candidates=${REDIS_PORT:-$(seq 19491 19540)}
    for p in $candidates; do
        listening "$p" && continue
        REDIS_PORT=$p
        taskset -c "$REDIS_CPU" redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no \
            --dir "$work" --logfile "$OUT/redis.log" --daemonize no &
        redis_pid=$!
        started+=("$redis_pid")
        for _ in $(seq 50); do
            [[ $(rcli PING 2>/dev/null) == PONG ]] && break
            kill -0 "$redis_pid" 2>/dev/null || break
            sleep 0.1
        done
        [[ $(rcli PING 2>/dev/null) == PONG ]] && kill -0 "$redis_pid" 2>/dev/null && break
        stop "$redis_pid"
        redis_pid=""
    done
    [[ -n $redis_pid ]] || { echo "bench_store.sh: redis-server did not start on a free port" >&2; exit 1; }
fi

# ---- configs --------------------------------------------------------------------------------------

cp benches/throughput.toml "$work/memory.toml"
if [[ -n $redis_pid ]]; then
    { cat benches/throughput.toml; echo
      sed "s|^url = .*|url = \"redis://127.0.0.1:$REDIS_PORT\"|" benches/store.toml; } >"$work/redis.toml"
fi

# ---- helpers --------------------------------------------------------------------------------------

start_admitd() { # start_admitd CONFIG: admitd on the server core; sets $admitd_pid
    taskset -c "$SERVER_CPU" "$ADMITD" serve --listen "127.0.0.1:$PORT" --config "$1" >>"$OUT/admitd.log" 2>&1 &
    admitd_pid=$!
    started+=("$admitd_pid")
    for _ in $(seq 50); do
        curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$PORT/healthz" && break
        sleep 0.1
    done
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 -H 'Content-Type: application/json' \
        -d '{"tenant":"t0","subject":"probe","tool":"tool0","cost":1}' "http://127.0.0.1:$PORT/v1/admit" || true)
    if [[ $code != 200 ]]; then
        echo "bench_store.sh: admitd answered $code to a probe admission ($1)" >&2
        stop "$admitd_pid"
        return 1
    fi
}

cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'; } # utime + stime

commandstats() { # every command's calls and microseconds so far, as one JSON object
    rcli INFO commandstats | tr -d '\r' | awk -F'[:=,]' '
        /^cmdstat_/ { sub(/^cmdstat_/, "", $1); printf "%s\"%s\":{\"calls\":%s,\"usec\":%s}", sep, $1, $3, $5; sep = "," }
        BEGIN { printf "{" } END { print "}" }'
}

run_once() { # run_once STORE MODE ROUND: one measured run, its JSON line appended to results.jsonl
    local store=$1 mode=$2 round=$3 label="$1 $2 #$3"
    echo "== $label" >&2
    [[ $store == redis ]] && rcli FLUSHALL >/dev/null
    start_admitd "$work/$store.toml" || return 0
    local common=(--url "http://127.0.0.1:$PORT" --connections "$CONNECTIONS" --mode "$mode" --warmup 0)
    if [[ -n ${RATE:-} ]]; then common+=(--rate "$RATE"); fi
    taskset -c "$CLIENT_CPU" "$LOADGEN" "${common[@]}" --duration "$WARMUP" >/dev/null 2>&1 || true
    local before ticks_before after ticks_after
    if [[ $store == redis ]]; then before=$(commandstats); ticks_before=$(cpu_ticks "$redis_pid"); fi
    taskset -c "$CLIENT_CPU" "$LOADGEN" "${common[@]}" --duration "$DURATION" --server-pid "$admitd_pid" \
        --clk-tck "$CLK_TCK" --label "$label" --json >"$work/run.json" || {
        echo "bench_store.sh: run \"$label\" failed" >&2; stop "$admitd_pid"; return 0; }
    if [[ $store == redis ]]; then
        after=$(commandstats); ticks_after=$(cpu_ticks "$redis_pid")
        jq -c --arg store "$store" --argjson a "$before" --argjson b "$after" \
            --argjson cpu "$((ticks_after - ticks_before))" --argjson tck "$CLK_TCK" '
            . + {store: $store, redis: {cpu_ticks: $cpu, clk_tck: $tck,
                 commands: ($b | with_entries(.value = {calls: (.value.calls - ($a[.key].calls // 0)),
                                                         usec: (.value.usec - ($a[.key].usec // 0))})
                              | with_entries(select(.value.calls > 0)))}}' "$work/run.json" >>"$OUT/results.jsonl"
    else
        jq -c --arg store "$store" '. + {store: $store}' "$work/run.json" >>"$OUT/results.jsonl"
    fi
    stop "$admitd_pid"
}

# ---- runs -----------------------------------------------------------------------------------------

: >"$OUT/results.jsonl"
: >"$OUT/admitd.log"
read -ra stores <<<"$STORES"
for round in $(seq "$ROUNDS"); do
    for mode in $MODES; do
        order=("${stores[@]}")
        if ((round % 2 == 0)) && ((${#stores[@]} == 2)); then order=("${stores[1]}" "${stores[0]}"); fi
        for store in "${order[@]}"; do run_once "$store" "$mode" "$round"; done
    done
done

# ---- report ---------------------------------------------------------------------------------------

{
    echo "machine: $(nproc) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1); admitd on core $SERVER_CPU, redis-server on core $REDIS_CPU, load generator on core $CLIENT_CPU; $CONNECTIONS connections, $(if [[ -n ${RATE:-} ]]; then echo "open loop at $RATE requests/s"; else echo "closed loop"; fi), ${DURATION} s per run after ${WARMUP} s of warm-up; $(redis-server --version | awk '{ print $3 }')"
    echo
    echo "| run | req/s | admissions/s | p50 µs | p99 µs | admitd CPU µs/req | Redis CPU µs/admission | round trips (EVALSHA) per admission | EVALSHA µs inside Redis | commands in the script per admission | steal ms | 2xx | 429 | other | errors |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
    jq -r '
        def r2: . * 100 | round / 100;
        (.latency.samples) as $adm
        | (if .redis then
            (.redis.commands) as $c
            | ($c.evalsha // {calls: 0, usec: 0}) as $e
            | ([$c | to_entries[]
                | select(.key | test("^(evalsha|eval|info|flushall|ping|script.*|client.*|hello|select|command.*)$") | not)
                | {k: .key, n: (.value.calls / $adm)}] | sort_by(-.n) | map("\(.k) \(.n | r2)") | join(", ")) as $inside
            | [(.redis.cpu_ticks / .redis.clk_tck * 1e6 / $adm | r2), ($e.calls / $adm * 1000 | round / 1000),
               (if $e.calls > 0 then $e.usec / $e.calls | r2 else "-" end), $inside]
          else ["-", "-", "-", "-"] end) as $r
        | "| \(.label) | \(.rps) | \(($adm / .duration_s) | round) | \(.latency.p50_us) | \(.latency.p99_us) | \(.server_cpu_us_per_req // "-") | \($r[0]) | \($r[1]) | \($r[2]) | \($r[3]) | \(.steal_ms // "-") | \(.ok_2xx) | \(.shed_429) | \(.other_status) | \(.errors) |"' \
        "$OUT/results.jsonl"
    echo
    echo "admissions/s: admission requests answered per second (in admit-release runs req/s counts each release too). Round trips: the EVALSHA calls Redis counted in the measured window over the admissions the load generator completed in it (one script call carries every decision and release a worker queued while the previous one ran, so under load it is far below one). Redis CPU: redis-server's user + system time from /proc/PID/stat over the same window."
    echo
    # Medians over the rounds of each store and mode, and the targets of the shared-store work.
    jq -rs --arg modes "$MODES" '
        def med: sort | if length == 0 then null elif length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
        def r2: if . == null then "-" else . * 100 | round / 100 end;
        ($modes | split(" ") | map(select(. != ""))) as $ms
        | $ms[] as $m
        | [.[] | select(.mode == $m)] as $runs
        | ($runs | map(select(.store == "memory"))) as $mem
        | ($runs | map(select(.store == "redis"))) as $red
        | ($mem | map(.rps) | med) as $mr | ($red | map(.rps) | med) as $rr
        | ($red | map(.latency.p99_us) | med) as $rp99 | ($mem | map(.latency.p99_us) | med) as $mp99
        | ($mem | map(.server_cpu_us_per_req // empty) | med) as $mcpu
        | ($red | map(.server_cpu_us_per_req // empty) | med) as $rcpu
        | ($red | map(.redis.cpu_ticks / .redis.clk_tck * 1e6 / .latency.samples) | med) as $redcpu
        | ($red | map((.redis.commands.evalsha.calls // 0) / .latency.samples) | med) as $rt
        | "\($m), medians of \($mem | length) memory and \($red | length) redis runs: redis / memory throughput \(if $mr and $rr then $rr / $mr | r2 else "-" end) (\($rr) / \($mr) req/s; target >= 0.5)"
          + ", p99 \($rp99 | r2) us redis, \($mp99 | r2) us memory (target <= 2000 us)"
          + ", admitd CPU \($rcpu | r2) / \($mcpu | r2) us per request, Redis CPU \($redcpu | r2) us per admission"
          + ", round trips per admission \(if $rt then $rt * 1000 | round / 1000 else "-" end)"
          + (if $m == "admit-release" then " with its release (target <= 1.0)" else " (target <= 1.0)" end)' \
        "$OUT/results.jsonl"
} | tee "$OUT/results.md"
