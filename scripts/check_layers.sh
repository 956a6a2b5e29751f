#!/usr/bin/env bash
# Checks that the source layout keeps the architecture (docs/architecture.md):
#  1. The engine is the ground floor. Nothing under src/engine/ may name crate::telemetry,
#     crate::actors, crate::api or crate::server, nor the config file's parsing (crate::config::raw,
#     crate::config::validate, crate::config::units, Config::parse, Config::load) outside its tests:
#     the engine reads the validated config model only.
#  2. No source file holds more than MAX_CODE_LINES lines of code (not blank, not a comment) before its
#     test module (`#[cfg(test)]` at the start of a line). Files that are test modules themselves
#     (tests.rs, *_tests.rs, test_support.rs) are not counted.
# Exits non-zero, naming every FILE:LINE (or file) at fault. Checks the tree at $1 (default: this
# repository).
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

MAX_CODE_LINES=${MAX_CODE_LINES:-900}
fail=0

is_test_file() {
  case "$(basename "$1")" in
    tests.rs | *_tests.rs | test_support.rs) return 0 ;;
    *) return 1 ;;
  esac
}

# 1. Upward arrows out of the engine, tests included: a path (`crate::api::x`, `super::super::api`)
#    or a name inside a grouped `use crate::{...}`, on one line or several.
while IFS= read -r f; do
  if hits=$(awk '
      BEGIN { up = "(telemetry|actors|api|server)" }
      /use crate::\{/ { grouped = 1 }
      $0 ~ ("(crate|super::super)::" up "([^a-z_0-9]|$)") ||
        (grouped && $0 ~ ("(^|[{ ,])" up "(::|[,} ]|$)")) {
        print FILENAME ":" FNR ": " $0; found = 1 }
      grouped && /\};/ { grouped = 0 }
      END { exit !found }' "$f"); then
    echo "the engine must not depend on telemetry, actors, api or server:" >&2
    echo "$hits" >&2
    fail=1
  fi
done < <(find src/engine -name '*.rs' | sort)

# 1b. Config parsing from engine code (its tests may build a model from config text).
while IFS= read -r f; do
  is_test_file "$f" && continue
  if hits=$(awk '/^#\[cfg\(test\)\]/ { exit }
      /crate::config::(raw|validate|units)\b|Config::(parse|load)\(|parse_(rate|duration)\(/ {
        print FILENAME ":" FNR ": " $0; found = 1 }
      END { exit !found }' "$f"); then
    echo "the engine reads the validated config model, not the config file:" >&2
    echo "$hits" >&2
    fail=1
  fi
done < <(find src/engine -name '*.rs' | sort)

# 2. Oversized files.
while IFS= read -r f; do
  is_test_file "$f" && continue
  n=$(awk '/^#\[cfg\(test\)\]/ { exit }
      /^[[:space:]]*$/ { next }
      /^[[:space:]]*\/\// { next }
      { n++ } END { print n + 0 }' "$f")
  if [ "$n" -gt "$MAX_CODE_LINES" ]; then
    echo "$f: $n lines of code before its test module; the limit is $MAX_CODE_LINES (split it along what it owns)" >&2
    fail=1
  fi
done < <(find src -name '*.rs' | sort)

if [ "$fail" -eq 0 ]; then
  echo "layers and file sizes ok"
fi
exit "$fail"
