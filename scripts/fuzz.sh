#!/usr/bin/env bash
# Runs the parser property tests (src/api/admit_props.rs: admission body, Retry-After, config file,
# state file) with many more cases than the test suite does, each property for a bounded time.
#
#   scripts/fuzz.sh                 # 20000 cases per property, at most 120 s each
#   CASES=100000 SECONDS_EACH=600 scripts/fuzz.sh
#
# cargo fuzz needs a nightly toolchain; these are proptest properties on the stable one. A failing
# input is printed shrunk to its smallest form: fix the parser and keep the input as a regression
# case in admit_props.rs. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

CASES="${CASES:-20000}"
SECONDS_EACH="${SECONDS_EACH:-120}"

cargo test --lib --no-run >/dev/null 2>&1 || cargo test --lib --no-run
props=$(cargo test --lib -- --list 2>/dev/null | sed -n 's/^\(api::admit::props::[a-z_]*\): test$/\1/p')
[ -n "$props" ] || { echo "no property tests found" >&2; exit 1; }
for p in $props; do
    echo "== $p ($CASES cases, at most ${SECONDS_EACH}s)"
    # A property that is still running when the time is up has passed every case it reached.
    set +e
    PROPTEST_CASES="$CASES" timeout "$SECONDS_EACH" cargo test --lib --quiet -- --exact "$p"
    rc=$?
    set -e
    case $rc in
        0) ;;
        124) echo "   stopped after ${SECONDS_EACH}s without a failure" ;;
        *) echo "FAIL: $p" >&2; exit "$rc" ;;
    esac
done
echo "== all properties held"
