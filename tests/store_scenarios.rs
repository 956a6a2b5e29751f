//! One behaviour suite, run against both stores: the in-process memory store and a real Redis that
//! each test starts on a free port. Every scenario drives the real binary over HTTP and expects the
//! same answers from either store: buckets, refunds, holds and their refund on disconnect, oversized
//! calls, concurrency and the lease TTL, daily quotas, penalties, AIMD, the adaptive throttle and
//! shadow mode.

mod common;

use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::Daemon;
use serde_json::{json, Value};

/// A daemon on `config`, with its state in memory or in a fresh Redis (kept alive beside it).
struct Setup {
    daemon: Daemon,
    _redis: Option<RedisServer>,
}

fn start(config: &str, redis: bool) -> Setup {
    if !redis {
        return Setup {
            daemon: Daemon::start(config),
            _redis: None,
        };
    }
    let server = RedisServer::start();
    let text = format!(
        "{config}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"\n",
        server.url()
    );
    let daemon = Daemon::start(&text);
    let ready = daemon.get("/readyz");
    assert_eq!(ready.body["store"]["kind"], "redis", "{}", ready.body);
    assert_eq!(ready.body["store"]["mode"], "shared", "{}", ready.body);
    Setup {
        daemon,
        _redis: Some(server),
    }
}

fn call(tenant: &str, subject: &str, tool: &str) -> Value {
    json!({"tenant": tenant, "subject": subject, "tool": tool, "max_wait_ms": 0})
}

fn lease(a: &common::Answer) -> String {
    a.body["lease_id"]
        .as_str()
        .unwrap_or_else(|| panic!("an admission: {} {}", a.status, a.body))
        .to_string()
}

fn snapshot(d: &Daemon, tenant: &str) -> Value {
    let a = d.get(&format!("/v1/tenants/{tenant}"));
    assert_eq!(a.status, 200, "{}", a.body);
    a.body
}

fn tokens(snap: &Value, layer: &str, key: &str) -> u64 {
    snap["buckets"]
        .as_array()
        .and_then(|b| {
            b.iter()
                .find(|b| b["layer"] == layer && b["key"] == key)
                .and_then(|b| b["tokens"].as_u64())
        })
        .unwrap_or_else(|| panic!("no {layer} bucket {key} in {snap}"))
}

/// The burst is spent and then refused with a retry hint; another subject is untouched.
fn buckets_refuse_past_the_burst(redis: bool) {
    let s = start("[limits.subject]\nrate = \"6/min\"\nburst = 5\n", redis);
    let d = &s.daemon;
    for i in 0..5 {
        let a = d.admit(call("acme", "bot", "search"));
        assert_eq!(a.status, 200, "call {i}: {}", a.body);
        assert_eq!(a.body["remaining"], 4 - i, "{}", a.body);
        assert_eq!(
            a.header("ratelimit").unwrap(),
            format!("\"subject\";r={};t={}", 4 - i, (i + 1) * 10)
        );
    }
    let refused = d.admit(call("acme", "bot", "search"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "subject");
    let wait = refused.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        (9_000..=10_600).contains(&wait),
        "one token at 6/min: {wait}"
    );
    assert_eq!(refused.body["tool_result"]["isError"], true);
    let other = d.admit(call("acme", "other", "search"));
    assert_eq!(other.status, 200, "{}", other.body);
}

/// A call refused by a later layer gives back what the earlier layers took.
fn a_refusal_refunds_earlier_layers(redis: bool) {
    let s = start(
        "[limits.subject]\nrate = \"1/h\"\nburst = 2\n[limits.tenant]\nrate = \"1/h\"\nburst = 3\n",
        redis,
    );
    let d = &s.daemon;
    for _ in 0..2 {
        assert_eq!(d.admit(call("acme", "a", "t")).status, 200);
    }
    assert_eq!(d.admit(call("acme", "b", "t")).status, 200);
    let refused = d.admit(call("acme", "b", "t"));
    assert_eq!(refused.status, 429);
    assert_eq!(refused.body["scope"], "tenant");
    // b's subject bucket still holds the token the refused call did not spend.
    assert_eq!(tokens(&snapshot(d, "acme"), "subject", "b"), 1);
}

