//! The spend behaviour suite, run against both stores (the in-process memory store and a real
//! Redis each test starts): reserve and settle, debt, cancellation, run against daily budgets,
//! plans, estimates from the call, the tool and the unit, parallel calls of one run, shadow mode
//! and a restart, a release's `cost` settling buckets and daily quotas, and the spend
//! `/v1/tenants/{tenant}` shows; and two replicas on one Redis sharing one run's budget, the
//! snapshot's spend alike in both stores, and on a Redis Cluster a release's `cost` settling the
//! cross-tenant layers (global bucket, shared upstream) on their own shards.

mod common;

use std::time::Duration;

use common::redis::{RedisCluster, RedisServer};
use common::Daemon;
use serde_json::{json, Value};

const SPEND: &str = r#"
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
subject_daily = 5
run = 1.0
currency = "$"
[spend.tokens]
estimate = 100
[tools.summarize.spend]
usd = 0.05
"#;

/// A daemon on `config`, with its state in memory or in a fresh Redis, and the config text it
/// runs (to start it again).
struct Setup {
    daemon: Daemon,
    text: String,
    redis: Option<RedisServer>,
}

fn start(config: &str, redis: bool) -> Setup {
    let server = redis.then(RedisServer::start);
    let text = match &server {
        None => config.to_string(),
        Some(r) => format!(
            "{config}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"\n",
            r.url()
        ),
    };
    let daemon = Daemon::start(&text);
    if redis {
        let ready = daemon.get("/readyz");
        assert_eq!(ready.body["store"]["mode"], "shared", "{}", ready.body);
    }
    Setup {
        daemon,
        text,
        redis: server,
    }
}

fn call(tool: &str, run: &str) -> Value {
    json!({"tenant": "acme", "subject": "bot", "tool": tool, "run": run, "max_wait_ms": 0})
}

fn with(mut v: Value, key: &str, x: Value) -> Value {
    v[key] = x;
    v
}

fn lease(a: &common::Answer) -> String {
    a.body["lease_id"]
        .as_str()
        .unwrap_or_else(|| panic!("an admission: {} {}", a.status, a.body))
        .to_string()
}

