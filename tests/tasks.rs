//! Long-running calls as MCP tasks, against the real binary: the poll interval a tenant's load
//! earns, early polls refused with the time left and on-time ones admitted, a renewed task that
//! keeps its slot past the TTL and one whose worker stopped renewing that frees it, and a released
//! task that is unknown. Each scenario runs on one daemon in memory, and on two replicas that share
//! one Redis, every step sent to the next replica in turn (a task started on one replica is polled
//! and renewed on the other).

mod common;

use std::time::{Duration, Instant};

use common::redis::{RedisCluster, RedisServer};
use common::{eventually, metric, Daemon};
use serde_json::{json, Value};

const TASKS: &str = "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 100\n\
    [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 100\n\
    [tasks]\npoll_interval = \"2s\"\npoll_rate = \"2/s\"\nmax_poll_interval = \"1m\"\n";

/// One slot for the tenant, and task leases of 3 s, so that a lapse shows within the test.
const ONE_SLOT: &str = "[limits.tenant]\nconcurrency = 1\n[tasks]\nlease_ttl = \"3s\"\n";

fn task(tenant: &str) -> Value {
    json!({"tenant": tenant, "subject": "worker", "tool": "export", "task": true, "max_wait_ms": 0})
}

fn call(tenant: &str) -> Value {
    json!({"tenant": tenant, "subject": "other", "tool": "search", "max_wait_ms": 0})
}

fn poll(d: &Daemon, lease: &str) -> common::Answer {
    d.post("/v1/tasks/poll", json!({"lease_id": lease}))
}

fn renew(d: &Daemon, lease: &str) -> common::Answer {
    d.post("/v1/renew", json!({"lease_id": lease}))
}

fn lease(a: &common::Answer) -> String {
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.body["lease_id"].as_str().expect("lease_id").to_string()
}

fn interval(a: &common::Answer) -> u64 {
    a.body["poll_interval_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no poll_interval_ms in {:?}", a.body))
}

/// Ten tasks at `poll_rate = "2/s"`: the last is told at least 5 s, no two the same; an early poll
/// is refused with the time left, an on-time one is admitted and told ~5 s again.
fn ten_tasks(ds: &[Daemon], tenant: &str) {
    let on = |i: usize| &ds[i % ds.len()];
    let mut tasks = Vec::new();
    for i in 0..10 {
        let a = on(i).admit(task(tenant));
        tasks.push((lease(&a), interval(&a), Instant::now()));
    }
    let told: Vec<u64> = tasks.iter().map(|t| t.1).collect();
    assert!(told[9] >= 5_000 && told[9] <= 10_000, "{told:?}");
    assert!(told.iter().all(|&ms| ms >= 2_000), "{told:?}");
    let mut distinct = told.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 10, "staggered: {told:?}");

    // An early poll (on the other replica): 429 with the time left, counted from when it was told.
    let (first, first_ms, told_at) = &tasks[9];
    let early = poll(on(1), first);
    let left = first_ms.saturating_sub(told_at.elapsed().as_millis() as u64);
    assert_eq!(early.status, 429, "{:?}", early.body);
    assert_eq!(early.body["scope"], "task_poll");
    assert_eq!(early.body["retryable"], true);
    let retry = early.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry <= *first_ms && retry + 1_000 >= left,
        "{retry} vs {left}"
    );
    assert!(early.header("retry-after").is_some());
    assert_eq!(early.body["tool_result"]["isError"], true);

    // On time, each task on the replica that did not start it: admitted, told 5 s or more.
    for (i, (l, ms, at)) in tasks.iter().enumerate() {
        let due = *at + Duration::from_millis(*ms);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let a = poll(on(i + 1), l);
        assert_eq!(a.status, 200, "task {i}: {:?}", a.body);
        let next = interval(&a);
        assert!((5_000..=10_000).contains(&next), "task {i}: {next}");
    }
    for (i, (l, _, _)) in tasks.iter().enumerate() {
        assert_eq!(on(i).release(l).status, 200);
    }
}

