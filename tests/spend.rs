//! Spend budgets over HTTP against the real binary: a looping agent run stopped at its budget,
//! parallel calls of one run that cannot overshoot, settlement at release (spend and cost), bad
//! spend input (400, nothing changed, the lease still releasable) and the tenant snapshot.

mod common;

use std::time::Duration;

use common::{eventually, metric, Daemon};
use serde_json::{json, Value};

const CONFIG: &str = r#"
[limits.subject]
rate = "1000/s"
burst = 1000
concurrency = 200
[limits.tenant]
rate = "1000/s"
burst = 1000
concurrency = 200
[spend.usd]
estimate = 0.01
tenant_daily = 50
run = 1.0
currency = "$"
[spend.tokens]
estimate = 0
subject_daily = 100000
[tools.summarize.spend]
usd = 0.05
"#;

fn call(run: &str) -> Value {
    json!({"tenant": "acme", "subject": "bot", "tool": "summarize", "run": run, "max_wait_ms": 0})
}

fn release(d: &Daemon, lease: &str, extra: Value) -> common::Answer {
    let mut body = json!({"lease_id": lease, "outcome": "ok"});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    d.post("/v1/release", body)
}

#[test]
fn a_looping_run_stops_at_its_budget_with_a_refusal_that_is_not_retryable() {
    let d = Daemon::start(CONFIG);
    let mut admitted = 0;
    let refusal = loop {
        let a = d.admit(call("r-17"));
        if a.status != 200 {
            break a;
        }
        admitted += 1;
        assert!(admitted <= 20, "the run overshot its budget");
        let usd = &a.body["spend"]["usd"];
        assert_eq!(usd["reserved"], 0.05, "{}", a.body);
        assert_eq!(usd["budget"], "run");
        let lease = a.body["lease_id"].as_str().unwrap();
        assert_eq!(release(&d, lease, json!({})).status, 200);
    };
    assert_eq!(admitted, 20);
    assert_eq!(refusal.status, 429);
    let b = &refusal.body;
    assert_eq!(b["scope"], "spend", "{b}");
    assert_eq!(b["unit"], "usd");
    assert_eq!(b["budget"], "run");
    assert_eq!(b["remaining"], 0.0);
    assert_eq!(b["retryable"], false);
    assert_eq!(b["retry_after_ms"], 0);
    assert!(refusal.header("retry-after").is_none());
    let tr = &b["tool_result"];
    assert_eq!(tr["isError"], true);
    assert_eq!(tr["structuredContent"]["unit"], "usd");
    let text = tr["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("$1") && text.contains("task"), "{text}");
    assert!(text.contains("Waiting will not help"), "{text}");
    assert!(!text.contains("acme") && !text.contains("bot"), "{text}");

    // The snapshot and the metrics show what was spent.
    let t = d.get("/v1/tenants/acme");
    let usd = t.body["spend"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["unit"] == "usd")
        .unwrap()
        .clone();
    assert!(
        (usd["day_spent"].as_f64().unwrap() - 1.0).abs() < 1e-9,
        "{usd}"
    );
    assert_eq!(usd["tenant_daily"], 50.0);
    let spent = eventually(Duration::from_secs(10), || {
        let m = d.get("/metrics").body.as_str().unwrap_or("").to_string();
        metric(&m, "admitd_spend_total{tenant=\"acme\",unit=\"usd\"}")
            .is_some_and(|x| (x - 1.0).abs() < 1e-9)
            && metric(
                &m,
                "admitd_spend_daily_remaining{tenant=\"acme\",unit=\"usd\"}",
            )
            .is_some_and(|x| (x - 49.0).abs() < 1e-9)
    });
    assert!(
        spent,
        "{}",
        d.get("/metrics").body.as_str().unwrap_or("").to_string()
    );
}

#[test]
fn parallel_calls_of_one_run_cannot_overshoot() {
    let d = std::sync::Arc::new(Daemon::start(CONFIG));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let d = d.clone();
            std::thread::spawn(move || {
                (0..10)
                    .filter(|_| d.admit(call("r-par")).status == 200)
                    .count()
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    // None released: 20 reservations of 0.05 fill the run's 1.0.
    assert_eq!(admitted, 20);
}

#[test]
fn release_settles_the_actual_figures_and_a_cache_hit_costs_nothing() {
    let d = Daemon::start(&format!(
        "{CONFIG}\n[tools.cached]\nrate = \"1/h\"\nburst = 1\n"
    ));
    let a = d.admit(
        json!({"tenant": "acme", "subject": "bot", "tool": "summarize", "run": "r",
        "spend": {"usd": 0.5, "tokens": 3000}}),
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["spend"]["usd"]["remaining"], 0.5);
    assert_eq!(a.body["spend"]["tokens"]["remaining"], 97000.0);
    assert_eq!(a.body["spend"]["tokens"]["budget"], "subject_daily");
    let lease = a.body["lease_id"].as_str().unwrap();
    let r = release(&d, lease, json!({"spent": {"usd": 0.1, "tokens": 1234}}));
    assert_eq!(r.status, 200);
    let a = d.admit(call("r"));
    assert_eq!(a.body["spend"]["usd"]["remaining"], 0.85, "{}", a.body);
    assert_eq!(a.body["spend"]["tokens"]["remaining"], 98766.0);
    // A tool with a bucket of one call an hour answers from its cache three times: each release
    // with cost 0 gives the token back.
    for _ in 0..3 {
        let a = d
            .admit(json!({"tenant": "acme", "subject": "bot", "tool": "cached", "max_wait_ms": 0}));
        assert_eq!(a.status, 200, "{}", a.body);
        let lease = a.body["lease_id"].as_str().unwrap();
        assert_eq!(release(&d, lease, json!({"cost": 0})).status, 200);
    }
    let a =
        d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "cached", "max_wait_ms": 0}));
    let lease = a.body["lease_id"].as_str().unwrap();
    assert_eq!(release(&d, lease, json!({})).status, 200);
    let a =
        d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "cached", "max_wait_ms": 0}));
    assert_eq!(a.status, 429);
    assert_eq!(a.body["scope"], "subject_tool");
}

