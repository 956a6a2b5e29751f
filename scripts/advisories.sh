#!/usr/bin/env bash
# Checks Cargo.lock against the RustSec advisory database with cargo deny, offline, from a local
# copy of the database (a clone of https://github.com/rustsec/advisory-db), for machines that cannot
# fetch it. Exceptions are in deny.toml's [advisories] section, each with its reason.
#
# Usage: scripts/advisories.sh DIR      DIR: a git clone of the advisory-db (checkout or bare)
set -euo pipefail
cd "$(dirname "$0")/.."

db=${1:?usage: scripts/advisories.sh ADVISORY_DB_CHECKOUT}
# A checkout or a bare clone: either is cloned below, so only its committed tree counts.
git -C "$db" cat-file -e HEAD:crates 2>/dev/null ||
  { echo "advisories.sh: $db holds no advisory database (no git repository with crates/)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# cargo deny looks for the default database's clone under db-path, by the name it gives that URL;
# the first (failing) offline run creates db-path, and the copy goes where that run looked.
url=https://github.com/rustsec/advisory-db
sed "/^\[advisories\]/a db-path = \"$work/db\"\ndb-urls = [\"$url\"]" deny.toml >"$work/deny.toml"
name=$(cargo deny --offline --config "$work/deny.toml" check advisories 2>&1 |
  sed -n "s#.*\"$work/db/\([^\"]*\)\".*#\1#p; s#.*cannot change to '$work/db/\([^']*\)'.*#\1#p" | head -n 1 || true)
[ -n "$name" ] || { echo "advisories.sh: could not learn where cargo deny keeps the database" >&2; exit 1; }
git clone -q "$db" "$work/db/$name"
echo "advisory database: $(git -C "$work/db/$name" log -1 --format='%h of %cs')"
cargo deny --offline --config "$work/deny.toml" check advisories
