#!/usr/bin/env bash
# Measures admitd against the floor (a bare warp server that parses the same JSON and answers without
# any admission logic) on one machine, and admitd's memory per idle subject. See docs/BENCHMARKS.md.
#
# Layout on a 2-core machine: the server under test (admitd or the floor, each in its own process) runs
# on core 0, the load generator on core 1, so the client never steals the server's CPU.
#
#   scripts/bench.sh              # build, run everything (about 15 minutes after the build)
#   DURATION=5 scripts/bench.sh   # shorter runs
#
# Environment (defaults in brackets): DURATION [10] and WARMUP [2] seconds per run; OPEN_RATE [20000]
# requests/s for the open-loop runs, OPEN_ROUNDS [3] alternating rounds of them; CLOSED_ROUNDS [3]
# alternating rounds of the closed-loop pairs (read by their medians); SERVER_CPU [0] and
# CLIENT_CPU [1] cores; PORT [19470],
# FLOOR_PORT [19471], RSS_PORT [19472]; OUT [target/bench] for results; SKIP_BUILD=1 to use what is
# built; SKIP_RSS=1 to skip the memory measurement; TELEMETRY_ROUNDS [3] rounds of telemetry off / on /
# on with OTLP export to CLOSED_PORT [9], where nothing may listen / on with OTLP export to a collector
# that answers (a second floor process on the client core, COLLECTOR_PORT [19473]): on the default
# span limit (max_spans_per_second = 1000), every span (no limit) and SAMPLE_RATIO [0.1] of them (no
# limit), and with every tool spending a per-tenant upstream (AIMD and adaptive throttling on), which
# is read against "on" (0 rounds skips them all); MAX_STEAL_MS [25 per second of DURATION] and
# STEAL_RETRIES [2]: a run
# (or, for the floor-and-admitd pairs, either run of the pair) that lost more than MAX_STEAL_MS of CPU
# time to the host (the `steal` of /proc/stat, both cores) measured the host rather than the server, so
# it is measured again, up to STEAL_RETRIES times, and the attempt that lost the least is kept; the
# runs set aside are listed in the table as "discarded (steal): ..." and count in no median.
#
# Output: a Markdown table on stdout and in $OUT/results.md, one JSON line per run in
# $OUT/results.jsonl, admitd's log in $OUT/admitd.log.

set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
OPEN_RATE=${OPEN_RATE:-20000}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
PORT=${PORT:-19470}
FLOOR_PORT=${FLOOR_PORT:-19471}
RSS_PORT=${RSS_PORT:-19472}
CLOSED_PORT=${CLOSED_PORT:-9}
COLLECTOR_PORT=${COLLECTOR_PORT:-19473}
SAMPLE_RATIO=${SAMPLE_RATIO:-0.1}
TELEMETRY_ROUNDS=${TELEMETRY_ROUNDS:-3}
OPEN_ROUNDS=${OPEN_ROUNDS:-3}
CLOSED_ROUNDS=${CLOSED_ROUNDS:-3}
OUT=${OUT:-target/bench}
MAX_STEAL_MS=${MAX_STEAL_MS:-$((DURATION * 25))}
STEAL_RETRIES=${STEAL_RETRIES:-2}
CLK_TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)

for tool in taskset curl jq; do
    command -v "$tool" >/dev/null || { echo "bench.sh: $tool is required" >&2; exit 1; }
done

mkdir -p "$OUT"
# $work, $started, stop and the exit traps.
source scripts/bench_common.sh

# ---- build ----------------------------------------------------------------------------------------

if [[ -z ${SKIP_BUILD:-} ]]; then
    cargo build --release
    cargo bench --bench loadgen --no-run
fi
LOADGEN=$(cargo bench --bench loadgen --no-run --message-format=json 2>/dev/null |
    jq -r 'select(.reason == "compiler-artifact" and .target.name == "loadgen") | .executable // empty' |
    tail -n 1 || true)