/// A call allowed to wait is held until its token is there, and admitted.
fn a_call_is_held_for_a_token_due_within_its_wait(redis: bool) {
    let s = start("[limits.subject]\nrate = \"5/s\"\nburst = 1\n", redis);
    let d = &s.daemon;
    assert_eq!(d.admit(call("acme", "bot", "t")).status, 200);
    let started = Instant::now();
    let held =
        d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "t", "max_wait_ms": 1000}));
    assert_eq!(held.status, 200, "{}", held.body);
    let waited = held.body["waited_ms"].as_u64().unwrap();
    assert!((100..=260).contains(&waited), "a token at 5/s: {waited}");
    assert!(started.elapsed() >= Duration::from_millis(100));
}

/// A held caller that hangs up gets its reservation back: the next caller finds the token.
fn a_held_caller_that_hangs_up_is_refunded(redis: bool) {
    let s = start("[limits.subject]\nrate = \"1/s\"\nburst = 1\n", redis);
    let d = &s.daemon;
    assert_eq!(d.admit(call("acme", "bot", "t")).status, 200);
    let impatient = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let gone = impatient
        .post(d.url("/v1/admit"))
        .json(&json!({"tenant": "acme", "subject": "bot", "tool": "t", "max_wait_ms": 2000}))
        .send();
    assert!(gone.is_err(), "the client gave up during the hold");
    // The first token refills at 1 s; without the refund the next would only be there at 2 s.
    std::thread::sleep(Duration::from_millis(1250));
    let next = d.admit(call("acme", "bot", "t"));
    assert_eq!(
        next.status, 200,
        "the hung-up call's token came back: {}",
        next.body
    );
}

/// A cost no bucket on the path can hold is refused for good, with nothing to wait for.
fn an_oversized_call_is_refused_without_a_wait(redis: bool) {
    let s = start("[limits.subject]\nburst = 20\n", redis);
    let a = s
        .daemon
        .admit(json!({"tenant": "acme", "subject": "bot", "tool": "t", "cost": 50}));
    assert_eq!(a.status, 429);
    assert_eq!(a.body["scope"], "oversized");
    assert_eq!(a.body["retryable"], false);
    assert_eq!(a.body["retry_after_ms"], 0);
    assert!(a.header("retry-after").is_none());
}

/// A concurrency slot frees on release, and at the lease TTL when the call is never released.
fn concurrency_slots_free_on_release_and_at_the_lease_ttl(redis: bool) {
    let s = start(
        "[server]\nlease_ttl = \"1s\"\n[limits.subject]\nconcurrency = 2\n",
        redis,
    );
    let d = &s.daemon;
    let first = lease(&d.admit(call("acme", "bot", "t")));
    let _second = lease(&d.admit(call("acme", "bot", "t")));
    let refused = d.admit(call("acme", "bot", "t"));
    assert_eq!(refused.status, 429);
    assert_eq!(refused.body["scope"], "concurrency");
    assert!(refused.body["retry_after_ms"].as_u64().unwrap() > 0);
    assert_eq!(d.release(&first).status, 200);
    assert_eq!(d.release(&first).status, 404, "released once only");
    let third = lease(&d.admit(call("acme", "bot", "t")));
    assert_eq!(d.admit(call("acme", "bot", "t")).status, 429);
    // Neither of the two live leases is released: both expire at their TTL.
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(d.admit(call("acme", "bot", "t")).status, 200);
    assert_eq!(d.release(&third).status, 404, "an expired lease is unknown");
}

/// A call allowed to wait for a concurrency slot is admitted when one frees.
fn a_call_waits_for_a_slot_that_frees(redis: bool) {
    let s = start("[limits.subject]\nconcurrency = 1\n", redis);
    let d = &s.daemon;
    let first = lease(&d.admit(call("acme", "bot", "t")));
    std::thread::scope(|sc| {
        let waiting = sc.spawn(|| {
            d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "t", "max_wait_ms": 5000}))
        });
        // The waiting call must have reached admitd before the release: on a loaded machine its
        // thread and connection can take a few hundred milliseconds, so the release comes 1 s later
        // and the call is held to have waited at least half of that.
        std::thread::sleep(Duration::from_millis(1000));
        assert_eq!(d.release(&first).status, 200);
        let a = waiting.join().unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        let waited = a.body["waited_ms"].as_u64().unwrap();
        assert!(
            (500..=2500).contains(&waited),
            "waited for the release: {waited}"
        );
    });
}