#[test]
fn bad_spend_input_is_a_400_that_changes_nothing() {
    let d = Daemon::start(CONFIG);
    for body in [
        json!({"tenant": "acme", "subject": "bot", "tool": "t", "spend": {"eur": 1}}),
        json!({"tenant": "acme", "subject": "bot", "tool": "t", "spend": {"usd": -1}}),
        json!({"tenant": "acme", "subject": "bot", "tool": "t", "spend": {"usd": "a lot"}}),
        json!({"tenant": "acme", "subject": "bot", "tool": "t", "spend": [1]}),
        json!({"tenant": "acme", "subject": "bot", "tool": "t", "run": "a\u{7}b"}),
        json!({"tenant": "acme", "subject": "bot", "tool": "t", "run": "x".repeat(129)}),
    ] {
        let a = d.admit(body.clone());
        assert_eq!(a.status, 400, "{body}: {}", a.body);
        assert_eq!(a.body["error"], "invalid_request", "{}", a.body);
        assert!(a.body["message"].as_str().unwrap().len() > 10);
    }
    let huge = d.post_raw(
        "/v1/admit",
        "application/json",
        br#"{"tenant":"acme","subject":"bot","tool":"t","spend":{"usd":1e999}}"#.to_vec(),
    );
    assert_eq!(huge.status, 400, "{}", huge.body);

    let a = d.admit(call("r"));
    let lease = a.body["lease_id"].as_str().unwrap().to_string();
    for extra in [
        json!({"spent": {"eur": 1}}),
        json!({"spent": {"usd": -0.5}}),
        json!({"spent": {"usd": null}}),
        json!({"cost": -1}),
        json!({"cost": "free"}),
    ] {
        let r = release(&d, &lease, extra.clone());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.body["error"], "invalid_request");
    }
    // Nothing changed: the lease is still live and releasable, and the run still holds only its
    // first reservation.
    assert_eq!(d.get("/v1/tenants/acme").body["leases"], 1);
    assert_eq!(
        release(&d, &lease, json!({"spent": {"usd": 0.05}})).status,
        200
    );
    let a = d.admit(call("r"));
    assert_eq!(a.body["spend"]["usd"]["remaining"], 0.9, "{}", a.body);
}

#[test]
fn a_spend_config_is_checked_at_its_line() {
    let dir = std::env::temp_dir().join(format!("admitd-spend-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, "[spend.usd]\nestimate = 0.01\nrun = -1\n").unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.toml:3: spend.usd.run must be a number from 0 to 1e15"),
        "{err}"
    );
    std::fs::write(&path, CONFIG).unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("1 tools, 0 upstreams, 2 spend units; mode enforce"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_idle_run_is_forgotten_after_run_idle() {
    let d =
        Daemon::start(&CONFIG.replace("currency = \"$\"", "currency = \"$\"\nrun_idle = \"1s\""));
    let a = d.admit(call("r-idle"));
    let lease = a.body["lease_id"].as_str().unwrap();
    assert_eq!(
        release(&d, lease, json!({"spent": {"usd": 1.0}})).status,
        200
    );
    let refused = d.admit(call("r-idle"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["budget"], "run");
    // A second (and some slack for a busy machine) after its last admitted call, the run starts over.
    std::thread::sleep(Duration::from_millis(2000));
    let again = d.admit(call("r-idle"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["spend"]["usd"]["remaining"], 0.95);
}