fn release(d: &Daemon, lease: &str, outcome: &str, extra: Value) {
    let mut body = json!({"lease_id": lease, "outcome": outcome});
    if let Some(e) = extra.as_object() {
        for (k, v) in e {
            body[k] = v.clone();
        }
    }
    let r = d.post("/v1/release", body);
    assert_eq!(r.status, 200, "{}", r.body);
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

fn usd_left(a: &common::Answer) -> f64 {
    a.body["spend"]["usd"]["remaining"]
        .as_f64()
        .unwrap_or_else(|| panic!("{}", a.body))
}

/// A run calling a 0.05 tool stops at its budget of 1 with a refusal waiting cannot fix.
fn a_looping_run_stops_at_its_budget(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    for i in 0..20 {
        let a = d.admit(call("summarize", "r-1"));
        assert_eq!(a.status, 200, "call {i}: {}", a.body);
        assert_eq!(a.body["spend"]["usd"]["reserved"], 0.05);
        assert_eq!(a.body["spend"]["usd"]["budget"], "run");
        assert!(
            close(usd_left(&a), 1.0 - 0.05 * f64::from(i + 1)),
            "{}",
            a.body
        );
        assert_eq!(a.body["spend"]["tokens"]["reserved"], 100.0);
        release(d, &lease(&a), "ok", json!({}));
    }
    let r = d.admit(call("summarize", "r-1"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["scope"], "spend");
    assert_eq!(r.body["unit"], "usd");
    assert_eq!(r.body["budget"], "run");
    assert_eq!(r.body["retryable"], false);
    assert_eq!(r.body["retry_after_ms"], 0);
    assert!(r.header("retry-after").is_none());
    assert!(close(r.body["remaining"].as_f64().unwrap(), 0.0));
    let text = r.body["tool_result"]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(text.contains("budget of $1 for this task"), "{text}");
    // Another run goes on.
    assert_eq!(d.admit(call("summarize", "r-2")).status, 200);
}

/// Reservations: twenty calls in flight fill the run; a cancelled one gives its share back.
fn calls_in_flight_cannot_overshoot(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    let leases: Vec<String> = (0..20)
        .map(|_| lease(&d.admit(call("summarize", "r"))))
        .collect();
    assert_eq!(d.admit(call("summarize", "r")).status, 429);
    release(d, &leases[0], "cancelled", json!({}));
    assert_eq!(d.admit(call("summarize", "r")).status, 200);
    assert_eq!(d.admit(call("summarize", "r")).status, 429);
}

/// The actual figure replaces the estimate; a run overspent refuses even a free call.
fn settling_gives_back_and_charges_on_top(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    let a = d.admit(call("summarize", "r"));
    release(d, &lease(&a), "ok", json!({"spent": {"usd": 0.01}}));
    let a = d.admit(call("summarize", "r"));
    assert!(close(usd_left(&a), 0.94), "{}", a.body);
    release(d, &lease(&a), "ok", json!({"spent": {"usd": 1.5}}));
    let r = d.admit(with(call("other", "r"), "spend", json!({"usd": 0})));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["budget"], "run");
    assert!(
        close(r.body["remaining"].as_f64().unwrap(), -0.51),
        "{}",
        r.body
    );
}

/// A subject's daily budget refuses until UTC midnight, retryably; other subjects go on.
fn a_daily_budget_refuses_until_midnight(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    let a = d.admit(call("summarize", "r"));
    release(d, &lease(&a), "ok", json!({"spent": {"usd": 5.0}}));
    let r = d.admit(call("summarize", "r2"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["budget"], "subject_daily");
    assert_eq!(r.body["retryable"], true);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let midnight = 86_400_000 - now_ms % 86_400_000;
    let hint = r.body["retry_after_ms"].as_u64().unwrap();
    assert!(hint.abs_diff(midnight) < 10_000, "{hint} vs {midnight}");
    assert!(r.header("retry-after").is_some());
    let other = with(call("summarize", "r3"), "subject", json!("other"));
    assert_eq!(d.admit(other).status, 200);
}

/// Estimates: the call's own, else its tool's, else the unit's.
fn estimates_come_from_the_call_the_tool_and_the_unit(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    let own = d.admit(with(call("summarize", "r"), "spend", json!({"usd": 0.3})));
    assert_eq!(own.body["spend"]["usd"]["reserved"], 0.3, "{}", own.body);
    let tool = d.admit(call("summarize", "r"));
    assert_eq!(tool.body["spend"]["usd"]["reserved"], 0.05);
    let unit = d.admit(call("plain", "r"));
    assert_eq!(unit.body["spend"]["usd"]["reserved"], 0.01);
    assert!(close(usd_left(&unit), 1.0 - 0.36), "{}", unit.body);
    // No budget of tokens applies: no remaining, no budget.
    assert!(unit.body["spend"]["tokens"].get("remaining").is_none());
}

/// A plan overrides a unit's budgets for its tenants.
fn plans_override_budgets(redis: bool) {
    let config =
        format!("{SPEND}\n[plans.free.spend.usd]\nrun = 0.1\n[tenants.acme]\nplan = \"free\"\n");
    let s = start(&config, redis);
    let d = &s.daemon;
    assert_eq!(d.admit(call("summarize", "r")).status, 200);
    assert_eq!(d.admit(call("summarize", "r")).status, 200);
    let r = d.admit(call("summarize", "r"));
    assert_eq!(r.status, 429);
    let other = with(call("summarize", "r"), "tenant", json!("globex"));
    for _ in 0..3 {
        assert_eq!(d.admit(other.clone()).status, 200);
    }
}

/// A call another layer refuses reserves nothing.
fn a_refused_call_reserves_nothing(redis: bool) {
    let s = start(
        &format!("{SPEND}\n[tools.one]\nrate = \"1/h\"\nburst = 1\n"),
        redis,
    );
    let d = &s.daemon;
    let a = d.admit(with(call("one", "r"), "spend", json!({"usd": 0.6})));
    assert_eq!(a.status, 200, "{}", a.body);
    let r = d.admit(with(call("one", "r"), "spend", json!({"usd": 0.3})));
    assert_eq!(r.body["scope"], "subject_tool", "{}", r.body);
    let a = d.admit(with(call("x", "r"), "spend", json!({"usd": 0.4})));
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(close(usd_left(&a), 0.0), "{}", a.body);
}

/// Shadow mode reports what a budget would refuse and spends nothing for it.
fn shadow_mode_predicts_spend_refusals(redis: bool) {
    let s = start(&format!("[server]\nmode = \"shadow\"\n{SPEND}"), redis);
    let d = &s.daemon;
    for _ in 0..20 {
        let a = d.admit(call("summarize", "r"));
        assert!(a.body.get("would_shed").is_none(), "{}", a.body);
    }
    for _ in 0..3 {
        let a = d.admit(call("summarize", "r"));
        assert_eq!(a.status, 200);
        assert_eq!(a.body["would_shed"]["scope"], "spend", "{}", a.body);
    }
    // The refused ones reserved nothing: the run has exactly nothing left, not less.
    let a = d.admit(with(call("plain", "r"), "spend", json!({"usd": 0})));
    assert!(a.body.get("would_shed").is_none(), "{}", a.body);
    assert!(close(usd_left(&a), 0.0), "{}", a.body);
}

/// A restart keeps the day's and the run's spend (the state file in memory mode; Redis itself).
fn spend_survives_a_restart(redis: bool) {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[state]\npath = {:?}\ninterval = \"1h\"\n{SPEND}",
        dir.path().join("state").display().to_string()
    );
    let mut s = start(&config, redis);
    let a = s.daemon.admit(call("summarize", "r"));
    release(&s.daemon, &lease(&a), "ok", json!({"spent": {"usd": 1.0}}));
    assert_eq!(s.daemon.admit(call("summarize", "r")).status, 429);
    s.daemon.signal("TERM");
    assert!(common::eventually(Duration::from_secs(5), || s
        .daemon
        .child
        .try_wait()
        .is_ok_and(|st| st.is_some())));
    s.daemon = Daemon::start(&s.text);
    let r = s.daemon.admit(call("summarize", "r"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["budget"], "run");
    let _ = &s.redis;
}

/// Cost units: buckets of two calls an hour and a daily quota of three calls per subject.
const COST: &str = r#"
[limits.subject]
rate = "1000/s"
burst = 1000
daily_quota = 3
[limits.tenant]
rate = "1000/s"
burst = 1000
daily_quota = 100
[tools.cached]
rate = "1/h"
burst = 2
"#;

fn quota_used(d: &Daemon) -> (f64, f64) {
    let s = d.get("/v1/tenants/acme");
    assert_eq!(s.status, 200, "{}", s.body);
    let subject = s.body["subjects"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["subject"] == "bot"))
        .map_or(0.0, |x| x["quota_used"].as_f64().unwrap());
    (s.body["quota"]["day_used"].as_f64().unwrap(), subject)
}

/// A release's `cost` of 0 (a cache hit) gives the call's bucket tokens and quota back: five calls
/// pass a bucket of two and a quota of three.
fn a_cache_hit_costs_nothing(redis: bool) {
    let s = start(COST, redis);
    let d = &s.daemon;
    for i in 0..5 {
        let a = d.admit(call("cached", "r"));
        assert_eq!(a.status, 200, "call {i}: {}", a.body);
        release(d, &lease(&a), "ok", json!({"cost": 0}));
    }
    assert_eq!(quota_used(d), (0.0, 0.0));
    // Without a cost the admission's stands: two calls fill the bucket.
    for _ in 0..2 {
        let a = d.admit(call("cached", "r"));
        release(d, &lease(&a), "ok", json!({}));
    }
    let r = d.admit(call("cached", "r"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["scope"], "subject_tool");
    assert_eq!(quota_used(d), (2.0, 2.0));
}

/// A release's `cost` above the admission's charges the difference on top: the bucket and the
/// quota are short by it for the next calls.
fn a_dear_call_charges_more(redis: bool) {
    let s = start(COST, redis);
    let d = &s.daemon;
    let a = d.admit(call("cached", "r"));
    release(d, &lease(&a), "ok", json!({"cost": 2}));
    assert_eq!(quota_used(d), (2.0, 2.0));
    // The bucket of two gave both: the next call of the tool waits an hour.
    let r = d.admit(call("cached", "r"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["scope"], "subject_tool");
    // Two of the subject's three a day are gone: one more call fits, the one after does not.
    let a = d.admit(call("other", "r"));
    assert_eq!(a.status, 200, "{}", a.body);
    release(d, &lease(&a), "ok", json!({}));
    let r = d.admit(call("other", "r"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["scope"], "daily_quota");
    // Part of a cost back (1.5 of 2 admitted): the quota is charged the half.
    let a = d.admit(with(call("other", "r"), "subject", json!("bot2")));
    assert_eq!(a.status, 200, "{}", a.body);
    release(d, &lease(&a), "ok", json!({"cost": 1.5}));
    assert!(close(quota_used(d).0, 4.5), "{:?}", quota_used(d));
}

/// `GET /v1/tenants/{tenant}` shows each unit's spend of the day and its budgets: reserved (a call
/// in flight), settled (a release's `spent`), given back (a cancellation); a unit without a tenant
/// budget is counted all the same.
fn the_tenant_snapshot_shows_the_days_spend(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    let a = d.admit(call("summarize", "r"));
    release(
        d,
        &lease(&a),
        "ok",
        json!({"spent": {"usd": 0.5, "tokens": 40}}),
    );
    let a = d.admit(call("summarize", "r"));
    release(d, &lease(&a), "cancelled", json!({}));
    let _in_flight = lease(&d.admit(call("summarize", "r")));
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(snap.status, 200, "{}", snap.body);
    let spend = &snap.body["spend"];
    assert_eq!(spend.as_array().map(Vec::len), Some(2), "{}", snap.body);
    let usd = unit(spend, "usd");
    assert!(close(usd["day_spent"].as_f64().unwrap(), 0.55), "{spend}");
    assert!(
        close(usd["day_remaining"].as_f64().unwrap(), 49.45),
        "{spend}"
    );
    assert_eq!(usd["tenant_daily"], 50.0);
    assert_eq!(usd["subject_daily"], 5.0);
    assert_eq!(usd["run"], 1.0);
    let tokens = unit(spend, "tokens");
    assert!(
        close(tokens["day_spent"].as_f64().unwrap(), 140.0),
        "{spend}"
    );
    for k in ["tenant_daily", "day_remaining", "subject_daily", "run"] {
        assert!(tokens[k].is_null(), "{k}: {spend}");
    }
}

/// One unit of a snapshot's `spend`.
fn unit<'a>(spend: &'a Value, name: &str) -> &'a Value {
    spend
        .as_array()
        .and_then(|a| a.iter().find(|u| u["unit"] == name))
        .unwrap_or_else(|| panic!("no {name} in {spend}"))
}

/// A call estimated at nothing (no figure reserved yet for its run or day) still settles what it
/// actually spent: two such calls of 0.6 put the run of 1 in debt.
fn a_call_estimated_at_nothing_still_settles(redis: bool) {
    let s = start(SPEND, redis);
    let d = &s.daemon;
    for _ in 0..2 {
        let a = d.admit(with(call("plain", "r"), "spend", json!({"usd": 0})));
        assert_eq!(a.status, 200, "{}", a.body);
        release(d, &lease(&a), "ok", json!({"spent": {"usd": 0.6}}));
    }
    let r = d.admit(with(call("plain", "r"), "spend", json!({"usd": 0})));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["budget"], "run");
    assert!(
        close(r.body["remaining"].as_f64().unwrap(), -0.2),
        "{}",
        r.body
    );
    let snap = d.get("/v1/tenants/acme");
    let usd = unit(&snap.body["spend"], "usd");
    assert!(
        close(usd["day_spent"].as_f64().unwrap(), 1.2),
        "{}",
        snap.body
    );
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
    a_looping_run_stops_at_its_budget,
    calls_in_flight_cannot_overshoot,
    settling_gives_back_and_charges_on_top,
    a_daily_budget_refuses_until_midnight,
    estimates_come_from_the_call_the_tool_and_the_unit,
    plans_override_budgets,
    a_refused_call_reserves_nothing,
    shadow_mode_predicts_spend_refusals,
    spend_survives_a_restart,
    a_cache_hit_costs_nothing,
    a_dear_call_charges_more,
    the_tenant_snapshot_shows_the_days_spend,
    a_call_estimated_at_nothing_still_settles,
);

/// Two replicas on one Redis share one run's budget: calls alternate between them and together
/// stop at the budget.
#[test]
fn two_replicas_share_a_run_budget() {
    let redis = RedisServer::start();
    let text = format!(
        "{SPEND}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"\n",
        redis.url()
    );
    let (a, b) = (Daemon::start(&text), Daemon::start(&text));
    let mut admitted = 0;
    for i in 0..30 {
        let d = if i % 2 == 0 { &a } else { &b };
        let r = d.admit(call("summarize", "shared-run"));
        if r.status == 200 {
            admitted += 1;
            // Released by the other replica: a lease is the fleet's.
            let other = if i % 2 == 0 { &b } else { &a };
            release(other, &lease(&r), "ok", json!({"spent": {"usd": 0.05}}));
        } else {
            assert_eq!(r.body["budget"], "run", "{}", r.body);
        }
    }
    assert_eq!(admitted, 20);
}

/// The same calls against each store show the same spend in `GET /v1/tenants/{tenant}`, figure
/// for figure, in the same shape.
#[test]
fn the_snapshots_spend_is_the_same_in_both_stores() {
    let plan = format!("{SPEND}\n[plans.free.spend.tokens]\ntenant_daily = 1000\n[tenants.acme]\nplan = \"free\"\n");
    let spend_of = |redis: bool| -> Value {
        let s = start(&plan, redis);
        let d = &s.daemon;
        for (i, spent) in [json!({"usd": 0.2}), json!({"tokens": 250}), json!({})]
            .iter()
            .enumerate()
        {
            let a = d.admit(with(
                call("summarize", &format!("r{i}")),
                "spend",
                json!({"usd": 0.1 * i as f64}),
            ));
            release(d, &lease(&a), "ok", json!({"spent": spent}));
        }
        let other = with(call("plain", "r9"), "subject", json!("other"));
        let _in_flight = lease(&d.admit(other));
        let snap = d.get("/v1/tenants/acme");
        assert_eq!(snap.status, 200, "{}", snap.body);
        snap.body["spend"].clone()
    };
    let (memory, redis) = (spend_of(false), spend_of(true));
    let units = memory.as_array().expect("memory mode shows spend");
    assert_eq!(units.len(), 2, "{memory}");
    assert_eq!(redis.as_array().map(Vec::len), Some(2), "{redis}");
    for m in units {
        let r = unit(&redis, m["unit"].as_str().unwrap());
        let keys: Vec<&String> = m.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            r.as_object().unwrap().keys().collect::<Vec<_>>(),
            "{m} vs {r}"
        );
        for (k, v) in m.as_object().unwrap() {
            match (v.as_f64(), r[k].as_f64()) {
                (Some(a), Some(b)) => assert!(close(a, b), "{k}: memory {m} redis {r}"),
                _ => assert_eq!(v, &r[k], "{k}: memory {m} redis {r}"),
            }
        }
    }
    // usd: 0 + 0.2 settled, 0.1 and 0.2 estimates, and the call in flight's 0.01; tokens: the
    // plan's budget, 100 + 250 + 100 + 100.
    let (usd, tokens) = (unit(&memory, "usd"), unit(&memory, "tokens"));
    assert!(close(usd["day_spent"].as_f64().unwrap(), 0.51), "{memory}");
    assert!(
        close(tokens["day_spent"].as_f64().unwrap(), 550.0),
        "{memory}"
    );
    assert!(
        close(tokens["day_remaining"].as_f64().unwrap(), 450.0),
        "{memory}"
    );
}