/// A daily quota refuses until the next UTC day.
fn a_daily_quota_refuses_until_midnight(redis: bool) {
    let s = start("[limits.subject]\ndaily_quota = 3\n", redis);
    let d = &s.daemon;
    for _ in 0..3 {
        assert_eq!(d.admit(call("acme", "bot", "t")).status, 200);
    }
    let refused = d.admit(call("acme", "bot", "t"));
    assert_eq!(refused.status, 429);
    assert_eq!(refused.body["scope"], "daily_quota");
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let to_midnight_ms = (86_400 - secs % 86_400) * 1000;
    let told = refused.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        told.abs_diff(to_midnight_ms) < 5_000,
        "{told} vs {to_midnight_ms}"
    );
    let snap = snapshot(d, "acme");
    let bot = snap["subjects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["subject"] == "bot")
        .unwrap();
    assert_eq!(bot["quota_used"], 3.0);
}

/// An upstream's 429 puts it in the penalty box until its Retry-After; AIMD cuts its budget.
fn an_upstream_429_pauses_it_and_cuts_its_rate(redis: bool) {
    let s = start(
        "[tools.crm_read]\nupstream = \"crm\"\n[upstreams.crm]\nrate = \"10/s\"\nburst = 10\n",
        redis,
    );
    let d = &s.daemon;
    let l = lease(&d.admit(call("acme", "bot", "crm_read")));
    let r = d.post(
        "/v1/release",
        json!({"lease_id": l, "outcome": "upstream_rate_limited", "retry_after": "2"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let refused = d.admit(call("acme", "bot", "crm_read"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "upstream_penalty");
    let wait = refused.body["retry_after_ms"].as_u64().unwrap();
    assert!((1_500..=2_600).contains(&wait), "{wait}");
    // Another tenant's budget for the same (not shared) upstream is its own.
    assert_eq!(d.admit(call("globex", "bot", "crm_read")).status, 200);
    let snap = snapshot(d, "acme");
    let crm = snap["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["upstream"] == "crm")
        .unwrap()
        .clone();
    assert_eq!(crm["multiplier"], 0.5, "{crm}");
    assert_eq!(crm["effective_rate"], 5.0, "{crm}");
    assert!(snap["penalties"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["upstream"] == "crm"));
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(d.admit(call("acme", "bot", "crm_read")).status, 200);
}

/// An upstream that rejects most calls is throttled locally, and a call the throttle refuses is
/// told to wait as long as the upstream's odds of rejecting say (2 × p / (1 − p) seconds): three
/// rejections and no accept, p = 3/4, a 6 s wait.
fn an_adaptive_refusal_waits_by_the_upstreams_odds(redis: bool) {
    let s = start(
        "[tools.crm_read]\nupstream = \"crm\"\n[upstreams.crm]\nadaptive_k = 1\nadaptive_min_requests = 0\n",
        redis,
    );
    let d = &s.daemon;
    for _ in 0..3 {
        // 429s that ask for no wait: rejections, and no penalty to refuse first.
        let f = d.post(
            "/v1/feedback",
            json!({"tenant": "acme", "upstream": "crm", "status": 429, "retry_after": "0"}),
        );
        assert_eq!(f.status, 202, "{}", f.body);
    }
    std::thread::sleep(Duration::from_millis(5));
    // Refused with probability 3/4 (an admitted call counts nothing until its answer is reported);
    // a subject each, so that no bucket refuses first.
    let refused = (0..40)
        .map(|i| d.admit(call("acme", &format!("bot{i}"), "crm_read")))
        .find(|a| a.status == 429)
        .expect("the throttle refuses within 40 calls");
    assert_eq!(refused.body["scope"], "adaptive", "{}", refused.body);
    let wait = refused.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        (5_900..=6_200).contains(&wait),
        "{wait} ms: {}",
        refused.body
    );
}

/// How an upstream's answers count besides a 429: a 503 is no accept and recovers nothing, a 500
/// is an accept that recovers nothing, a 200 recovers the rate.
fn a_503_counts_as_a_rejection_and_recovers_nothing(redis: bool) {
    let s = start(
        "[tools.crm_read]\nupstream = \"crm\"\n[upstreams.crm]\nrate = \"10/s\"\nburst = 10\nadaptive_k = 1\nadaptive_min_requests = 0\n",
        redis,
    );
    let d = &s.daemon;
    let feedback = |status: u16| {
        let f = d.post(
            "/v1/feedback",
            json!({"tenant": "acme", "upstream": "crm", "status": status, "retry_after": "0"}),
        );
        assert_eq!(f.status, 202, "{}", f.body);
    };
    let multiplier = || {
        let snap = snapshot(d, "acme");
        snap["upstreams"]
            .as_array()
            .and_then(|u| u.iter().find(|u| u["upstream"] == "crm"))
            .and_then(|u| u["multiplier"].as_f64())
            .unwrap_or_else(|| panic!("{snap}"))
    };
    // A call first, so that the tenant holds state to show (its answer is never reported).
    assert_eq!(d.admit(call("acme", "first", "crm_read")).status, 200);
    feedback(429);
    assert_eq!(multiplier(), 0.5, "a 429 cuts the rate");
    feedback(503);
    feedback(500);
    assert_eq!(multiplier(), 0.5, "neither a 503 nor a 500 recovers it");
    std::thread::sleep(Duration::from_millis(5));
    // Three requests, one accepted (the 500): p = (3 - 1) / 4, a wait of 2 × p / (1 − p) = 2 s.
    let refused = (0..40)
        .map(|i| d.admit(call("acme", &format!("bot{i}"), "crm_read")))
        .find(|a| a.status == 429 && a.body["scope"] == "adaptive")
        .expect("the throttle refuses within 40 calls");
    let wait = refused.body["retry_after_ms"].as_u64().unwrap();
    assert!(
        (1_900..=2_200).contains(&wait),
        "{wait} ms: {}",
        refused.body
    );
    feedback(200);
    assert!((multiplier() - 0.55).abs() < 1e-9, "a 200 recovers it");
}

/// Feedback outside a lease on a shared upstream pauses it for every tenant.
fn feedback_on_a_shared_upstream_pauses_every_tenant(redis: bool) {
    let s = start(
        "[tools.pay]\nupstream = \"stripe\"\n[upstreams.stripe]\nrate = \"10/s\"\nburst = 10\nshared = true\n",
        redis,
    );
    let d = &s.daemon;
    let f = d.post(
        "/v1/feedback",
        json!({"tenant": "acme", "upstream": "stripe", "status": 429, "retry_after": "3"}),
    );
    assert_eq!(f.status, 202, "{}", f.body);
    for tenant in ["acme", "globex"] {
        let a = d.admit(call(tenant, "bot", "pay"));
        assert_eq!(a.status, 429, "{tenant}: {}", a.body);
        assert_eq!(a.body["scope"], "upstream_penalty");
    }
}

/// On a shared upstream each tenant's refused callers are promised slots after their own tenant's
/// earlier promises only: a tenant whose refusals booked the budget's next seconds does not push
/// another tenant's call, allowed to wait, behind them (it is held for the next token), while its
/// own next call is still told the slot after its promises.
fn one_tenants_promises_on_a_shared_upstream_do_not_book_anothers_wait(redis: bool) {
    let s = start(
        "[tools.pay]\nupstream = \"stripe\"\n[upstreams.stripe]\nrate = \"2/s\"\nburst = 1\nshared = true\n",
        redis,
    );
    let d = &s.daemon;
    assert_eq!(d.admit(call("initech", "bot", "pay")).status, 200);
    // Twenty refusals at 2/s: promised slots up to 10 s ahead.
    let mut last = 0;
    for i in 0..20 {
        let r = d.admit(call("initech", "bot", "pay"));
        assert_eq!(r.status, 429, "refusal {i}: {}", r.body);
        last = r.body["retry_after_ms"].as_u64().unwrap();
    }
    assert!(last >= 6_000, "the twentieth promise at 2/s: {last} ms");
    if let Some(redis) = &s._redis {
        // The bucket keeps each tenant's cursor, and the latest of them where a slice of it (a
        // cluster's) looks before it takes tokens.
        let fields = redis.cli(&["HGETALL", "admitd:{u:stripe}:b"]);
        let f: Vec<&str> = fields.lines().collect();
        let field = |name: &str| {
            f.chunks(2)
                .find(|kv| kv[0] == name)
                .and_then(|kv| kv[1].parse::<f64>().ok())
        };
        let tenant = field("p:initech").unwrap_or_else(|| panic!("{fields}"));
        assert_eq!(field("p"), Some(tenant), "{fields}");
    }
    let wait = |t: &str| json!({"tenant": t, "subject": "bot", "tool": "pay", "max_wait_ms": 1000});
    let held = d.admit(wait("acme"));
    assert_eq!(
        held.status, 200,
        "another tenant waits behind no promise: {}",
        held.body
    );
    let waited = held.body["waited_ms"].as_u64().unwrap();
    assert!(waited <= 800, "one token at 2/s: {waited} ms");
    let own = d.admit(wait("initech"));
    assert_eq!(
        own.status, 429,
        "the tenant's own promises come first: {}",
        own.body
    );
    let hint = own.body["retry_after_ms"].as_u64().unwrap();
    assert!(hint >= 6_000, "told the slot after its promises: {hint} ms");
}

/// Shadow mode admits what enforce mode would refuse, says so, and spends nothing for it.
fn shadow_mode_admits_and_spends_nothing(redis: bool) {
    let s = start(
        "[server]\nmode = \"shadow\"\n[limits.subject]\nrate = \"1/h\"\nburst = 1\n",
        redis,
    );
    let d = &s.daemon;
    let first = d.admit(call("acme", "bot", "t"));
    assert_eq!(first.status, 200);
    assert!(first.body.get("would_shed").is_none() || first.body["would_shed"].is_null());
    for _ in 0..2 {
        let a = d.admit(call("acme", "bot", "t"));
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.body["mode"], "shadow");
        assert_eq!(a.body["would_shed"]["scope"], "subject", "{}", a.body);
        assert_eq!(d.release(&lease(&a)).status, 200, "a shadow lease releases");
    }
    assert_eq!(tokens(&snapshot(d, "acme"), "subject", "bot"), 0);
}

/// The lease of another tenant, or none, is unknown.
fn unknown_leases_are_404(redis: bool) {
    let s = start("", redis);
    let d = &s.daemon;
    let l = lease(&d.admit(call("acme", "bot", "t")));
    assert_eq!(d.release(&l).status, 200);
    let again = d.release(&l);
    assert_eq!(again.status, 404);
    assert_eq!(again.body["error"], "unknown_lease");
    assert_eq!(d.release("0000000000000001616263").status, 404);
    assert_eq!(d.get("/v1/tenants/nobody").status, 404);
}

/// MCP tasks: the interval each is told follows the tenant's tasks in flight, capped, on either
/// store by the same arithmetic; an early poll is refused, a released task is unknown.
fn task_intervals_follow_the_tasks_in_flight(redis: bool) {
    let s = start(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\n\
         [tasks]\npoll_interval = \"100ms\"\npoll_rate = \"10/s\"\nmax_poll_interval = \"350ms\"\n",
        redis,
    );
    let d = &s.daemon;
    let mut leases = Vec::new();
    let mut told = Vec::new();
    for _ in 0..5 {
        let a = d.admit(json!({"tenant": "acme", "subject": "w", "tool": "export", "task": true}));
        leases.push(lease(&a));
        told.push(a.body["poll_interval_ms"].as_u64().unwrap_or(0));
    }
    assert_eq!(told, [100, 200, 300, 350, 350]);
    let early = d.post("/v1/tasks/poll", json!({"lease_id": leases[4]}));
    assert_eq!(early.status, 429, "{}", early.body);
    assert_eq!(early.body["scope"], "task_poll");
    std::thread::sleep(Duration::from_millis(400));
    let on_time = d.post("/v1/tasks/poll", json!({"lease_id": leases[4]}));
    assert_eq!(on_time.status, 200, "{}", on_time.body);
    assert_eq!(
        on_time.body["poll_interval_ms"], 350,
        "five tasks at 10/s, capped"
    );
    for l in &leases {
        assert_eq!(d.release(l).status, 200);
    }
    let gone = d.post("/v1/tasks/poll", json!({"lease_id": leases[0]}));
    assert_eq!(gone.status, 404, "{}", gone.body);
}

macro_rules! both_stores {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(#[test] fn $scenario() { super::$scenario(false) })*
        }
        mod redis {
            $(#[test] fn $scenario() { super::$scenario(true) })*
        }
    };
}

both_stores!(
    buckets_refuse_past_the_burst,
    a_refusal_refunds_earlier_layers,
    a_call_is_held_for_a_token_due_within_its_wait,
    a_held_caller_that_hangs_up_is_refunded,
    an_oversized_call_is_refused_without_a_wait,
    concurrency_slots_free_on_release_and_at_the_lease_ttl,
    a_call_waits_for_a_slot_that_frees,
    a_daily_quota_refuses_until_midnight,
    an_upstream_429_pauses_it_and_cuts_its_rate,
    feedback_on_a_shared_upstream_pauses_every_tenant,
    an_adaptive_refusal_waits_by_the_upstreams_odds,
    a_503_counts_as_a_rejection_and_recovers_nothing,
    one_tenants_promises_on_a_shared_upstream_do_not_book_anothers_wait,
    shadow_mode_admits_and_spends_nothing,
    unknown_leases_are_404,
    task_intervals_follow_the_tasks_in_flight,
);
