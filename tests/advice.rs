//! `GET /v1/advice` and `admitd advise` against the real binary: 30 ordinary agents and one
//! runaway on a config that is too tight, in shadow mode.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{with_admin, Daemon, ADMIN_TOKEN};
use serde_json::{json, Value};

const TOO_TIGHT: &str = r#"
[server]
mode = "shadow"

[limits.subject]
rate = "30/min"
burst = 2
"#;

fn get_admin(d: &Daemon, path: &str) -> (u16, Value) {
    let r = d
        .client
        .get(d.url(path))
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .send()
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// One call: admitted (in shadow mode always), then released after `run_ms`.
fn call(client: &reqwest::blocking::Client, d: &Daemon, subject: &str, run_ms: u64) {
    let r: Value = client
        .post(d.url("/v1/admit"))
        .json(&json!({"tenant": "acme", "subject": subject, "tool": "search"}))
        .send()
        .and_then(|r| r.json())
        .expect("admit");
    if let Some(lease) = r["lease_id"].as_str() {
        let _ = client
            .post(d.url("/v1/release"))
            .json(&json!({"lease_id": lease, "outcome": "ok", "duration_ms": run_ms}))
            .send();
    }
}

fn cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::bin())
        .args(args)
        .output()
        .expect("run admitd");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn advice_proposes_the_ordinary_numbers_and_names_only_the_runaway_under_them() {
    let d = Daemon::start(&with_admin(TOO_TIGHT));
    let secs = 20;
    let start = Instant::now();
    std::thread::scope(|s| {
        for a in 0..30 {
            let d = &d;
            s.spawn(move || {
                let client = reqwest::blocking::Client::new();
                // Spread the agents over the 2 s cycle; each burst starts 2 s after the last
                // began, so a slow machine stretches the cycle and never squeezes two bursts.
                std::thread::sleep(Duration::from_millis(a * 66));
                while start.elapsed() < Duration::from_secs(secs) {
                    let began = Instant::now();
                    for _ in 0..4 {
                        call(&client, d, &format!("agent-{a:02}"), 20);
                    }
                    std::thread::sleep(Duration::from_secs(2).saturating_sub(began.elapsed()));
                }
            });
        }
        s.spawn(|| {
            let client = reqwest::blocking::Client::new();
            while start.elapsed() < Duration::from_secs(secs) {
                call(&client, &d, "runaway", 5);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
    });

    let (status, a) = get_admin(&d, "/v1/advice?over=15s");
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["over_s"], 15.0, "{a}");
    let subject = &a["limits"]["subject"];
    let rate = subject["rate"].as_str().expect("a rate");
    let per_min: f64 = rate
        .strip_suffix("/min")
        .expect("per minute")
        .parse()
        .unwrap();
    // The ordinary agents make 2 calls a second: about 2 x that, whatever the runaway did.
    assert!((180.0..=330.0).contains(&per_min), "{subject}");
    let burst = subject["burst"].as_u64().unwrap();
    assert!((4..=8).contains(&burst), "{subject}");
    assert!(
        subject["from"]["rate"]
            .as_str()
            .unwrap()
            .contains("of 31 subjects"),
        "{subject}"
    );

    let names = |list: &Value| -> Vec<String> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|w| w["subject"].as_str().unwrap().to_string())
            .collect()
    };
    let proposed = names(&a["would_shed"]["proposed"]);
    assert_eq!(proposed, ["runaway"], "{}", a["would_shed"]);
    let current = names(&a["would_shed"]["current"]);
    assert!(current.contains(&"runaway".to_string()), "{current:?}");
    let ordinary = current.iter().filter(|s| s.starts_with("agent-")).count();
    assert_eq!(ordinary, 30, "{current:?}");

    // The toml is a config admitd accepts, and keeps what the advice does not change.
    let toml = a["toml"].as_str().unwrap();
    assert!(toml.contains("mode = \"shadow\""), "{toml}");
    assert!(toml.contains("admin_token_sha256"), "{toml}");
    let file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::fs::write(file.path(), toml).unwrap();
    let (ok, out, err) = cli(&["check", "--config", &file.path().display().to_string()]);
    assert!(ok, "{out}{err}");

    // The command line prints the same proposal, with where each number came from.
    let url = format!("http://{}", d.addr);
    let (ok, out, err) = cli(&[
        "advise",
        "--url",
        &url,
        "--over",
        "15s",
        "--token",
        ADMIN_TOKEN,
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("# [limits.subject]"), "{out}");
    assert!(out.contains("95th percentile"), "{out}");
    assert!(
        out.contains("the proposal would refuse 1 subjects: acme/runaway"),
        "{out}"
    );
    assert!(out.contains("[limits.subject]\nrate = \""), "{out}");
}

#[test]
fn advice_is_an_admin_route_and_refuses_bad_queries() {
    let d = Daemon::start(&with_admin(TOO_TIGHT));
    assert_eq!(d.get("/v1/advice").status, 401);
    for bad in ["over=5mins", "over=0s", "format=xml", "window=1m"] {
        let (status, body) = get_admin(&d, &format!("/v1/advice?{bad}"));
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"], "invalid_request", "{bad}");
        assert!(body["message"].as_str().is_some(), "{bad}");
    }
    let r = d.post_admin("/v1/advice", json!({}));
    assert_eq!(r.status, 405);
    // Nothing seen yet: nothing proposed, the config as it is.
    let (status, body) = get_admin(&d, "/v1/advice?over=1m");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["calls"], 0);
    assert!(
        body["toml"].as_str().unwrap().contains("rate = \"30/min\""),
        "{body}"
    );
}

