#!/usr/bin/env bash
# Runs every check the project has, exactly as CI does: formatting, lints, unit and black-box tests,
# the Python and JavaScript clients' tests, and the operator artifacts (Prometheus rules, dashboards). Installs what
# the tests need when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)
# openssl makes the certificates of the store's TLS test (tests/replicas.rs).
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# nginx for the edge check's auth_request test (tests/nginx_edge.rs); Debian keeps it in /usr/sbin.
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)
# redis-server (it brings redis-cli through redis-tools) for the shared store tests (tests/common/redis.rs).
{ command -v redis-server && command -v redis-cli; } >/dev/null 2>&1 || need_apt+=(redis-server)
# Headless Chromium renders the status page (tests/status_page.rs).
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
# The Debian package (scripts/deb.sh): dpkg-shlibdeps for its dependencies, fakeroot when not root.
command -v dpkg-shlibdeps >/dev/null 2>&1 || need_apt+=(dpkg-dev)
[ "$(id -u)" -eq 0 ] || command -v fakeroot >/dev/null 2>&1 || need_apt+=(fakeroot)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing test dependencies: ${need_apt[*]}"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # A package installed just now may start a service of its own (Debian's prometheus, nginx and
  # redis-server do); the tests run their own instances on free loopback ports, so stop only the
  # services of the packages this run installed: a service that was already running before is
  # the machine's, and is left alone.
  installed_now=" ${need_apt[*]} "
  stop_new_service() { # package service
    case "$installed_now" in
      *" $1 "*) $SUDO systemctl stop "$2" 2>/dev/null || $SUDO service "$2" stop 2>/dev/null || true ;;
    esac
  }
  stop_new_service prometheus prometheus
  stop_new_service nginx-light nginx
  stop_new_service redis-server redis-server
fi

echo "== layers and file sizes (scripts/check_layers.sh)"
bash scripts/check_layers.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings

echo "== cargo deny (licenses, bans, sources; deny.toml)"
# Pinned; a cold install takes about 5 minutes on two cores. Advisories are checked next, where
# their database can be had.
CARGO_DENY_VERSION=0.20.2
if ! cargo deny --version 2>/dev/null | grep -q "cargo-deny $CARGO_DENY_VERSION"; then
  cargo install --locked "cargo-deny@$CARGO_DENY_VERSION"
fi
cargo deny check licenses bans sources

echo "== cargo deny advisories (RustSec database; exceptions in deny.toml)"
# ADVISORY_DB=DIR checks against a local copy of the database; otherwise it is fetched when GitHub
# answers, and the check is skipped, saying so, where it does not (the CI machines).
if [ -n "${ADVISORY_DB:-}" ]; then
  scripts/advisories.sh "$ADVISORY_DB"
elif timeout 20 git ls-remote -q https://github.com/rustsec/advisory-db HEAD >/dev/null 2>&1; then
  cargo deny check advisories
else
  echo "skipped: the advisory database cannot be fetched from GitHub here; set ADVISORY_DB to a local copy"
fi

echo "== cargo test"
cargo test --all-features

echo "== Debian package: dpkg-deb, dpkg -i into a scratch root, admitd check, the installed binary serves"
# scripts/build_deb.sh packages the build the tests just made (no further compile).
bash scripts/deb.sh

echo "== Python client: standard library only, against the daemon built above"
PYTHONPATH=clients/python/src ADMITD_BIN=target/debug/admitd timeout 300 \
  python3 -W error::ResourceWarning -m unittest discover -s clients/python/tests -p 'test_[cr]*.py'

echo "== Python package: installed with its SDK extras into a venv, type-checked, end to end"
# The SDKs and mypy at the versions in clients/python/tests/constraints.txt, from PyPI.
venv=target/clients-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  -c clients/python/tests/constraints.txt -r clients/python/tests/requirements.txt \
  "./clients/python[fastmcp,mcp]"
"$venv/bin/python" -m mypy --strict clients/python/src/admitd_client
ADMITD_REQUIRE_SDKS=1 ADMITD_BIN=target/debug/admitd timeout 300 \
  "$venv/bin/python" -W error::ResourceWarning -m unittest discover -s clients/python/tests -p 'test_*.py'

echo "== hostile input: Schemathesis from docs/openapi.yaml against the daemon built above"
# Pinned in scripts/schemathesis-requirements.txt, in its own venv; 50 cases per operation.
ADMITD_BIN=target/debug/admitd bash scripts/schemathesis.sh

echo "== script helpers (the profile's phase classifier, the layer check)"
python3 -m unittest discover -s scripts -p 'test_*.py'

echo "== JavaScript package: SDK from npm (pinned by package-lock.json), tsc --strict, end to end"
(cd clients/js && npm ci --no-audit --no-fund --loglevel=error)
(cd clients/js && npx --no-install tsc --strict -p test)
ADMITD_BIN=target/debug/admitd timeout 300 node --test clients/js/test/*.test.mjs
# Installed as a user installs it: no runtime dependency comes along.
js_tmp=$(mktemp -d)
(cd "$js_tmp" && npm init -y >/dev/null && npm install --install-links --no-audit --no-fund --loglevel=error "$OLDPWD/clients/js" >/dev/null &&
  [ ! -d node_modules/@modelcontextprotocol ] &&
  node --input-type=module -e 'import { Admitd } from "admitd-client"; import { Admission } from "admitd-client/mcp";
    new Admission(new Admitd("unix:/run/admitd/admitd.sock"));')
rm -rf "$js_tmp"

echo "== docs: snippets match the files the tests run, internal links resolve, the walk-through is current"
python3 scripts/docs.py snippets --check
python3 scripts/docs.py links
# README's curl walk-through, regenerated from the daemon built above; fails with a diff when stale.
ADMITD_BIN=target/debug/admitd python3 scripts/walkthrough.py --check
# The worked example of docs/operations.md ("Limits from observed traffic"), from a real run; numbers masked.
ADMITD_BIN=target/debug/admitd python3 scripts/advice_example.py --check

echo "== operator artifacts"
bash tests/ops/check_ops.sh

echo "== all checks passed"