if [[ -z $LOADGEN || ! -x $LOADGEN ]]; then
    LOADGEN=$(ls -t target/release/deps/loadgen-* 2>/dev/null | grep -v '\.d$' | head -n 1 || true)
fi
[[ -n $LOADGEN && -x $LOADGEN ]] || { echo "bench.sh: cannot find the loadgen binary" >&2; exit 1; }
ADMITD=target/release/admitd

# ---- configs --------------------------------------------------------------------------------------

# Limits so generous that nothing is shed: the runs measure the cost of deciding, not of refusing.
cp benches/throughput.toml "$work/throughput.toml"
# Its tenant and global limits, shared by the memory config below.
generous_tenant_and_global=$(sed -n '/^\[limits.tenant\]/,$p' benches/throughput.toml)

# The same limits with telemetry off, and with spans exported towards a port where nothing listens
# (a collector that is down must not slow admissions).
{ cat "$work/throughput.toml"; printf '\n[telemetry]\nenabled = false\n'; } >"$work/telemetry-off.toml"
{ cat "$work/throughput.toml"; printf '\n[telemetry.otlp]\nendpoint = "http://127.0.0.1:%s/v1/traces"\n' "$CLOSED_PORT"; } >"$work/telemetry-otlp.toml"
# ... and to a collector that answers: on the default span limit, with every span and with a share of
# them.
{ cat "$work/throughput.toml"; printf '\n[telemetry.otlp]\nendpoint = "http://127.0.0.1:%s/v1/traces"\n' "$COLLECTOR_PORT"; } >"$work/telemetry-live.toml"
{ cat "$work/telemetry-live.toml"; printf 'max_spans_per_second = 0\n'; } >"$work/telemetry-every.toml"
{ cat "$work/telemetry-every.toml"; printf 'sample_ratio = %s\n' "$SAMPLE_RATIO"; } >"$work/telemetry-sampled.toml"
# Every tool (the load generator's tool0..tool7) spending a per-tenant upstream whose budget is as
# generous as the limits, with AIMD and the adaptive throttle on (their defaults): what upstream
# awareness adds to an admission and its release, against the same limits without it ("on").
{ cat "$work/throughput.toml"; printf '\n[upstreams.api]\nrate = "10000000/s"\nburst = 10000000\n'
  for t in $(seq 0 7); do printf '\n[tools.tool%s]\nupstream = "api"\n' "$t"; done; } >"$work/upstream.toml"

# A subject bucket that refills one token per hour, so a subject that made one call keeps state for an
# hour (a full bucket is resting state and may be dropped); tenants stay alive as long.
cat >"$work/rss.toml" <<EOF
[server]
lease_ttl = "10s"
idle_ttl = "1h"

[limits.subject]
rate = "1/h"
burst = 100
concurrency = 1000000

$generous_tenant_and_global
EOF

# ---- helpers --------------------------------------------------------------------------------------

wait_http() { # wait_http URL [curl args...]: until the server answers at all (5 s at most)
    local url=$1; shift
    for _ in $(seq 50); do
        curl -s -o /dev/null --max-time 1 "$@" "$url" && return 0
        sleep 0.1
    done
    return 1
}

start_admitd() { # start_admitd PORT CONFIG: starts admitd on the server core; sets $admitd_pid
    taskset -c "$SERVER_CPU" "$ADMITD" serve --listen "127.0.0.1:$1" --config "$2" >>"$OUT/admitd.log" 2>&1 &
    admitd_pid=$!
    started+=("$admitd_pid")
    if ! wait_http "http://127.0.0.1:$1/healthz"; then
        stop "$admitd_pid"
        return 1
    fi
    # It must also admit: a daemon that answers /healthz but not /v1/admit is not ready to measure.
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 -H 'Content-Type: application/json' \
        -d '{"tenant":"t0","subject":"probe","tool":"tool0","cost":1}' "http://127.0.0.1:$1/v1/admit" || true)
    if [[ $code != 200 ]]; then
        echo "bench.sh: admitd answered $code to a probe admission" >&2
        stop "$admitd_pid"
        return 1
    fi
}

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }

load() { # load LABEL PORT PID [loadgen args...]: one measured run, its JSON line on stdout
    local label=$1 port=$2 pid=$3; shift 3
    echo "== $label" >&2
    taskset -c "$CLIENT_CPU" "$LOADGEN" --url "http://127.0.0.1:$port" --server-pid "$pid" \
        --clk-tck "$CLK_TCK" --duration "$DURATION" --warmup "$WARMUP" --label "$label" --json "$@" ||
        echo "bench.sh: run \"$label\" failed" >&2
}

measure() { # measure NAME CMD...: runs CMD, which writes one JSON line per run to each file named in
    # $runs, again while any of its runs lost more than MAX_STEAL_MS to steal (at most STEAL_RETRIES
    # more times), then appends to results.jsonl the attempt that lost the least, and the others
    # relabelled "discarded (steal): ..." (so that they count in no median).
    local name=$1; shift
    local attempt a i best=0 best_steal="" steal
    for attempt in $(seq 0 "$STEAL_RETRIES"); do
        "$@"
        for i in "${!runs[@]}"; do cp "${runs[$i]}" "$work/attempt.$attempt.$i.json"; done
        steal=$(jq -s 'map(.steal_ms // 0) | max // 0' "${runs[@]}")
        if [[ -z $best_steal ]] || jq -en "$steal < $best_steal" >/dev/null; then
            best=$attempt best_steal=$steal
        fi
        jq -en "$steal <= $MAX_STEAL_MS" >/dev/null && break
        if ((attempt < STEAL_RETRIES)); then
            echo "bench.sh: $name lost $steal ms to steal (more than $MAX_STEAL_MS); measuring it again" >&2
        fi
    done
    for a in $(seq 0 "$attempt"); do
        for i in "${!runs[@]}"; do
            if ((a == best)); then
                cat "$work/attempt.$a.$i.json"
            else
                jq -c '.label = "discarded (steal): " + .label' "$work/attempt.$a.$i.json"
            fi
        done
    done >>"$OUT/results.jsonl"
}

# ---- servers --------------------------------------------------------------------------------------

: >"$OUT/results.jsonl"
: >"$OUT/admitd.log"

taskset -c "$SERVER_CPU" "$LOADGEN" --floor-only "$FLOOR_PORT" --lifetime 1800 >"$work/floor.log" 2>&1 &
floor_pid=$!
started+=("$floor_pid")
wait_http "http://127.0.0.1:$FLOOR_PORT/floor" -H 'Content-Type: application/json' \
    -d '{"tenant":"t0","subject":"s0","tool":"tool0"}' || { echo "bench.sh: the floor did not start" >&2; exit 1; }

have_admitd=0
if [[ -x $ADMITD ]] && start_admitd "$PORT" "$work/throughput.toml"; then
    have_admitd=1
else
    echo "bench.sh: admitd is not built or does not serve; measuring the floor only" >&2
fi

# ---- throughput and latency -----------------------------------------------------------------------

# Floor and admitd alternate, so slow drift of the machine affects both alike.
pair_once() { # pair_once NAME [loadgen args...]: the same load on the floor, then on admitd
    local name=$1; shift
    load "floor $name" "$FLOOR_PORT" "$floor_pid" "$@" >"$work/floor.json"
    if ((have_admitd)); then
        load "admitd $name" "$PORT" "$admitd_pid" "$@" >"$work/admitd.json"
    fi
}
pair() { # pair NAME [loadgen args...]: pair_once, measured again while either run lost too much to steal
    runs=("$work/floor.json")
    ((have_admitd)) && runs+=("$work/admitd.json")
    measure "$1" pair_once "$@"
}
# On a shared host a single pair can be off by 20-40% either way (other guests take the CPU: see the
# steal column), so the closed-loop pairs alternate CLOSED_ROUNDS times and are read by their median.
for round in $(seq "$CLOSED_ROUNDS"); do
    pair "closed c=8 #$round" --connections 8
    pair "closed c=64 #$round" --connections 64
    pair "admit-release c=64 #$round" --connections 64 --mode admit-release