/// A task renewed by its worker keeps the tenant's only slot past its TTL; once the worker stops
/// renewing, the slot frees at the TTL, and the task is unknown from then on.
fn renewal(ds: &[Daemon], tenant: &str) {
    let on = |i: usize| &ds[i % ds.len()];
    let t = lease(&on(0).admit(task(tenant)));
    let started = Instant::now();
    let mut i = 1;
    while started.elapsed() < Duration::from_secs(5) {
        let r = renew(on(i), &t);
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.body["renewed"], true);
        let left = r.body["expires_in_ms"].as_u64().unwrap();
        assert!((2_900..=3_000).contains(&left), "{left}");
        let c = on(i + 1).admit(call(tenant));
        assert_eq!(c.status, 429, "the task holds the slot: {:?}", c.body);
        assert_eq!(c.body["scope"], "concurrency");
        std::thread::sleep(Duration::from_millis(700));
        i += 1;
    }
    // The worker dies: no more renewals. Within its TTL (3 s, plus a tick) the slot is free.
    let stopped = Instant::now();
    let freed = eventually(Duration::from_secs(8), || {
        let c = on(i).admit(call(tenant));
        if c.status == 200 {
            on(i).release(c.body["lease_id"].as_str().unwrap());
        }
        c.status == 200
    });
    assert!(freed, "the slot frees once the task stops renewing");
    assert!(
        stopped.elapsed() >= Duration::from_millis(1_500),
        "not before its TTL: {:?}",
        stopped.elapsed()
    );
    assert_eq!(poll(on(i), &t).status, 404);
    assert_eq!(renew(on(i + 1), &t).body["error"], "unknown_lease");
}

/// A released task's poll and renewal are 404 `unknown_lease`; a call's lease is no task.
fn released(ds: &[Daemon], tenant: &str) {
    let on = |i: usize| &ds[i % ds.len()];
    let t = lease(&on(0).admit(task(tenant)));
    assert_eq!(on(1).release(&t).status, 200);
    let p = poll(on(0), &t);
    assert_eq!(p.status, 404);
    assert_eq!(p.body["error"], "unknown_lease");
    assert_eq!(renew(on(1), &t).status, 404);
    let c = lease(&on(1).admit(call(tenant)));
    assert_eq!(poll(on(0), &c).status, 404, "a call is not a task");
    let r = on(0).post("/v1/renew", json!({"lease_id": c, "ttl_ms": 60_000}));
    assert_eq!(r.status, 200, "any lease can be renewed: {:?}", r.body);
    assert_eq!(r.body["expires_in_ms"], 60_000);
    on(1).release(&c);
}

#[test]
fn ten_tasks_are_told_their_share_of_the_poll_rate_and_held_to_it() {
    let d = Daemon::start(TASKS);
    ten_tasks(std::slice::from_ref(&d), "acme");
    // Polls are counted by decision, and tasks in flight per tenant.
    let text = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        metric(
            &text,
            r#"admitd_task_polls_total{tenant="acme",decision="refused"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"admitd_task_polls_total{tenant="acme",decision="admitted"}"#
        ),
        Some(10.0)
    );
    assert_eq!(
        metric(&text, r#"admitd_tasks_started_total{tenant="acme"}"#),
        Some(10.0)
    );
}

#[test]
fn tasks_in_flight_are_a_gauge_per_tenant() {
    let d = Daemon::start(TASKS);
    let leases: Vec<String> = (0..3).map(|_| lease(&d.admit(task("initech")))).collect();
    let series = r#"admitd_tasks_inflight{tenant="initech"}"#;
    let read = || metric(d.get("/metrics").body.as_str().unwrap_or_default(), series);
    assert!(
        eventually(Duration::from_secs(5), || read() == Some(3.0)),
        "{:?}",
        read()
    );
    d.release(&leases[0]);
    assert!(
        eventually(Duration::from_secs(5), || read() == Some(2.0)),
        "{:?}",
        read()
    );
}

