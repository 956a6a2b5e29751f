//! The dashboards and alert rules against a real Prometheus: two admitd daemons (one enforcing, one in
//! shadow mode) are scraped while traffic lights up every series, then every PromQL expression in
//! `dashboards/admitd.json` and `alerts/admitd.rules.yml` is evaluated through Prometheus's HTTP API.
//! The test fails if any expression errors, or if one that this traffic must light up returns nothing.
//!
//! It needs the `prometheus` binary (Debian package `prometheus`; `scripts/test.sh` installs it).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{eventually, Daemon};
use serde_json::{json, Value};

const ENFORCE: &str = r#"
[server]
lease_ttl = "1s"
[limits.subject]
rate = "5/s"
burst = 5
daily_quota = 100000
[limits.tenant]
daily_quota = 1000000
[tools.get_sales]
upstream = "warehouse"
[upstreams.warehouse]
rate = "50/s"
burst = 50
[upstreams.crm]
rate = "50/s"
burst = 50
shared = true
[alerts]
shed_ratio = 0.5
window = "10s"
for = "1s"
min_calls = 10
[spend.usd]
estimate = 0.01
tenant_daily = 100
run = 0.1
currency = "$"
[tools.summarize.spend]
usd = 0.04
"#;

const SHADOW: &str = "[server]\nmode = \"shadow\"\n[limits.subject]\nrate = \"1/s\"\nburst = 2\n";

struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_prometheus(targets: &[&str]) -> Prometheus {
    let dir = tempfile::tempdir().unwrap();
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("alerts/admitd.rules.yml");
    let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    let cfg = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - '{}'\nscrape_configs:\n  - job_name: admitd\n    static_configs:\n      - targets: [{}]\n",
        rules.display(),
        targets.join(", ")
    );
    let cfg_path = dir.path().join("prometheus.yml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let port = free_port();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg_path.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the `prometheus` binary is needed: apt-get install prometheus (scripts/test.sh does this)");
    Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    }
}

fn query(client: &reqwest::blocking::Client, prom: &str, expr: &str) -> Result<Vec<Value>, String> {
    let r = client
        .get(format!("{prom}/api/v1/query"))
        .query(&[("query", expr)])
        .send()
        .map_err(|e| e.to_string())?;
    let v: Value = r.json().map_err(|e| e.to_string())?;
    if v["status"] != "success" {
        return Err(format!("{}: {}", v["errorType"], v["error"]));
    }
    match &v["data"]["result"] {
        Value::Array(a) => Ok(a.clone()),
        other => Ok(vec![other.clone()]),
    }
}

/// Grafana's variables, as a dashboard with "All" selected would send them.
fn grafana(expr: &str) -> String {
    expr.replace("${tenant}", ".*")
        .replace("${tool}", ".*")
        .replace("${upstream}", ".*")
        .replace("$tenant", ".*")
        .replace("$tool", ".*")
        .replace("$upstream", ".*")
        .replace("$__rate_interval", "30s")
        .replace("$__interval", "5s")
        .replace("$__range", "5m")
}

fn panels(v: &Value, out: &mut Vec<(String, String)>) {
    for p in v.as_array().into_iter().flatten() {
        let title = p["title"].as_str().unwrap_or("").to_string();
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((title.clone(), e.to_string()));
            }
        }
        panels(&p["panels"], out);
    }
}

fn traffic(enforce: &Daemon, shadow: &Daemon, round: u32) {
    let mut leases = Vec::new();
    for i in 0..12 {
        let a = enforce.admit(json!({"tenant": "acme", "subject": "loop-bot", "tool": "get_sales", "max_wait_ms": if i == 6 { 1000 } else { 0 }}));
        if a.status == 200 {
            leases.push(a.body["lease_id"].as_str().unwrap().to_string());
        }
    }
    for (i, l) in leases.iter().enumerate() {
        let body = match i {
            0 => {
                json!({"lease_id": l, "outcome": "upstream_rate_limited", "upstream_status": 429, "retry_after": "1", "duration_ms": 30})
            }
            1 => continue, // left to expire
            _ => {
                json!({"lease_id": l, "outcome": "ok", "upstream_status": 200, "duration_ms": 120})
            }
        };
        enforce.post("/v1/release", body);
    }
    for s in 0..3 {
        let a = enforce.admit(json!({"tenant": "globex", "subject": format!("agent-{s}"), "tool": "sync", "upstream": "crm", "max_wait_ms": 0}));
        if a.status == 200 {
            enforce.post(
                "/v1/release",
                json!({"lease_id": a.body["lease_id"], "outcome": "ok", "duration_ms": 80}),
            );
        }
    }
    // An agent run that spends its budget: two calls fit (each cost more than its estimate), the
    // third is refused with scope spend.
    for _ in 0..3 {
        let a = enforce.admit(json!({"tenant": "acme", "subject": "spender", "tool": "summarize", "run": format!("r-{round}"), "max_wait_ms": 0}));
        if a.status == 200 {
            enforce.post(
                "/v1/release",
                json!({"lease_id": a.body["lease_id"], "outcome": "ok", "spent": {"usd": 0.05}}),
            );
        }
    }
    if round % 3 == 0 {
        enforce.post(
            "/v1/feedback",
            json!({"tenant": "globex", "upstream": "crm", "status": 429, "retry_after": "1"}),
        );
    }
    for _ in 0..4 {
        let a = shadow.admit(
            json!({"tenant": "initech", "subject": "bot", "tool": "search", "max_wait_ms": 0}),
        );
        if let Some(l) = a.body["lease_id"].as_str() {
            shadow.release(l);
        }
    }
}