done
# The open-loop tail is set by stalls of the host as much as by the server: alternate OPEN_ROUNDS times
# and read the median.
for round in $(seq "$OPEN_ROUNDS"); do
    pair "open ${OPEN_RATE}/s c=64 #$round" --connections 64 --rate "$OPEN_RATE"
done

if ((have_admitd)); then
    stop "$admitd_pid"
fi
stop "$floor_pid"

# ---- what telemetry and upstream awareness cost ---------------------------------------------------

# Admit + release pairs at c=64 (so that every admitted call's span ends and is exported, as in
# production, where tools finish) against admitd with telemetry off, on, on with OTLP export to a
# closed port, and on with
# OTLP export to a collector that answers (default span limit; every span; SAMPLE_RATIO of them), and
# with telemetry on and every tool spending a per-tenant upstream (read against "on"). The variants alternate
# for TELEMETRY_ROUNDS rounds, each round starting with the next one, so that the machine's drift hits
# them alike. The collector runs on the client core: its work is not admitd's.
spans_line=""
if ((have_admitd)) && ((TELEMETRY_ROUNDS > 0)); then
    taskset -c "$CLIENT_CPU" "$LOADGEN" --floor-only "$COLLECTOR_PORT" --floor-threads 1 --lifetime 1800 \
        >"$work/collector.log" 2>&1 &
    collector_pid=$!
    started+=("$collector_pid")
    wait_http "http://127.0.0.1:$COLLECTOR_PORT/v1/traces/received" ||
        { echo "bench.sh: the collector did not start" >&2; exit 1; }
    telemetry_once() { # one run of the variant and round being measured
        load "telemetry $variant #$round" "$PORT" "$admitd_pid" --connections 64 --mode admit-release \
            >"$work/telemetry.json"
    }
    variants=(off on otlp live every sampled upstream)
    n=${#variants[@]}
    for round in $(seq "$TELEMETRY_ROUNDS"); do
        for i in $(seq 0 $((n - 1))); do
            variant=${variants[$(((i + round - 1) % n))]}
            case $variant in
                off) cfg=$work/telemetry-off.toml ;;
                on) cfg=$work/throughput.toml ;;
                otlp) cfg=$work/telemetry-otlp.toml ;;
                live) cfg=$work/telemetry-live.toml ;;
                every) cfg=$work/telemetry-every.toml ;;
                sampled) cfg=$work/telemetry-sampled.toml ;;
                upstream) cfg=$work/upstream.toml ;;
            esac
            if start_admitd "$PORT" "$cfg"; then
                received() { curl -s --max-time 5 "http://127.0.0.1:$COLLECTOR_PORT/v1/traces/received" || echo '{}'; }
                before=$(received)
                runs=("$work/telemetry.json")
                measure "telemetry $variant #$round" telemetry_once
                if [[ $variant == live || $variant == every || $variant == sampled ]]; then
                    # Proof of what was exported: spans counted by admitd and received by the
                    # collector (until the run's end; spans still open or queued then are not
                    # counted), and what admitd dropped, by reason.
                    m=$(curl -s --max-time 5 "http://127.0.0.1:$PORT/metrics")
                    exported=$(awk '/^admitd_spans_exported_total/ { s += $2 } END { print s + 0 }' <<<"$m")
                    dropped=$(awk '/^admitd_spans_dropped_total/ { split($1, a, "\""); d = d " " a[2] "=" $2 } END { print d == "" ? " none" : d }' <<<"$m")
                    got=$(jq -nr --argjson a "$before" --argjson b "$(received)" \
                        '"\(($b.requests // 0) - ($a.requests // 0)) requests, \((($b.bytes // 0) - ($a.bytes // 0)) / 1e6 | floor) MB"')
                    spans_line+="span export, telemetry $variant #$round: admitd exported $exported spans, collector received $got; dropped:$dropped"$'\n'
                fi
                stop "$admitd_pid"
            fi
        done
    done
    stop "$collector_pid"