#[test]
fn a_renewed_task_keeps_its_slot_and_an_abandoned_one_frees_it_at_the_ttl() {
    let d = Daemon::start(ONE_SLOT);
    renewal(std::slice::from_ref(&d), "acme");
}

#[test]
fn a_released_task_is_unknown() {
    let d = Daemon::start(TASKS);
    released(std::slice::from_ref(&d), "acme");
}

#[test]
fn bad_polls_and_renewals_are_clear_400s() {
    let d = Daemon::start(TASKS);
    let t = lease(&d.admit(task("acme")));
    for (path, body) in [
        ("/v1/tasks/poll", json!({})),
        ("/v1/tasks/poll", json!({"lease_id": 7})),
        ("/v1/renew", json!({"lease_id": t, "ttl_ms": -1})),
        ("/v1/renew", json!({"lease_id": t, "ttl_ms": 1.5})),
        ("/v1/renew", json!({"lease_id": t, "ttl_ms": 1e300})),
        ("/v1/renew", json!({"lease_id": t, "ttl_ms": "60s"})),
        (
            "/v1/admit",
            json!({"tenant": "acme", "subject": "s", "tool": "t", "task": "yes"}),
        ),
    ] {
        let a = d.post(path, body.clone());
        assert_eq!(a.status, 400, "{path} {body}: {:?}", a.body);
        assert_eq!(a.body["error"], "invalid_request", "{:?}", a.body);
        assert!(a.body["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let a = d.post_raw(
        "/v1/tasks/poll",
        "application/json",
        b"{\"lease_id\":".to_vec(),
    );
    assert_eq!(a.status, 400);
    // A forged id is an unknown lease, not an error.
    assert_eq!(poll(&d, "zz").status, 404);
    // Nothing above touched the task.
    assert_eq!(renew(&d, &t).status, 200);
}

fn two_replicas(config: &str) -> (RedisServer, Vec<Daemon>) {
    two_replicas_with(config, "")
}

/// Two replicas on one fresh Redis; `store` adds keys to their `[store]`.
fn two_replicas_with(config: &str, store: &str) -> (RedisServer, Vec<Daemon>) {
    let redis = RedisServer::start();
    let cfg = format!(
        "{config}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"2s\"\n{store}\n",
        redis.url()
    );
    let ds: Vec<Daemon> = (0..2).map(|_| Daemon::start(&cfg)).collect();
    for d in &ds {
        let shared = || d.get("/readyz").body["store"]["mode"] == "shared";
        assert!(
            eventually(Duration::from_secs(10), shared),
            "the store is reached"
        );
    }
    (redis, ds)
}

#[test]
fn across_two_replicas_ten_tasks_are_told_their_share_and_held_to_it() {
    let (_redis, ds) = two_replicas(TASKS);
    ten_tasks(&ds, "acme");
}

#[test]
fn across_two_replicas_a_renewed_task_keeps_its_slot_and_an_abandoned_one_frees_it() {
    let (_redis, ds) = two_replicas(ONE_SLOT);
    renewal(&ds, "acme");
}

#[test]
fn across_two_replicas_a_released_task_is_unknown() {
    let (_redis, ds) = two_replicas(TASKS);
    released(&ds, "acme");
}

#[test]
fn in_redis_a_tasks_slot_outlives_the_calls_admitted_after_it() {
    let (redis, ds) = two_replicas(TASKS);
    let t = lease(&ds[0].admit(task("acme")));
    let slots = "admitd:{t:acme}:ls";
    let pttl = |k: &str| redis.cli(&["PTTL", k]).trim().parse::<i64>().unwrap_or(-3);
    assert!(
        pttl(slots) > 3_000_000,
        "the tenant's slots live the task's hour: {}",
        pttl(slots)
    );
    // A call that does not know how far the set's expiry was pushed (the cursor is gone from the
    // tenant's hash) must not cut the set's life down to the call's own TTL, or the task's slot
    // would vanish with it.
    redis.cli(&["HDEL", "admitd:{t:acme}:h", "z"]);
    let c = lease(&ds[1].admit(call("acme")));
    assert!(pttl(slots) > 3_000_000, "{}", pttl(slots));
    ds[1].release(&c);
    assert_eq!(renew(&ds[1], &t).status, 200);
    assert!(pttl(slots) > 3_000_000, "{}", pttl(slots));
}

#[test]
fn a_task_admitted_while_the_store_is_down_runs_as_a_call_with_the_shortest_interval() {
    let (mut redis, ds) = two_replicas_with("", "on_error = \"fail_open\"");
    redis.stop();
    let a = ds[0].admit(task("acme"));
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(interval(&a), 2_000, "[tasks] poll_interval, the default");
    // Whether it is live is not known while the store is away: 503, never a 404 that would make
    // the server give the task up.
    let p = poll(&ds[1], a.body["lease_id"].as_str().unwrap());
    assert_eq!(p.status, 503, "{:?}", p.body);
}

#[test]
fn on_a_redis_cluster_a_task_is_polled_and_renewed_on_its_tenants_shard() {
    let cluster = RedisCluster::start(3);
    let cfg = format!(
        "{TASKS}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ncluster = true\ntimeout = \"2s\"\n",
        cluster.seed_urls().join(",")
    );
    let ds: Vec<Daemon> = (0..2).map(|_| Daemon::start(&cfg)).collect();
    for d in &ds {
        let shared = || d.get("/readyz").body["store"]["mode"] == "shared";
        assert!(
            eventually(Duration::from_secs(10), shared),
            "the store is reached"
        );
    }
    released(&ds, "acme");
    let t = lease(&ds[0].admit(task("initech")));
    let early = poll(&ds[1], &t);
    assert_eq!(early.status, 429, "{:?}", early.body);
    assert_eq!(renew(&ds[1], &t).status, 200);
    assert_eq!(ds[0].release(&t).status, 200);
    assert_eq!(poll(&ds[1], &t).status, 404);
}

/// With a shared store a replica cannot count the tenant's tasks itself (the others start some):
/// its gauge is the count the store gave at its last start or poll of one of them.
#[test]
fn across_two_replicas_the_tasks_in_flight_are_the_stores_count() {
    let (_redis, ds) = two_replicas(TASKS);
    let series = r#"admitd_tasks_inflight{tenant="acme"}"#;
    let gauge = |d: &Daemon| metric(d.get("/metrics").body.as_str().unwrap_or_default(), series);
    // Five tasks started in turn on each replica: the first replica starts the last one, and
    // three of the five.
    let mut tasks = Vec::new();
    for i in 0..5 {
        let a = ds[i % 2].admit(task("acme"));
        tasks.push((lease(&a), interval(&a), Instant::now()));
    }
    assert!(
        eventually(Duration::from_secs(5), || gauge(&ds[0]) == Some(5.0)),
        "the replica that started the last task counts all five, not its own three: {:?}",
        gauge(&ds[0])
    );
    // Three end; the second replica (which last heard four) learns at its next on-time poll that
    // two are left.
    for (i, (l, _, _)) in tasks.iter().enumerate().take(3) {
        assert_eq!(ds[i % 2].release(l).status, 200);
    }
    let (last, ms, told_at) = &tasks[4];
    let due = *told_at + Duration::from_millis(*ms);
    std::thread::sleep(due.saturating_duration_since(Instant::now()));
    let p = poll(&ds[1], last);
    assert_eq!(p.status, 200, "{:?}", p.body);
    assert!(
        eventually(Duration::from_secs(5), || gauge(&ds[1]) == Some(2.0)),
        "{:?}",
        gauge(&ds[1])
    );
    for (i, (l, _, _)) in tasks.iter().enumerate().skip(3) {
        assert_eq!(ds[i % 2].release(l).status, 200);
    }
}