#[test]
fn replicas_of_one_store_each_advise_from_what_they_saw_and_advise_merges_them() {
    let redis = common::redis::RedisServer::start();
    let config = with_admin(&format!(
        "{TOO_TIGHT}\n[store]\nkind = \"redis\"\nurl = \"{}\"\n",
        redis.url()
    ));
    let a = Daemon::start(&config);
    let b = Daemon::start(&config);
    let client = reqwest::blocking::Client::new();
    for i in 0..6 {
        call(&client, &a, &format!("on-a-{}", i % 2), 10);
        call(&client, &b, &format!("on-b-{}", i % 3), 10);
    }
    let (status, one) = get_admin(&a, "/v1/advice?over=1m");
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["calls"], 6, "{one}");
    let notes = one["notes"].to_string();
    assert!(
        notes.contains("advises from the calls it decided itself"),
        "{notes}"
    );
    let (status, raw) = get_admin(&a, "/v1/advice?over=1m&format=raw");
    assert_eq!(status, 200, "{raw}");
    assert_eq!(raw["format"], "admitd-recording/1");
    assert_eq!(raw["period"]["calls"].as_array().unwrap().len(), 6, "{raw}");
    assert!(raw["config"].as_str().unwrap().contains("kind = \"redis\""));
    let urls = [format!("http://{}", a.addr), format!("http://{}", b.addr)];
    let (ok, out, err) = cli(&[
        "advise",
        "--url",
        &urls[0],
        "--url",
        &urls[1],
        "--over",
        "1m",
        "--token",
        ADMIN_TOKEN,
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("admitd advise: 12 calls"), "{out}");
    assert!(out.contains("the rates of 5 subjects"), "{out}");
    assert!(out.contains("merged from 2 replicas"), "{out}");
    assert!(out.contains("[store]\nkind = \"redis\""), "{out}");
    // A daemon that is not there is an error, not a hang.
    let (ok, _, err) = cli(&[
        "advise",
        "--url",
        "http://127.0.0.1:1",
        "--token",
        ADMIN_TOKEN,
    ]);
    assert!(!ok);
    assert!(err.contains("cannot connect"), "{err}");
}