fi

# ---- memory per idle subject ----------------------------------------------------------------------

rss_line="memory per idle subject: not measured"
if ((have_admitd)) && [[ -z ${SKIP_RSS:-} ]]; then
    if start_admitd "$RSS_PORT" "$work/rss.toml"; then
        populate() { # populate OFFSET COUNT: one admission (and its release) per new subject
            taskset -c "$CLIENT_CPU" "$LOADGEN" --url "http://127.0.0.1:$RSS_PORT" --mode populate \
                --tenants 10 --offset "$1" --count "$2" --connections 8 --duration 300 --json >"$work/populate.json"
            jq -e '.errors == 0 and .other_status == 0 and .shed_429 == 0' "$work/populate.json" >/dev/null ||
                echo "bench.sh: populate $1+$2 had failures: $(cat "$work/populate.json")" >&2
        }
        populate 0 100 # the 10 tenants exist from here on
        sleep 1
        base=$(rss_kib "$admitd_pid")
        populate 100 10000
        sleep 1
        rss10k=$(rss_kib "$admitd_pid")
        populate 10100 90000
        sleep 1
        rss100k=$(rss_kib "$admitd_pid")
        held=$(curl -s --max-time 5 "http://127.0.0.1:$RSS_PORT/v1/tenants/t0" | jq '.subjects | length' 2>/dev/null || echo "?")
        stop "$admitd_pid"
        per10k=$(( (rss10k - base) * 1024 / 10000 ))
        per100k=$(( (rss100k - base) * 1024 / 100000 ))
        rss_line="memory per idle subject: RSS $base KiB with 100 subjects, $rss10k KiB with +10k, $rss100k KiB with +100k"
        rss_line+=" -> $per10k B/subject (10k), $per100k B/subject (100k); tenant t0 holds $held subjects"
        jq -nc --argjson base "$base" --argjson r10 "$rss10k" --argjson r100 "$rss100k" \
            --argjson p10 "$per10k" --argjson p100 "$per100k" \
            '{label: "rss", base_kib: $base, rss_10k_kib: $r10, rss_100k_kib: $r100,
              bytes_per_subject_10k: $p10, bytes_per_subject_100k: $p100}' >>"$OUT/results.jsonl"
    else
        rss_line="memory per idle subject: admitd did not start with the memory config"
    fi
fi

# ---- report ---------------------------------------------------------------------------------------

