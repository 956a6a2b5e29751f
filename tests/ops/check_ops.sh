#!/usr/bin/env bash
# Validates the operator artifacts: alert rules and their unit tests, runbook links, the Grafana
# dashboard (JSON, variables, PromQL of every panel), the Prometheus config, the deploy YAML files and
# the example configs.
#
#   tests/ops/check_ops.sh               # from anywhere
#   ADMITD=path/to/admitd tests/ops/check_ops.sh
#
# Needs promtool (installed from the Debian "prometheus" package when missing) and python3. The
# example configs are run through `admitd check` when a current admitd binary is found (ADMITD,
# target/release, target/debug or PATH); otherwise that step is skipped with a message.
# Exits non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

RULES=alerts/admitd.rules.yml
RULE_TESTS=alerts/tests/admitd_test.yml
DASHBOARD=dashboards/admitd.json
PROM_CONFIG=deploy/prometheus/prometheus.yml
RUNBOOK=docs/operations.md

step() { printf '\n==> %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# --- (a) promtool --------------------------------------------------------------------------------------
step "promtool"
if ! command -v promtool >/dev/null 2>&1; then
    echo "promtool not found; installing the Debian 'prometheus' package"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || fail "promtool is missing and this is not root (no sudo): apt-get install prometheus"
        SUDO="sudo"
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null
    command -v promtool >/dev/null 2>&1 || fail "promtool still missing after installing prometheus"
fi
promtool --version 2>&1 | sed -n 1p
command -v python3 >/dev/null 2>&1 || fail "python3 is required"

# --- (b) rules -----------------------------------------------------------------------------------------
step "promtool check rules $RULES"
promtool check rules "$RULES"

step "promtool test rules $RULE_TESTS"
promtool test rules "$RULE_TESTS"

step "every alert has a test case, severity, summary, description and a runbook anchor"
python3 - "$RULES" "$RULE_TESTS" "$RUNBOOK" <<'PY'
import re, sys
try:
    import yaml
except ImportError:
    print("SKIP: python3 yaml module not installed (apt-get install python3-yaml)")
    sys.exit(0)

rules_path, tests_path, runbook_path = sys.argv[1:4]
rules = yaml.safe_load(open(rules_path))
tests = yaml.safe_load(open(tests_path))
runbook = open(runbook_path).read()

def anchor(heading):
    # GitHub-style anchor: lower case, spaces to dashes, drop punctuation.
    a = heading.strip().lower()
    a = re.sub(r"[^\w\- ]", "", a)
    return a.replace(" ", "-")

anchors = {anchor(h) for h in re.findall(r"^#+\s+(.+)$", runbook, flags=re.M)}

fired, quiet = set(), set()
for t in tests.get("tests", []):
    for a in t.get("alert_rule_test", []) or []:
        (fired if a.get("exp_alerts") else quiet).add(a["alertname"])

errors = []
alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
for r in alerts:
    name = r["alert"]
    if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
        errors.append(f"{name}: labels.severity must be critical, warning or info")
    ann = r.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        if not ann.get(key):
            errors.append(f"{name}: missing annotation {key}")
    url = ann.get("runbook_url", "")
    if "#" not in url:
        errors.append(f"{name}: runbook_url has no anchor: {url!r}")
    else:
        frag = url.split("#", 1)[1]
        if frag != name.lower():
            errors.append(f"{name}: runbook anchor {frag!r} is not the alert name in lower case")
        if frag not in anchors:
            errors.append(f"{name}: no heading for #{frag} in {runbook_path}")
    if name not in fired:
        errors.append(f"{name}: no test case where it fires")
    if name not in quiet:
        errors.append(f"{name}: no test case where it stays quiet")

for e in errors:
    print("FAIL:", e)
if errors:
    sys.exit(1)
print(f"{len(alerts)} alerts: " + ", ".join(r["alert"] for r in alerts))
PY

# --- (c) dashboard -------------------------------------------------------------------------------------
step "dashboard $DASHBOARD"
python3 - "$DASHBOARD" "$TMP/dashboard_exprs.yml" <<'PY'
import json, re, sys

path, out = sys.argv[1], sys.argv[2]
try:
    d = json.load(open(path))
except json.JSONDecodeError as e:
    print(f"FAIL: {path} is not valid JSON: {e}")
    sys.exit(1)

errors = []

def walk(panels):
    for p in panels:
        yield p
        yield from walk(p.get("panels", []))

variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
ds = variables.get("datasource")
if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
    errors.append("templating: need a 'datasource' variable of type datasource with query prometheus")
for name in ("tenant", "tool", "upstream"):
    v = variables.get(name)
    if not v:
        errors.append(f"templating: missing variable {name}")
        continue
    q = v.get("definition") or v.get("query")
    q = q.get("query") if isinstance(q, dict) else q
    if not (v.get("type") == "query" and "label_values(admitd_admissions_total" in (q or "")):
        errors.append(f"templating: {name} must be a label_values query on admitd_admissions_total")
    if not (v.get("multi") and v.get("includeAll") and v.get("allValue") == ".*"):
        errors.append(f"templating: {name} must be multi, includeAll, allValue '.*'")

# Which metric carries which filterable labels (docs/metrics.md).
LABELS = {
    "admitd_admissions_total": {"tenant", "tool", "upstream"},
    "admitd_admission_wait_seconds_bucket": {"tenant", "tool"},
    "admitd_retry_after_seconds_bucket": {"tenant"},
    "admitd_tool_duration_seconds_bucket": {"tenant", "tool", "upstream"},
    "admitd_upstream_responses_total": {"tenant", "upstream"},
    "admitd_lease_expiries_total": {"tenant", "tool", "upstream"},
    "admitd_inflight": {"tenant"},
    "admitd_waiting": {"tenant"},
    "admitd_bucket_utilization": {"tenant"},
    "admitd_upstream_penalty_seconds": {"tenant", "upstream"},
    "admitd_upstream_effective_rate": {"tenant", "upstream"},
    "admitd_upstream_throttle_probability": {"tenant", "upstream"},
    "admitd_daily_quota_used": {"tenant"},
    "admitd_daily_quota_limit": {"tenant"},
    "admitd_tenant_shed_ratio": {"tenant"},
    "admitd_alert_firing": {"tenant"},
    "admitd_spend_total": {"tenant"},
    "admitd_spend_daily_remaining": {"tenant"},
    "admitd_spend_daily_budget": {"tenant"},
}

exprs = []
ids = set()
for p in walk(d.get("panels", [])):
    if p.get("type") == "row":
        continue
    title = p.get("title", "?")
    if p.get("id") in ids:
        errors.append(f"panel {title!r}: duplicate id {p.get('id')}")
    ids.add(p.get("id"))
    targets = p.get("targets") or []
    if not targets:
        errors.append(f"panel {title!r}: no targets")
    for t in targets:
        expr = (t.get("expr") or "").strip()
        if not expr:
            errors.append(f"panel {title!r} target {t.get('refId')}: no expr")
            continue
        for m in re.finditer(r"\b(rate|irate)\(", expr):
            window = re.search(r"\[([^\]]+)\]", expr[m.end():])
            if not window or window.group(1) != "$__rate_interval":
                errors.append(f"panel {title!r}: rate() window must be $__rate_interval: {expr}")
        for metric, labels in LABELS.items():
            for sel in re.finditer(re.escape(metric) + r"(\{[^}]*\})?", expr):
                body = sel.group(1) or ""
                for label in labels:
                    if f'{label}=~"${label}' not in body:
                        errors.append(f"panel {title!r}: {metric} not filtered by {label}=~\"${label}\": {expr}")
        exprs.append((title, expr))

if not exprs:
    errors.append("no panel expressions found")

# Write the expressions, with Grafana variables replaced, as recording rules so promtool parses them.
with open(out, "w") as f:
    f.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, (title, expr) in enumerate(exprs):
        e = (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
                 .replace("$tenant", ".*").replace("$tool", ".*").replace("$upstream", ".*"))
        if "$" in e:
            errors.append(f"panel {title!r}: unknown variable in {expr}")
        f.write(f"      - record: dashboard:expr_{i}\n        expr: {json.dumps(e)}\n")

for e in errors:
    print("FAIL:", e)
if errors:
    sys.exit(1)
print(f"{path}: valid JSON, schemaVersion {d.get('schemaVersion')}, {len(exprs)} panel expressions")
PY

step "PromQL syntax of every dashboard expression (promtool)"
promtool check rules "$TMP/dashboard_exprs.yml"

# --- (d) Prometheus config -----------------------------------------------------------------------------
step "promtool check config $PROM_CONFIG"
# rule_files in the config are relative to its own directory, so this works from any working directory.
promtool check config "$PROM_CONFIG"

# --- deploy YAML ---------------------------------------------------------------------------------------
step "deploy YAML files parse"
python3 - <<'PY'
import sys
try:
    import yaml
except ImportError:
    print("SKIP: python3 yaml module not installed (apt-get install python3-yaml)")
    sys.exit(0)
for path in ("deploy/kubernetes/sidecar.yaml", "deploy/otel-collector/config.yaml",
             "deploy/prometheus/prometheus.yml"):
    docs = [x for x in yaml.safe_load_all(open(path)) if x is not None]
    if not docs:
        print(f"FAIL: {path} is empty")
        sys.exit(1)
    print(f"{path}: {len(docs)} document(s)")
PY

# --- systemd unit ---------------------------------------------------------------------------------------
step "systemd-analyze verify deploy/admitd.service"
if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "SKIP: systemd-analyze is not installed here (it comes with systemd); the unit was not verified"
else
    # verify checks that ExecStart's binary exists: point the unit at the binary built here (or at
    # /bin/true when none is built), in a copy named like the original.
    UNIT_BIN=""
    for candidate in "${ADMITD:-}" target/release/admitd target/debug/admitd; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then UNIT_BIN="$(cd "$(dirname "$candidate")" && pwd)/$(basename "$candidate")"; break; fi
    done
    [ -n "$UNIT_BIN" ] || UNIT_BIN=/bin/true
    mkdir -p "$TMP/unit"
    sed "s#/usr/bin/admitd#$UNIT_BIN#g" deploy/admitd.service > "$TMP/unit/admitd.service"
    # Unknown keys and unparsable values are only warnings to systemd: any output is a failure here.
    out="$(systemd-analyze verify "$TMP/unit/admitd.service" 2>&1)" || fail "systemd-analyze verify: $out"
    [ -z "$out" ] || fail "systemd-analyze verify warned: $out"
    echo "deploy/admitd.service: verified"
fi

# --- example configs ------------------------------------------------------------------------------------
# The Kubernetes ConfigMap embeds a second config; extract it so it gets the same checks.
python3 - "$TMP/sidecar.toml" <<'PY'
import sys
try:
    import yaml
except ImportError:
    sys.exit(0)
docs = list(yaml.safe_load_all(open("deploy/kubernetes/sidecar.yaml")))
cm = next(d for d in docs if d and d.get("kind") == "ConfigMap")
open(sys.argv[1], "w").write(cm["data"]["admitd.toml"])
PY

step "example configs (admitd check)"
ADMITD_BIN=""
for candidate in "${ADMITD:-}" target/release/admitd target/debug/admitd "$(command -v admitd || true)"; do
    # A stale build without the check command ignores its arguments: ask for its help text instead.
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
        && "$candidate" check --help 2>/dev/null | grep -- '--config' >/dev/null; then
        ADMITD_BIN="$candidate"
        break
    fi
done
if [ -z "$ADMITD_BIN" ]; then
    echo "SKIP: no admitd binary with a 'check' command (build it with 'cargo build', or set ADMITD=path)"
else
    echo "using $ADMITD_BIN"
    for cfg in deploy/admitd.example.toml deploy/container.toml "$TMP/sidecar.toml" benches/throughput.toml; do
        [ -f "$cfg" ] || continue
        label="$cfg"
        [ "$cfg" = "$TMP/sidecar.toml" ] && label="deploy/kubernetes/sidecar.yaml (ConfigMap admitd.toml)"
        out="$("$ADMITD_BIN" check --config "$cfg" 2>&1)" || fail "admitd check rejected $label: $out"
        case "$out" in
            *": ok "*) echo "$label: ${out#*: }" ;;
            *) fail "admitd check gave no verdict for $label: $out" ;;
        esac
    done
