#!/usr/bin/env bash
# Counts the instructions admitd (or the floor) spends per request, with callgrind: repeatable where
# timing is not (on a shared host the same binary's runs differ by 10-25% in CPU per request, and
# by about 0.5% in instructions). See docs/BENCHMARKS.md, "How to reproduce".
#
#   scripts/count.sh --tenants 1 --subjects 1     # admitd, one tenant and one subject
#   scripts/count.sh                              # the loadgen's default spread (1 000 x 100)
#   SERVER=floor scripts/count.sh --tenants 1 --subjects 1   # the floor
#
# The server runs under callgrind on core 0 with instrumentation off; the load generator warms it up
# (WARM_SECS [20] at WARM_RATE [300]/s; with a wider spread than those 6 000 requests, the first calls
# of new subjects are part of what is counted), then the count is taken
# twice for SECS [15] seconds, at LOW_RATE [100] and HIGH_RATE [400] requests/s on 8 connections.
# Work done once a second (ticks, flushes) is the same in both, so the difference of the two counts
# over the difference of the requests is the cost of one request. Prints that total and, with
# TOP [25] > 0, the functions whose own instructions per request changed the most. Needs valgrind
# (callgrind_control, callgrind_annotate) and a release build. Environment: CONFIG
# [benches/throughput.toml], ADMITD [target/release/admitd] (another build to compare), OUT
# [target/count], PORT [19490], SERVER_CPU [0], CLIENT_CPU [1]. STORE=redis counts admitd on the
# shared store: a redis-server (not counted) is started on REDIS_PORT [19489] on the client's core,
# benches/store.toml is appended to CONFIG with its url, and Redis is emptied before each count. At
# these rates every decision is a script call of its own, so this is Redis mode's dearest case for
# admitd (nothing is shared by a batch); docs/BENCHMARKS.md, "Shared store (Redis)", compares it with
# memory mode's count.

set -euo pipefail
cd "$(dirname "$0")/.."

WARM_SECS=${WARM_SECS:-20}
WARM_RATE=${WARM_RATE:-300}
SECS=${SECS:-15}
LOW_RATE=${LOW_RATE:-100}
HIGH_RATE=${HIGH_RATE:-400}
TOP=${TOP:-25}
CONFIG=${CONFIG:-benches/throughput.toml}
ADMITD=${ADMITD:-target/release/admitd}
OUT=${OUT:-target/count}
PORT=${PORT:-19490}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}

for tool in valgrind callgrind_control callgrind_annotate taskset curl python3; do
    command -v "$tool" >/dev/null || { echo "count.sh: $tool is required" >&2; exit 1; }
done
LOADGEN=$(find target/release/deps -maxdepth 1 -name 'loadgen-*' -type f -executable -printf '%T@ %p\n' 2>/dev/null |
    sort -nr | head -n 1 | cut -d' ' -f2-)
[[ -x $ADMITD && -n $LOADGEN ]] ||
    { echo "count.sh: build first: cargo build --release && cargo bench --bench loadgen --no-run" >&2; exit 1; }
mkdir -p "$OUT"
name=${SERVER:-admitd}

server_pid=""
redis_pid=""
trap '[[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null; [[ -n $redis_pid ]] && kill "$redis_pid" 2>/dev/null; true' EXIT

if [[ ${STORE:-memory} == redis ]]; then
    REDIS_PORT=${REDIS_PORT:-19489}
    command -v redis-server >/dev/null || { echo "count.sh: STORE=redis needs redis-server" >&2; exit 1; }
    taskset -c "$CLIENT_CPU" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
        >"$OUT/redis.log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 50); do
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    redis-cli -p "$REDIS_PORT" ping >/dev/null || { echo "count.sh: redis-server did not start (see $OUT/redis.log)" >&2; exit 1; }
    { cat "$CONFIG"; echo
      sed "s|^url = .*|url = \"redis://127.0.0.1:$REDIS_PORT\"|" benches/store.toml; } >"$OUT/store.toml"
    CONFIG=$OUT/store.toml
    name=$name-redis
