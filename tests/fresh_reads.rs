//! What a call changed is visible to the very next read: `GET /metrics`, `GET /v1/alerts` and
//! `GET /v1/tenants/{tenant}` right after an answer include it, although telemetry leaves the workers
//! in batches and the tenant actors report their call counts once a second.

mod common;

use common::{metric, Daemon};
use reqwest::blocking::Client;
use serde_json::json;

/// A second connection, so that reads and calls land on different worker threads as often as on the
/// same one (each connection is served by the worker that accepted it).
fn other_client() -> Client {
    Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Limits no test below reaches.
const ROOMY: &str = "[limits.subject]\nconcurrency = 1000\nrate = \"10000/s\"\nburst = 10000\n\
                     [limits.tenant]\nconcurrency = 1000\nrate = \"10000/s\"\nburst = 10000\n";

#[test]
fn a_scrape_right_after_a_call_counts_it_every_time() {
    let d = Daemon::start(ROOMY);
    let reader = other_client();
    let series = r#"admitd_admissions_total{tenant="acme",subject="bot",tool="search",upstream="none",decision="admitted",scope="none"}"#;
    for i in 1..=150u32 {
        let a = d
            .admit(json!({"tenant": "acme", "subject": "bot", "tool": "search", "max_wait_ms": 0}));
        assert_eq!(a.status, 200, "{}", a.body);
        // Every other scrape on the calls' own connection, the rest on another one.
        let text = match i % 2 {
            0 => d.get("/metrics").body.as_str().unwrap_or("").to_string(),
            _ => reader
                .get(d.url("/metrics"))
                .send()
                .unwrap()
                .text()
                .unwrap(),
        };
        assert_eq!(
            metric(&text, series),
            Some(f64::from(i)),
            "scrape after call {i} misses calls:\n{text}"
        );
        assert_eq!(
            metric(&text, "admitd_decision_duration_seconds_count"),
            Some(f64::from(i)),
            "scrape after call {i}"
        );
    }
}

#[test]
fn alerts_right_after_the_calls_that_raise_them_list_them() {
    // Every shed raises the alert at once: no hold time, one call in the window is enough.
    let d = Daemon::start(
        "[limits.subject]\nrate = \"1/h\"\nburst = 1\n[alerts]\nshed_ratio = 0.5\nfor = \"0s\"\nmin_calls = 3\n",
    );
    let reader = other_client();
    for i in 0..20 {
        let tenant = format!("loop{i}");
        let statuses: Vec<u16> = (0..3)
            .map(|_| {
                d.admit(
                    json!({"tenant": tenant, "subject": "bot", "tool": "search", "max_wait_ms": 0}),
                )
                .status
            })
            .collect();
        assert_eq!(statuses, [200, 429, 429]);
        let alerts: serde_json::Value = match i % 2 {
            0 => d.get("/v1/alerts").body,
            _ => reader
                .get(d.url("/v1/alerts"))
                .send()
                .unwrap()
                .json()
                .unwrap(),
        };
        let listed = alerts["alerts"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["tenant"] == tenant.as_str()));
        assert!(
            listed,
            "{tenant} shed 2 of 3 calls but is not listed: {alerts}"
        );
    }
}

#[test]
fn a_tenant_snapshot_right_after_a_call_shows_its_lease() {
    let d = Daemon::start(ROOMY);
    let reader = other_client();
    for i in 1..=60u64 {
        let a = d
            .admit(json!({"tenant": "acme", "subject": "bot", "tool": "search", "max_wait_ms": 0}));
        assert_eq!(a.status, 200, "{}", a.body);
        let snap: serde_json::Value = reader
            .get(d.url("/v1/tenants/acme"))
            .send()
            .unwrap()
            .json()
            .unwrap();
        assert_eq!(snap["inflight"], i, "after call {i}: {snap}");
    }
}