/// A global bucket of 8 and a shared upstream's of 4, refilling one an hour, on a three-shard
/// cluster: both live on shards of their own, apart from the tenant's.
fn cross_config(cluster: &RedisCluster, slice: &str) -> String {
    format!(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\n\
         [limits.global]\nrate = \"1/h\"\nburst = 8\n\
         [upstreams.api]\nrate = \"1/h\"\nburst = 4\nshared = true\n\
         [tools.ask]\nupstream = \"api\"\n\
         [store]\nkind = \"redis\"\nurl = \"{}\"\ncluster = true\ntimeout = \"500ms\"\nslice = \"{slice}\"\n",
        cluster.url()
    )
}

/// On a Redis Cluster, a release's `cost` settles the call's cross-tenant layers as it settles the
/// tenant's: a cache hit (`cost: 0`) gives the shared upstream's and the global bucket's tokens
/// back, a dear call charges both on top. With `slice` on, both buckets settle in the replica's
/// slices where they can (each of which may hold up to two calls' tokens of its own).
fn release_cost_settles_the_cross_tenant_layers(slice: &str) {
    let cluster = RedisCluster::start(3);
    let d = Daemon::start(&cross_config(&cluster, slice));
    let sliced = slice != "0s";
    let ask =
        |tool: &str| json!({"tenant": "acme", "subject": "bot", "tool": tool, "max_wait_ms": 0});
    // Ten calls of the upstream of 4, each a cache hit: every one is admitted.
    for i in 0..10 {
        let a = d.admit(ask("ask"));
        assert_eq!(a.status, 200, "ask {i}: {}", a.body);
        release(&d, &lease(&a), "ok", json!({"cost": 0}));
    }
    // Ten calls of the global bucket of 8 alone (decided from slices when they are on).
    for i in 0..10 {
        let a = d.admit(ask("search"));
        assert_eq!(a.status, 200, "search {i}: {}", a.body);
        release(&d, &lease(&a), "ok", json!({"cost": 0}));
    }
    // A call that cost 4 takes the upstream's last 3 tokens on top of its 1 (a slice may still
    // hold two of its own, as for the global bucket below).
    let a = d.admit(ask("ask"));
    assert_eq!(a.status, 200, "{}", a.body);
    release(&d, &lease(&a), "ok", json!({"cost": 4}));
    let mut passed = 0;
    let r = loop {
        let r = d.admit(ask("ask"));
        if r.status != 200 {
            break r;
        }
        passed += 1;
        assert!(passed <= 2, "the upstream was not charged: {}", r.body);
        release(&d, &lease(&r), "ok", json!({}));
    };
    assert_eq!(r.status, 429, "the upstream is spent: {}", r.body);
    assert_eq!(r.body["scope"], "tenant_upstream", "{}", r.body);
    if !sliced {
        assert_eq!(passed, 0);
    }
    // The global bucket gave 4 of its 8 to that call: one that cost 8 takes it below empty.
    let a = d.admit(ask("search"));
    assert_eq!(a.status, 200, "{}", a.body);
    release(&d, &lease(&a), "ok", json!({"cost": 8}));
    // Without the charge, three more calls would pass; a slice may still hold two of its own.
    let mut passed = 0;
    let refused = loop {
        let r = d.admit(ask("search"));
        if r.status != 200 {
            break r;
        }
        passed += 1;
        assert!(passed <= 2, "the global bucket was not charged: {}", r.body);
    };
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "global", "{}", refused.body);
    if !sliced {
        assert_eq!(passed, 0);
    }
}

#[test]
fn on_a_cluster_release_cost_settles_cross_tenant_layers_on_their_shards() {
    release_cost_settles_the_cross_tenant_layers("0s");
}

#[test]
fn on_a_cluster_release_cost_settles_the_cross_tenant_buckets_in_slices() {
    release_cost_settles_the_cross_tenant_layers("100ms");
}