#[test]
fn every_dashboard_and_rule_expression_evaluates_against_real_traffic() {
    let enforce = Daemon::start(ENFORCE);
    let shadow = Daemon::start(SHADOW);
    let prom = start_prometheus(&[&enforce.addr, &shadow.addr]);
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || query(
            &client,
            &prom.url,
            "up{job=\"admitd\"} == 1"
        )
        .map(|r| r.len() == 2)
        .unwrap_or(false)),
        "Prometheus did not scrape both daemons"
    );

    let start = Instant::now();
    let mut round = 0;
    while start.elapsed() < Duration::from_secs(12) {
        traffic(&enforce, &shadow, round);
        round += 1;
        std::thread::sleep(Duration::from_millis(700));
    }
    // one more scrape and rule evaluation after the last traffic
    std::thread::sleep(Duration::from_secs(3));

    // The exposition itself passes promtool's checks and lint (help text, names, units) for both
    // daemons, with every kind of series present.
    for d in [&enforce, &shadow] {
        let metrics = d.get("/metrics");
        let text = metrics.body.as_str().expect("the exposition is text");
        let mut lint = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("promtool (from the prometheus package) runs");
        std::io::Write::write_all(&mut lint.stdin.take().unwrap(), text.as_bytes()).unwrap();
        let out = lint.wait_with_output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && said.trim().is_empty(),
            "promtool check metrics: {said}"
        );
    }

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("dashboards/admitd.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = Vec::new();
    panels(&dashboard["panels"], &mut exprs);
    assert!(
        exprs.len() >= 20,
        "only {} dashboard expressions",
        exprs.len()
    );
    // Template variables: label_values(metric, label) must find values.
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        let q = var["query"]
            .as_str()
            .or_else(|| var["query"]["query"].as_str())
            .unwrap_or("");
        if let Some(inner) = q
            .strip_prefix("label_values(")
            .and_then(|s| s.strip_suffix(')'))
        {
            if let Some((metric, label)) = inner.rsplit_once(',') {
                exprs.push((
                    format!("variable {}", var["name"]),
                    format!("count by ({}) ({})", label.trim(), grafana(metric.trim())),
                ));
            }
        }
    }

    let rules: Value = serde_norway::from_str(
        &std::fs::read_to_string(root.join("alerts/admitd.rules.yml")).unwrap(),
    )
    .unwrap();
    let mut alert_exprs = Vec::new();
    let mut records = Vec::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let expr = rule["expr"].as_str().unwrap().to_string();
            if let Some(name) = rule["record"].as_str() {
                records.push(name.to_string());
                exprs.push((format!("record {name}"), expr));
            } else {
                alert_exprs.push((rule["alert"].as_str().unwrap().to_string(), expr));
            }
        }
    }
    assert!(alert_exprs.len() >= 6, "{alert_exprs:?}");

    let mut errors = Vec::new();
    let mut empty = Vec::new();
    for (what, expr) in &exprs {
        match query(&client, &prom.url, &grafana(expr)) {
            Err(e) => errors.push(format!("{what}: {expr}: {e}")),
            Ok(r) if r.is_empty() => empty.push(format!("{what}: {expr}")),
            Ok(_) => {}
        }
    }
    // Recording rules are evaluated by Prometheus itself: their series must exist.
    for name in &records {
        match query(&client, &prom.url, name) {
            Err(e) => errors.push(format!("recorded series {name}: {e}")),
            Ok(r) if r.is_empty() => empty.push(format!("recorded series {name}")),
            Ok(_) => {}
        }
    }
    // Alert expressions must evaluate; whether they fire depends on thresholds and `for`.
    for (name, expr) in &alert_exprs {
        if let Err(e) = query(&client, &prom.url, expr) {
            errors.push(format!("alert {name}: {e}"));
        }
    }
    // Rule evaluation itself must be healthy.
    let health: Value = client
        .get(format!("{}/api/v1/rules", prom.url))
        .send()
        .unwrap()
        .json()
        .unwrap();
    for group in health["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            if rule["health"] != "ok" {
                errors.push(format!(
                    "rule {} health {}: {}",
                    rule["name"], rule["health"], rule["lastError"]
                ));
            }
        }
    }
    assert!(
        errors.is_empty(),
        "expressions failed:\n{}",
        errors.join("\n")
    );
    assert!(
        empty.is_empty(),
        "expressions returned no data under traffic that should light them up:\n{}",
        empty.join("\n")
    );

    // The per-tenant alert fired inside the daemon and is visible to Prometheus.
    let firing = query(
        &client,
        &prom.url,
        "admitd_alert_firing{tenant=\"acme\"} == 1",
    )
    .unwrap();
    assert_eq!(
        firing.len(),
        1,
        "acme's shed-ratio alert is not firing: {firing:?}"
    );
}
