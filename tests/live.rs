//! The live view against the real binary: `GET /v1/tenants` (order, pages, who may see what).

mod common;

use std::time::Duration;

use common::{eventually, sha256_hex, Daemon};
use serde_json::{json, Value};

const METRICS_TOKEN: &str = "live-scraper";
const ADMIN: &str = "live-admin";
const ACME_KEY: &str = "acme-own-key";

/// Tight subject buckets so that a loop of calls is shed, with the metrics and admin tokens set and
/// an `[edge]` key for tenant acme.
fn config() -> String {
    format!(
        r#"[server]
metrics_token_sha256 = "{}"
admin_token_sha256 = "{}"
[limits.subject]
rate = "1/min"
burst = 2
[alerts]
window = "1m"
for = "0s"
min_calls = 5
[edge]
[[edge.api_keys]]
sha256 = "{}"
tenant = "acme"
subject = "acme-bot"
"#,
        sha256_hex(METRICS_TOKEN),
        sha256_hex(ADMIN),
        sha256_hex(ACME_KEY)
    )
}

fn get(d: &Daemon, path: &str, token: Option<&str>) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut r = d.client.get(d.url(path));
    if let Some(t) = token {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    let r = r.send().expect("request");
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, r.json().unwrap_or(Value::Null), headers)
}

/// `calls` admissions of `tenant`, each by a subject of its own (`spread`) or all by one subject.
fn call(d: &Daemon, tenant: &str, calls: usize, spread: bool) {
    for i in 0..calls {
        let subject = if spread {
            format!("s{i}")
        } else {
            "bot".into()
        };
        let a =
            d.admit(json!({"tenant": tenant, "subject": subject, "tool": "t", "max_wait_ms": 0}));
        assert!(a.status == 200 || a.status == 429, "{}", a.body);
    }
}

