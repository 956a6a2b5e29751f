//! Readiness that follows the shared store: an idle replica notices Redis stopped or hung within
//! the time docs/operations.md gives (about 10 s), its tenant snapshot is a 503 naming the store
//! meanwhile (not "holds no state"), it sheds nothing once Redis is back, and an admission that
//! `fail_open` lets through unchecked says so.

mod common;

use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{eventually, metric, Daemon};
use serde_json::{json, Value};

fn config(redis: &RedisServer, on_error: &str) -> String {
    format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"250ms\"\non_error = \"{on_error}\"\n",
        redis.url()
    )
}

fn call(tenant: &str) -> Value {
    json!({"tenant": tenant, "subject": "bot", "tool": "search", "max_wait_ms": 0})
}

/// How long until `/readyz` answers `status`, polled every 50 ms, at most `limit`.
fn readyz_becomes(d: &Daemon, status: u16, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    eventually(limit, || d.get("/readyz").status == status).then(|| started.elapsed())
}

/// The documented bound, with room for a loaded machine.
const NOTICE_WITHIN: Duration = Duration::from_secs(10);

#[test]
fn an_idle_replica_notices_a_stopped_redis_answers_snapshots_503_and_sheds_nothing_once_it_is_back()
{
    let mut redis = RedisServer::start();
    let d = Daemon::start(&config(&redis, "fail_closed"));
    let a = d.admit(call("acme"));
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(d.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    assert_eq!(d.get("/readyz").status, 200);
    assert_eq!(d.get("/v1/tenants/acme").status, 200);

    // Idle from here on: nothing but the probes below reaches the daemon.
    redis.stop();
    let took = readyz_becomes(&d, 503, NOTICE_WITHIN + Duration::from_secs(5));
    let took = took.expect("/readyz never said the store was down");
    assert!(took <= NOTICE_WITHIN, "noticed after {took:?}");
    let r = d.get("/readyz");
    assert_eq!(r.body["store"]["state"], "unreachable", "{}", r.body);

    // The state is out of reach, not absent: a 503 that names the store.
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(snap.status, 503, "{}", snap.body);
    assert_eq!(snap.body["error"], "store_unavailable");
    assert!(
        snap.body["message"].as_str().unwrap().contains("redis"),
        "{}",
        snap.body
    );
    // Also for a tenant this replica never saw.
    assert_eq!(d.get("/v1/tenants/initech").status, 503);

    redis.restart();
    let back = readyz_becomes(&d, 200, Duration::from_secs(10));
    assert!(back.is_some(), "/readyz never came back");
    // Ready means deciding on the store: the first calls after it are admitted, none shed.
    for i in 0..20 {
        let a = d.admit(call(&format!("t{i}")));
        assert_eq!(
            a.status, 200,
            "call {i} after the store came back: {}",
            a.body
        );
    }
    assert_eq!(d.get("/v1/tenants/t0").status, 200);
}

#[test]
fn an_idle_replica_notices_a_redis_that_stops_answering() {
    let redis = RedisServer::start();
    let d = Daemon::start(&config(&redis, "fail_closed"));
    assert_eq!(d.admit(call("acme")).status, 200);
    // Connections stay open and nothing answers, as with a hung or partitioned Redis.
    redis.pause();
    let took = readyz_becomes(&d, 503, NOTICE_WITHIN + Duration::from_secs(5));
    redis.resume();
    let took = took.expect("/readyz never said the store was down");
    assert!(took <= NOTICE_WITHIN, "noticed after {took:?}");
    assert!(readyz_becomes(&d, 200, Duration::from_secs(10)).is_some());
}

#[test]
fn an_admission_fail_open_lets_through_says_it_was_unchecked() {
    let mut redis = RedisServer::start();
    let d = Daemon::start(&config(&redis, "fail_open"));
    let checked = d.admit(call("acme"));
    assert_eq!(checked.status, 200, "{}", checked.body);
    assert_eq!(checked.body.get("unchecked"), None, "{}", checked.body);

    redis.stop();
    assert!(readyz_becomes(&d, 503, NOTICE_WITHIN).is_some());
    let a = d.admit(call("acme"));
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["unchecked"], true, "{}", a.body);
    assert_eq!(d.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    let m = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        metric(&m, "admitd_unchecked_admissions_total{tenant=\"acme\"}"),
        Some(1.0),
        "{m}"
    );

    redis.restart();
    assert!(readyz_becomes(&d, 200, Duration::from_secs(10)).is_some());
    let again = d.admit(call("acme"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(
        again.body.get("unchecked"),
        None,
        "checked again: {}",
        again.body
    );
}

/// `[store] timeout` is the bound on a slow answer, also above half a second: a call that Redis
/// answers after about 1.2 s, within a 3 s timeout, is decided on the store, and the store stays
/// up. (The client library's own response timeout, 500 ms unless set, used to cut such a call as a
/// broken connection and mark the store down, whatever the configured timeout said.)
#[test]
fn a_store_timeout_over_half_a_second_bounds_a_slow_answer_and_the_store_stays_up() {
    let redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"3s\"\non_error = \"fail_closed\"\n",
        redis.url()
    ));
    let a = d.admit(call("acme"));
    assert_eq!(a.status, 200, "{}", a.body);

    redis.pause();
    let slow = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(1200));
            redis.resume();
        });
        let started = Instant::now();
        let a = d.admit(call("acme"));
        (a, started.elapsed())
    });
    let (a, took) = slow;
    assert_eq!(a.status, 200, "after {took:?}: {}", a.body);
    assert!(a.body.get("unchecked").is_none(), "{}", a.body);
    assert!(took >= Duration::from_millis(1000), "answered in {took:?}");
    let r = d.get("/readyz");
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A release the store cannot answer is a 503 naming the store, not 404 "no such lease": the lease
/// may still hold its slots there, and a caller told "unknown" would never release it again.
#[test]
fn a_release_during_an_outage_is_a_503_naming_the_store() {
    let mut redis = RedisServer::start();
    let d = Daemon::start(&config(&redis, "fail_closed"));
    let a = d.admit(call("acme"));
    assert_eq!(a.status, 200, "{}", a.body);
    let lease = a.body["lease_id"].as_str().unwrap().to_string();

    redis.stop();
    let r = d.release(&lease);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["error"], "store_unavailable", "{}", r.body);
    assert!(
        r.body["message"].as_str().unwrap().contains("redis"),
        "{}",
        r.body
    );
    // Once the store is known to be down, the same answer, at once.
    assert!(readyz_becomes(&d, 503, NOTICE_WITHIN + Duration::from_secs(5)).is_some());
    let r = d.release(&lease);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["error"], "store_unavailable", "{}", r.body);

    // A lease the store really does not hold is still a 404 once it answers again.
    redis.restart();
    assert!(readyz_becomes(&d, 200, Duration::from_secs(15)).is_some());
    let r = d.release(&lease);
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.body["error"], "unknown_lease", "{}", r.body);
}
