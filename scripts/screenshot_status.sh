#!/usr/bin/env bash
# Makes docs/status-page.png: the status page (GET /) of a daemon fed a looping tenant, a busy one
# and a quiet one for 40 rounds of calls (a minute or two), as headless Chromium draws it.
#
#   bash scripts/screenshot_status.sh            # builds target/debug/admitd first
#   ADMITD_BIN=path/to/admitd bash scripts/screenshot_status.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_common.sh

bin=${ADMITD_BIN:-target/debug/admitd}
[ -n "${ADMITD_BIN:-}" ] || cargo build -q
out=${OUT:-docs/status-page.png}
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"

cat >"$work/admitd.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
[limits.subject]
rate = "60/min"
burst = 5
[limits.tenant]
rate = "600/min"
burst = 20
[alerts]
window = "1m"
for = "5s"
min_calls = 20
TOML
"$bin" serve --config "$work/admitd.toml" 2>"$work/admitd.log" &
started+=($!)
for _ in $(seq 100); do curl -fs "$url/healthz" >/dev/null && break; sleep 0.1; done

admit() { # tenant subject: one call, released at once when admitted
  local body lease
  body=$(curl -s -H 'content-type: application/json' \
    -d "{\"tenant\":\"$1\",\"subject\":\"$2\",\"tool\":\"search\",\"max_wait_ms\":0}" "$url/v1/admit")
  lease=$(printf '%s' "$body" | sed -n 's/.*"lease_id":"\([^"]*\)".*/\1/p')
  [ -z "$lease" ] || curl -s -o /dev/null -H 'content-type: application/json' \
    -d "{\"lease_id\":\"$lease\",\"outcome\":\"ok\"}" "$url/v1/release"
}
# initech loops on one subject (most of it shed); globex is busy on many subjects, within its
# limits; acme calls now and then. Admitted calls are released at once.
for round in $(seq 40); do
  for _ in $(seq 6); do admit initech agent-7; done
  n=$(( 4 + (round % 10) * 2 ))
  for s in $(seq "$n"); do admit globex "worker-$s"; done
  (( round % 3 == 0 )) && admit acme assistant
  sleep 1
done

profile="$work/chromium"
chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --user-data-dir="$profile" \
  --hide-scrollbars --window-size=1100,560 --screenshot="$PWD/$out" "$url/" 2>/dev/null
echo "wrote $out"
