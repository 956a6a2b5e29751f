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

// ---- the state file ---------------------------------------------------------------------------------

/// A config keeping state at `path`, written every `interval`: subjects have a daily quota of 2,
/// upstream `u` a budget whose 429s put it in the penalty box, and agent runs a budget of $1.
fn kept_config(path: &std::path::Path, interval: &str) -> String {
    format!(
        "[state]\npath = {:?}\ninterval = \"{interval}\"\n\
         [limits.subject]\ndaily_quota = 2\n\
         [upstreams.u]\nrate = \"10/s\"\nburst = 10\n\
         [spend.usd]\nestimate = 0.5\nrun = 1\ntenant_daily = 10\n",
        path.display().to_string()
    )
}

/// Spends run "r-1"'s whole budget in one call that cost more than its estimate.
fn spend_run(d: &Daemon) {
    let run = json!({"tenant": "t", "subject": "runner", "tool": "x", "run": "r-1"});
    let a = d.admit(run.clone());
    assert_eq!(a.status, 200, "{:?}", a.body);
    let lease = a.body["lease_id"].as_str().unwrap();
    let spent = json!({"lease_id": lease, "outcome": "ok", "spent": {"usd": 1.0}});
    assert_eq!(d.post("/v1/release", spent).status, 200);
    assert_run_spent(d);
}

/// The run's budget is spent, and the tenant's day counts the dollar (and the estimates of $0.50 of
/// the two calls that spent the quota).
fn assert_run_spent(d: &Daemon) {
    let run = json!({"tenant": "t", "subject": "runner", "tool": "x", "run": "r-1"});
    let a = d.admit(run);
    assert_eq!(a.status, 429, "{:?}", a.body);
    assert_eq!(a.body["scope"], "spend");
    assert_eq!(a.body["budget"], "run");
    let t = d.get("/v1/tenants/t");
    assert_eq!(t.body["spend"][0]["day_spent"], 2.0, "{:?}", t.body);
}

/// Spends subject "bot"'s quota of 2 and checks the third call is refused for it.
fn spend_quota(d: &Daemon) {
    for _ in 0..2 {
        let a = d.admit(call("t", "bot", 0));
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(d.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    }
    assert_quota_spent(d);
}

fn assert_quota_spent(d: &Daemon) {
    let a = d.admit(call("t", "bot", 0));
    assert_eq!(a.status, 429, "{:?}", a.body);
    assert_eq!(a.body["scope"], "daily_quota");
}

fn stop(d: &mut Daemon, signal: &str) {
    d.signal(signal);
    let status = exits_within(d, Instant::now(), Duration::from_secs(5));
    if signal == "TERM" {
        assert!(status.success(), "exit status {status}");
    }
}

#[cfg(unix)]
#[test]
fn a_spent_quota_stays_spent_across_sigterm_and_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    // A long interval: only the write at shutdown can have kept it.
    let config = kept_config(&path, "1h");
    let mut d = Daemon::start(&config);
    spend_quota(&d);
    spend_run(&d);
    stop(&mut d, "TERM");
    let text = std::fs::read_to_string(&path).expect("the state file is there");
    let file: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(file["format"], "admitd-state");
    assert_eq!(file["version"], 1);

    let again = Daemon::start(&config);
    assert_quota_spent(&again);
    assert_run_spent(&again);
    // Another subject is untouched.
    assert_eq!(again.admit(call("t", "other", 0)).status, 200);
    assert!(again.logged("state restored", Duration::from_secs(1)));
}

#[cfg(unix)]
#[test]
fn a_spent_quota_stays_spent_across_kill_9_after_one_interval() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    let config = kept_config(&path, "300ms");
    let mut d = Daemon::start(&config);
    spend_quota(&d);
    spend_run(&d);
    // One interval (and some slack for a busy machine), then no chance to write anything more.
    std::thread::sleep(Duration::from_millis(1200));
    stop(&mut d, "KILL");
    let again = Daemon::start(&config);
    assert_quota_spent(&again);
    assert_run_spent(&again);
}

#[cfg(unix)]
#[test]
fn an_upstream_penalty_survives_a_restart_until_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    let config = kept_config(&path, "1h");
    let mut d = Daemon::start(&config);
    let body = json!({"tenant": "t", "subject": "s", "tool": "x", "upstream": "u"});
    let a = d.admit(body.clone());
    assert_eq!(a.status, 200);
    let r = d.post(
        "/v1/release",
        json!({"lease_id": a.body["lease_id"], "outcome": "upstream_rate_limited",
               "upstream_status": 429, "retry_after": "30"}),
    );
    assert_eq!(r.status, 200);
    stop(&mut d, "TERM");

    let again = Daemon::start(&config);
    let a = again.admit(body);
    assert_eq!(a.status, 429, "{:?}", a.body);
    assert_eq!(a.body["scope"], "upstream_penalty");
    let wait = a.body["retry_after_ms"].as_u64().unwrap();
    assert!((15_000..=31_000).contains(&wait), "{wait}");
}

/// Starts the binary expecting it to refuse: its exit code and what it wrote.
fn refused_start(config: &str) -> (i32, String) {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::io::Write::write_all(&mut f, config.as_bytes()).unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(f.path())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_missing_state_directory_stops_the_start_with_a_readable_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nowhere").join("state");
    let (code, err) = refused_start(&kept_config(&path, "5s"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert!(
        err.contains(&dir.path().join("nowhere").display().to_string()),
        "{err}"
    );
}

#[test]
fn a_state_file_of_a_newer_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    std::fs::write(
        &path,
        br#"{"format":"admitd-state","version":99,"tenants":[]}"#,
    )
    .unwrap();
    let (code, err) = refused_start(&kept_config(&path, "5s"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("format version 99, newer"), "{err}");
    // Left as it was, for the newer admitd.
    assert!(std::fs::read_to_string(&path).unwrap().contains("99"));
}

fn damaged_file_gives_a_fresh_start(content: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    std::fs::write(&path, content).unwrap();
    let d = Daemon::start(&kept_config(&path, "5s"));
    assert!(
        d.logged("the state file cannot be read", Duration::from_secs(2)),
        "{:?}",
        d.log_lines()
    );
    assert_eq!(d.admit(call("t", "bot", 0)).status, 200, "a fresh start");
    assert!(dir.path().join("state.corrupt").exists(), "set aside");
    // A good file is in its place again.
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("admitd-state"), "{text}");
}

#[test]
fn a_truncated_state_file_gives_a_logged_fresh_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state");
    let mut d = Daemon::start(&kept_config(&path, "1h"));
    spend_quota(&d);
    stop(&mut d, "TERM");
    let full = std::fs::read(&path).unwrap();
    damaged_file_gives_a_fresh_start(&full[..full.len() / 2]);
}

#[test]
fn a_garbage_state_file_gives_a_logged_fresh_start() {
    damaged_file_gives_a_fresh_start(b"\x00\x01 this is not a state file \xff\xfe");
}