fi

# count RATE: one server under callgrind, warmed up, then RATE requests/s counted for SECS seconds.
count() {
    local rate=$1 file=$OUT/$name.$1.callgrind
    rm -f "$file" "$file".*
    [[ -z $redis_pid ]] || redis-cli -p "$REDIS_PORT" flushall >/dev/null
    if [[ $name == floor ]]; then
        taskset -c "$SERVER_CPU" valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$file" \
            "$LOADGEN" --floor-only "$PORT" --lifetime 600 >"$OUT/$name.log" 2>&1 &
    else
        taskset -c "$SERVER_CPU" valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$file" \
            "$ADMITD" serve --listen "127.0.0.1:$PORT" --config "$CONFIG" >"$OUT/$name.log" 2>&1 &
    fi
    server_pid=$!
    local up=""
    for _ in $(seq 150); do
        if curl -s -o /dev/null --max-time 1 -H 'Content-Type: application/json' \
            -d '{"tenant":"t0","subject":"s0","tool":"tool0"}' "http://127.0.0.1:$PORT/v1/admit"; then
            up=1
            break
        fi
        sleep 0.2
    done
    [[ -n $up ]] || { echo "count.sh: the server did not start under valgrind (see $OUT/$name.log)" >&2; exit 1; }
    run() { # run RATE SECS
        taskset -c "$CLIENT_CPU" "$LOADGEN" --url "http://127.0.0.1:$PORT" --connections 8 --rate "$1" \
            --duration "$2" --warmup 0 --json "${loadgen_args[@]}"
    }
    run "$WARM_RATE" "$WARM_SECS" >/dev/null 2>"$OUT/$name.warm-up.log"
    callgrind_control -z "$server_pid" >/dev/null 2>&1
    callgrind_control -i on "$server_pid" >/dev/null 2>&1
    run "$rate" "$SECS" >"$OUT/$name.$rate.json" 2>"$OUT/$name.$rate.log"
    callgrind_control -d "$server_pid" >/dev/null 2>&1
    kill "$server_pid"
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
if r["errors"] or r["other_status"]: sys.exit("count.sh: the counted run had errors: %s" % r)' "$OUT/$name.$rate.json"
}

loadgen_args=("$@")
count "$LOW_RATE"
count "$HIGH_RATE"

python3 - "$OUT/$name" "$LOW_RATE" "$HIGH_RATE" "$TOP" <<'PYEND'
import glob, json, re, subprocess, sys

base, low, high, top = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def dump(rate):
    # The dump taken by callgrind_control is FILE.1 (FILE itself is what was left at exit).
    files = sorted(glob.glob(f"{base}.{rate}.callgrind.*"))
    return files[0]

def requests(rate):
    r = json.load(open(f"{base}.{rate}.json"))
    return r["ok_2xx"] + r["shed_429"]

def functions(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no", path],
                         capture_output=True, text=True, check=True).stdout
    total, rows = 0, {}
    for line in out.splitlines():
        m = re.match(r"^\s*(\d[\d,]*)\s+(?:\([^)]*\)\s+)?(\S.*?)(?: \[.*)?$", line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        if m.group(2).startswith("PROGRAM TOTALS"):
            total = n
        elif ":" in m.group(2):
            f = m.group(2).split(":", 1)[1]
            rows[f] = rows.get(f, 0) + n
    return total, rows

(t_low, f_low), (t_high, f_high) = functions(dump(low)), functions(dump(high))
n = requests(high) - requests(low)
print(f"{(t_high - t_low) / n:.0f} instructions per request "
      f"({t_low} at {low}/s and {t_high} at {high}/s, {n} requests apart)")
if top > 0:
    diff = {f: (f_high.get(f, 0) - f_low.get(f, 0)) / n for f in set(f_low) | set(f_high)}
    for f, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"{v:8.0f}  {f[:140]}")
PYEND