fi

step "example configs: every tool cost fits every bucket it passes (else it is always 'oversized')"
python3 - "$TMP/sidecar.toml" <<'PY'
import sys
try:
    import tomllib
except ImportError:
    print("SKIP: python3 has no tomllib (needs 3.11+)")
    sys.exit(0)

DEFAULT_BURST = {"subject": 20, "tenant": 50, "global": 5000}
errors = []
paths = ["deploy/admitd.example.toml"]
try:
    open(sys.argv[1]).close()
    paths.append(sys.argv[1])
except OSError:
    pass
for path in paths:
    label = "deploy/kubernetes/sidecar.yaml (ConfigMap)" if path == sys.argv[1] else path
    cfg = tomllib.load(open(path, "rb"))
    before = len(errors)
    limits = cfg.get("limits", {})
    for name, tool in cfg.get("tools", {}).items():
        cost = tool.get("cost", 1)
        bursts = {f"tools.{name}": tool.get("burst")}
        for layer in ("subject", "tenant", "global"):
            bursts[f"limits.{layer}"] = limits.get(layer, {}).get("burst", DEFAULT_BURST[layer])
        for plan, body in cfg.get("plans", {}).items():
            for layer in ("subject", "tenant"):
                bursts[f"plans.{plan}.{layer}"] = body.get(layer, {}).get("burst")
        # An upstream is charged cost x units (amplification: upstreams = { NAME = units }).
        ups = dict(tool.get("upstreams", {}))
        if tool.get("upstream"):
            ups[tool["upstream"]] = 1
        for where, burst in bursts.items():
            if burst is not None and cost > burst:
                errors.append(f"{label}: tools.{name} cost {cost} > {where} burst {burst}")
        for up, units in ups.items():
            burst = cfg.get("upstreams", {}).get(up, {}).get("burst")
            if burst is not None and cost * units > burst:
                errors.append(f"{label}: tools.{name} charges {cost} x {units} to upstreams.{up}, more than its burst {burst}")
    if len(errors) == before:
        print(f"{label}: all {len(cfg.get('tools', {}))} tools fit their buckets")
for e in errors:
    print("FAIL:", e)
sys.exit(1 if errors else 0)
PY

printf '\nOK: all operator checks passed\n'
