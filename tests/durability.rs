//! Stopping and starting again, run against the real binary: graceful shutdown with calls held at the
//! moment of the signal, and the state file that keeps quotas, penalties and adaptive rates across
//! restarts in memory mode.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

fn call(tenant: &str, subject: &str, wait_ms: u64) -> Value {
    json!({"tenant": tenant, "subject": subject, "tool": "x", "max_wait_ms": wait_ms})
}

/// Sends an admission from a thread of its own: (status, body).
fn admit_in_background(
    d: &Daemon,
    body: Value,
) -> std::thread::JoinHandle<Result<(u16, Value), String>> {
    let (client, url) = (d.client.clone(), d.url("/v1/admit"));
    std::thread::spawn(move || {
        let r = client
            .post(url)
            .json(&body)
            .send()
            .map_err(|e| e.to_string())?;
        let status = r.status().as_u16();
        Ok((status, r.json().unwrap_or(Value::Null)))
    })
}

/// Waits for the daemon to exit by itself within `limit` of `since`; its exit status.
fn exits_within(d: &mut Daemon, since: Instant, limit: Duration) -> std::process::ExitStatus {
    loop {
        if let Some(status) = d.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            since.elapsed() < limit,
            "admitd still runs {:?} after the signal; log: {:?}",
            since.elapsed(),
            d.log_lines()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(unix)]
fn shutdown_answers_every_held_call(signal: &str) {
    // max_wait 2 s. Subject "c" has one concurrency slot; subject "b" one token a second.
    let mut d = Daemon::start(
        "[server]\nmax_wait = \"2s\"\n\
         [limits.subject]\nrate = \"1/s\"\nburst = 1\nconcurrency = 1\n",
    );
    let first = d.admit(call("t", "c", 0));
    assert_eq!(first.status, 200, "{:?}", first.body);
    let lease = first.body["lease_id"].as_str().unwrap().to_string();
    // Two calls queue for "c"'s slot (the first of them gets it when the lease is released), one is
    // held for "b"'s next token (about a second), one for a token it cannot get within its wait.
    let b = d.admit(call("t", "b", 0));
    assert_eq!(b.status, 200);
    assert_eq!(d.release(b.body["lease_id"].as_str().unwrap()).status, 200);
    let slot_freed = admit_in_background(&d, call("t", "c", 2000));
    std::thread::sleep(Duration::from_millis(50));
    let slot_never = admit_in_background(&d, call("t", "c", 1500));
    let token = admit_in_background(&d, call("t", "b", 2000));
    std::thread::sleep(Duration::from_millis(300));

    let signalled = Instant::now();
    d.signal(signal);
    // Not ready from the moment shutdown starts; new admissions are refused with the 503 a caller
    // can act on; releases still work (and free the slot for the first queued call).
    assert!(
        common::eventually(Duration::from_millis(500), || d.get("/readyz").status
            == 503),
        "/readyz did not turn 503"
    );
    let late = d.admit(call("t", "z", 0));
    assert_eq!(late.status, 503, "{:?}", late.body);
    assert_eq!(late.body["error"], "shutting_down");
    assert_eq!(late.body["tool_result"]["isError"], true);
    assert_eq!(late.header("retry-after").as_deref(), Some("1"));
    assert_eq!(d.release(&lease).status, 200);

    let (status, body) = slot_freed.join().unwrap().expect("answered");
    assert_eq!(status, 200, "the slot freed within its wait: {body}");
    let (status, body) = token.join().unwrap().expect("answered");
    assert_eq!(status, 200, "the token came within its wait: {body}");
    let (status, body) = slot_never.join().unwrap().expect("answered");
    assert_eq!(status, 429, "no slot within its wait: {body}");
    assert_eq!(body["scope"], "concurrency");

    let status = exits_within(&mut d, signalled, Duration::from_secs(3));
    assert!(status.success(), "exit status {status}");
    assert!(d.logged("shutting down", Duration::from_secs(1)));
}

#[cfg(unix)]
#[test]
fn sigterm_answers_every_held_call_and_exits_within_max_wait_and_a_second() {
    shutdown_answers_every_held_call("TERM");
}

#[cfg(unix)]
#[test]
fn sigint_answers_every_held_call_and_exits_within_max_wait_and_a_second() {
    shutdown_answers_every_held_call("INT");
}

#[cfg(unix)]
#[test]
fn an_idle_daemon_exits_at_once_on_sigterm() {
    let mut d = Daemon::start("[server]\nmax_wait = \"10s\"\n");
    assert_eq!(d.admit(call("t", "s", 0)).status, 200);
    let signalled = Instant::now();
    d.signal("TERM");
    let status = exits_within(&mut d, signalled, Duration::from_secs(2));
    assert!(status.success(), "exit status {status}");
}