{
    echo "machine: $(nproc) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1); server on core $SERVER_CPU, load generator on core $CLIENT_CPU; ${DURATION} s per run after ${WARMUP} s warm-up"
    echo
    echo "| run | req/s | p50 µs | p90 µs | p99 µs | p99.9 µs | max µs | server CPU µs/req | server CPU % | steal ms | 2xx | 429 | other | errors |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    jq -r 'select(.label != "rss") | "| \(.label) | \(.rps) | \(.latency.p50_us) | \(.latency.p90_us) | \(.latency.p99_us) | \(.latency.p999_us) | \(.latency.max_us) | \(.server_cpu_us_per_req // "-") | \(.server_cpu_pct // "-") | \(.steal_ms // "-") | \(.ok_2xx) | \(.shed_429) | \(.other_status) | \(.errors) |"' "$OUT/results.jsonl"
    echo
    echo "steal ms: CPU time the host took from this machine during the run (both cores); a run with much of it measured the host, not the server."
    discarded=$(jq -s '[.[] | select(.label | startswith("discarded (steal): "))] | length' "$OUT/results.jsonl")
    echo "Runs (or pairs) that lost more than $MAX_STEAL_MS ms to steal were measured again, up to $STEAL_RETRIES times, keeping the attempt that lost the least; $discarded runs were set aside (\"discarded (steal)\", in no median)."
    echo
    if ((have_admitd)); then
        # Medians over the rounds, each side on its own: throughput ratio, CPU-per-request ratio, and
        # admitd's p99.
        jq -rs '
            def med(s): [.[] | select(.label | startswith(s + " #"))] as $r
                | {n: ($r | length),
                   rps: ($r | map(.rps) | sort | .[length / 2 | floor]),
                   cpu: ($r | map(.server_cpu_us_per_req) | map(select(. != null)) | sort | .[length / 2 | floor]),
                   p99: ($r | map(.latency.p99_us) | sort | .[length / 2 | floor])};
            ["closed c=8", "closed c=64", "admit-release c=64"][] as $k
            | med("admitd " + $k) as $a | med("floor " + $k) as $f
            | select($a.n > 0 and $f.n > 0 and $f.rps > 0)
            | "\($k), medians of \($a.n) rounds: admitd / floor throughput \(($a.rps / $f.rps * 100 | round) / 100)"
              + (if $a.cpu != null and $f.cpu != null and $f.cpu > 0
                 then ", CPU per request \($a.cpu) / \($f.cpu) us = \(($a.cpu / $f.cpu * 100 | round) / 100) x" else "" end)
              + ", p99 \($a.p99) us (the floor \($f.p99) us)"' "$OUT/results.jsonl"
    else
        echo "admitd / floor throughput: TBD (admitd not measured)"
    fi
    jq -rs '
        def p99s(s): [.[] | select(.label | startswith(s + " open ")) | .latency.p99_us] | sort;
        ["floor", "admitd"][] as $s | (p99s($s)) as $p | select(($p | length) > 0)
        | "open-loop p99, \($s): median \($p[($p | length / 2 | floor)]) us over \($p | length) runs (\($p | map(tostring) | join(", ")))"' "$OUT/results.jsonl"
    jq -rs '
        def stats(v; f): [.[] | select(.label | startswith("telemetry " + v + " #")) | f] | sort
            | select(length > 0) | {best: .[-1], median: .[(length / 2 | floor)]};
        def ratio(a; b): (a / b * 100 | round) / 100;
        ((stats("off"; .rps)) as $off
         | {on: "on", otlp: "on + OTLP to a closed port",
            live: "on + OTLP to a collector (default max_spans_per_second)",
            every: "on + OTLP to a collector, every span (max_spans_per_second = 0)",
            sampled: "on + OTLP to a collector, sample_ratio '"$SAMPLE_RATIO"', no span limit"} as $names
         | ["on", "otlp", "live", "every", "sampled"][] as $v | (stats($v; .rps)) as $s
         | "telemetry \($names[$v]) / off throughput: best \(ratio($s.best; $off.best)), median \(ratio($s.median; $off.median))"),
        ((stats("on"; .rps)) as $on | (stats("upstream"; .rps)) as $up
         | (stats("on"; .server_cpu_us_per_req).median) as $con
         | (stats("upstream"; .server_cpu_us_per_req).median) as $cup
         | "upstream-aware (every tool spends a per-tenant upstream, AIMD and adaptive throttling on) / on: throughput median \(ratio($up.median; $on.median)), CPU per request median \($cup) / \($con) us = \(if $cup >= $con then "+" else "" end)\((($cup / $con - 1) * 1000 | round) / 10)%")' "$OUT/results.jsonl"
    [[ -n $spans_line ]] && printf '%s' "$spans_line"
    echo "$rss_line"
} | tee "$OUT/results.md"