fn names(v: &Value) -> Vec<String> {
    v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["tenant"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn tenants_are_listed_most_shed_first_in_pages_and_only_to_who_may_see_them() {
    let d = Daemon::start(&config());
    // looping: one subject, 20 calls, 18 shed. acme: 10 calls by 10 subjects and 5 by one, 3
    // shed. quiet: 3 calls, none shed.
    call(&d, "looping", 20, false);
    call(&d, "acme", 10, true);
    call(&d, "acme", 5, false);
    call(&d, "quiet", 3, true);

    // The counts reach the view with the tenants' reports, once a second.
    let mut last = Value::Null;
    let settled = eventually(Duration::from_secs(10), || {
        last = get(&d, "/v1/tenants", Some(METRICS_TOKEN)).1;
        last["total"] == 3 && last["tenants"][0]["shed"] == 18 && last["tenants"][1]["shed"] == 3
    });
    assert!(settled, "{last}");
    assert_eq!(names(&last), ["looping", "acme", "quiet"]);
    let looping = &last["tenants"][0];
    assert_eq!(looping["admitted"], 2);
    assert_eq!(looping["shed_ratio"], 0.9);
    assert_eq!(looping["top_scope"], "subject");
    assert_eq!(looping["top_scope_shed"], 18);
    assert_eq!(looping["inflight"], 2, "two leases were never released");
    assert_eq!(looping["alerts"], json!(["shed_ratio_high"]));
    assert_eq!(last["tenants"][2]["shed"], 0);
    assert_eq!(last["tenants"][2]["top_scope"], Value::Null);
    assert_eq!(last["next"], Value::Null);
    assert_eq!(last["sort"], "shed_ratio");

    // Another documented order; the admin token sees everything too.
    let (s, v, _) = get(&d, "/v1/tenants?sort=admitted", Some(ADMIN));
    assert_eq!(s, 200, "{v}");
    assert_eq!(names(&v), ["acme", "quiet", "looping"]);

    // Pages of one, following `next`, give the same order once each.
    let mut seen = Vec::new();
    let mut path = "/v1/tenants?limit=1".to_string();
    loop {
        let (s, v, _) = get(&d, &path, Some(METRICS_TOKEN));
        assert_eq!(s, 200, "{v}");
        seen.extend(names(&v));
        match v["next"].as_str() {
            Some(next) => path = format!("/v1/tenants?limit=1&next={next}"),
            None => break,
        }
    }
    assert_eq!(seen, ["looping", "acme", "quiet"]);

    // No token, a caller's or a wrong one: 401 with the scheme to use.
    for token in [None, Some("wrong")] {
        let (s, v, h) = get(&d, "/v1/tenants", token);
        assert_eq!(s, 401, "{v}");
        assert_eq!(v["error"], "unauthorized");
        assert_eq!(h.get("www-authenticate").unwrap(), "Bearer");
    }
    // acme's own key shows acme alone: no other tenant's name in the answer.
    let (s, v, _) = get(&d, "/v1/tenants", Some(ACME_KEY));
    assert_eq!(s, 200, "{v}");
    assert_eq!(names(&v), ["acme"]);
    assert_eq!(v["total"], 1);
    let text = v.to_string();
    assert!(
        !text.contains("looping") && !text.contains("quiet"),
        "{text}"
    );

    // Bad queries are a 400 with the error body.
    for q in ["sort=colour", "limit=0", "limit=5000", "next=zz", "page=2"] {
        let (s, v, _) = get(&d, &format!("/v1/tenants?{q}"), Some(METRICS_TOKEN));
        assert_eq!(
            (s, v["error"].as_str()),
            (400, Some("invalid_request")),
            "{q}: {v}"
        );
    }
    // A wrong method names the right one.
    let r = d
        .client
        .post(d.url("/v1/tenants"))
        .header("authorization", format!("Bearer {METRICS_TOKEN}"))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers().get("allow").unwrap(), "GET, HEAD");
}

#[test]
fn without_a_metrics_token_the_view_is_open_like_metrics() {
    let d = Daemon::start("[limits.subject]\nrate = \"1/min\"\nburst = 1\n");
    call(&d, "solo", 3, false);
    let mut v = Value::Null;
    assert!(
        eventually(Duration::from_secs(10), || {
            v = get(&d, "/v1/tenants", None).1;
            v["tenants"][0]["shed"] == 2
        }),
        "{v}"
    );
    assert_eq!(names(&v), ["solo"]);
    // No spend budget is configured: no spend in the view.
    assert!(v["tenants"][0].get("spend_left").is_none(), "{v}");
}

/// With a `tenant_daily` budget, each listed tenant shows what it has left today: the reservations
/// of its calls in flight and what its released calls actually spent, the same figure as the
/// `admitd_spend_daily_remaining` gauge. A unit without such a budget is not shown.
#[test]
fn spend_left_shows_what_each_tenants_daily_budget_has_left() {
    let d = Daemon::start(
        "[limits.subject]\nrate = \"100/s\"\nburst = 100\n\
         [spend.usd]\nestimate = 0.5\ntenant_daily = 5\n\
         [spend.tokens]\nestimate = 100\n",
    );
    let mut leases = Vec::new();
    for _ in 0..3 {
        let a = d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "t", "max_wait_ms": 0}));
        assert_eq!(a.status, 200, "{}", a.body);
        leases.push(a.body["lease_id"].as_str().unwrap().to_string());
    }
    let r = d.post(
        "/v1/release",
        json!({"lease_id": leases[0], "outcome": "ok", "spent": {"usd": 0.25}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // Two reservations of 0.5 and one call that spent 0.25: 3.75 of 5 left.
    let mut v = Value::Null;
    assert!(
        eventually(Duration::from_secs(10), || {
            v = get(&d, "/v1/tenants", None).1;
            v["tenants"][0]["spend_left"] == json!({"usd": 3.75})
        }),
        "{v}"
    );
    // The gauge is set from the same report, by another actor: it may follow a moment later.
    let mut metrics = String::new();
    assert!(
        eventually(Duration::from_secs(10), || {
            metrics = d.get("/metrics").body.as_str().unwrap_or("").to_string();
            common::metric(
                &metrics,
                "admitd_spend_daily_remaining{tenant=\"acme\",unit=\"usd\"}",
            ) == Some(3.75)
        }),
        "{metrics}"
    );
    // `admitd top` shows it in a column of its own.
    let (ok, out, err) = top(&["--url", &format!("http://{}", d.addr)], &[]);
    assert!(ok, "{err}");
    assert!(out.contains("SPEND LEFT"), "{out}");
    let acme = out.lines().find(|l| l.starts_with("acme ")).expect("acme");
    assert!(acme.contains("  usd 3.75 "), "{out}");
}

/// `admitd top --once` with these arguments and environment: (exit success, stdout, stderr).
fn top(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = std::process::Command::new(common::bin())
        .arg("top")
        .arg("--once")
        .args(args)
        .env_remove("ADMITD_TOKEN")
        .envs(env.iter().copied())
        .output()
        .expect("run admitd top");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn top_once_shows_the_looping_tenant_above_the_quiet_one() {
    let d = Daemon::start(&config());
    call(&d, "looping", 20, false);
    call(&d, "quiet", 3, true);
    let url = format!("http://{}", d.addr);
    let mut shown = String::new();
    let ok = eventually(Duration::from_secs(10), || {
        let (ok, out, err) = top(&["--url", &url], &[("ADMITD_TOKEN", METRICS_TOKEN)]);
        assert!(ok, "{err}");
        shown = out;
        shown.contains("looping") && shown.contains("quiet") && shown.contains("18 ")
    });
    assert!(ok, "{shown}");
    let lines: Vec<&str> = shown.lines().collect();
    assert!(lines[0].contains("store: memory (ready)"), "{shown}");
    assert!(
        lines[0].contains("tenants: 2") && lines[0].contains("alerts firing: 1"),
        "{shown}"
    );
    let looping = lines
        .iter()
        .position(|l| l.starts_with("looping "))
        .unwrap();
    let quiet = lines.iter().position(|l| l.starts_with("quiet ")).unwrap();
    assert!(looping < quiet, "{shown}");
    let cols: Vec<&str> = lines[looping].split_whitespace().collect();
    assert_eq!(
        cols[..6],
        ["looping", "90.0", "2", "18", "subject", "(18)"],
        "{shown}"
    );
    assert_eq!(cols[7], "shed_ratio_high");
    let cols: Vec<&str> = lines[quiet].split_whitespace().collect();
    assert_eq!(cols[..5], ["quiet", "0.0", "3", "0", "-"], "{shown}");
    // The token from a file works as well; no token is an error that says what to do.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, format!("{ADMIN}\n")).unwrap();
    let (ok, out, err) = top(
        &["--url", &url, "--token-file", file.to_str().unwrap()],
        &[],
    );
    assert!(ok && out.contains("looping"), "{out}{err}");
    let (ok, _, err) = top(&["--url", &url], &[]);
    assert!(!ok);
    assert!(
        err.contains("needs a token") && err.contains("--token-file"),
        "{err}"
    );
}

#[test]
fn top_reaches_a_daemon_on_its_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("admitd.sock");
    let cfg = dir.path().join("admitd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nlisten = \"unix:{}\"\n[limits.subject]\nrate = \"1/min\"\nburst = 1\n",
            sock.display()
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(common::bin())
        .args(["serve", "--config", cfg.to_str().unwrap()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("unix:{}", sock.display());
    let up = eventually(Duration::from_secs(20), || top(&["--url", &url], &[]).0);
    assert!(up, "the daemon did not come up on {url}");
    // Calls over the socket too: admitd top is the only client here that speaks it.
    for _ in 0..4 {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let body = r#"{"tenant":"sock-tenant","subject":"bot","tool":"t","max_wait_ms":0}"#;
        write!(s, "POST /v1/admit HTTP/1.1\r\nhost: a\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
    }
    let mut shown = String::new();
    let ok = eventually(Duration::from_secs(10), || {
        shown = top(&["--url", &url], &[]).1;
        shown
            .lines()
            .any(|l| l.starts_with("sock-tenant ") && l.contains(" 75.0 "))
    });
    let _ = child.kill();
    let _ = child.wait();
    assert!(ok, "{shown}");
}
