//! Fake-clock tests of the tenant engine: every layer, refund, hold, queue, lease and penalty rule.
//!
//! Each test builds a config from TOML text, one or more [`TenantEngine`]s over one shared
//! [`SharedBudgets`], and a [`FakeClock`] that moves only when told, so every number asserted is exact.
//! The one non-exact number the engine produces is retry-hint jitter (it only ever adds, at most 5% of
//! the wait and at most 100 ms); [`assert_shed`] checks a hint against exactly that window.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::tenant::BucketSnapshot;
use super::test_support::*;
use super::*;
use crate::clock::{FakeClock, Nanos};
use crate::config::{Config, Mode};

/// 2026-10-21T23:59:59.000Z.
const LAST_SECOND: i64 = 1_792_627_199_000;

// ---- harness ----------------------------------------------------------------------------------------

/// One config, one set of cross-tenant budgets and one fake clock; engines are made from it.
struct Rig {
    clock: FakeClock,
    cfg: Arc<Config>,
    shared: Arc<SharedBudgets>,
}

impl Rig {
    fn new(toml: &str) -> Rig {
        Rig::at(toml, NOON)
    }

    /// A rig whose wall clock reads `wall_ms` and whose monotonic clock reads `START_MS`.
    fn at(toml: &str, wall_ms: i64) -> Rig {
        let (clock, cfg, shared) = harness(toml, wall_ms);
        Rig { clock, cfg, shared }
    }

    fn engine(&self, tenant: &str) -> TenantEngine {
        self.engine_with(&self.cfg, tenant)
    }

    /// An engine on another config than the rig's (one reloaded since), on the rig's budgets.
    fn engine_with(&self, cfg: &Arc<Config>, tenant: &str) -> TenantEngine {
        TenantEngine::new(
            Arc::from(tenant),
            cfg.clone(),
            self.shared.clone(),
            0x5eed ^ tenant.len() as u64,
        )
    }

    /// Admits and expects a place in the queue: (waiter id, deadline).
    fn queue(&self, e: &mut TenantEngine, r: &AdmitRequest) -> (u64, Nanos) {
        match self.admit(e, r) {
            AdmitResult::Queued { waiter, deadline } => (waiter, deadline),
            AdmitResult::Decided(d) => panic!("expected to be queued, got {:?}", d.verdict),
        }
    }

    /// Admits and expects an admission; returns its lease.
    fn lease(&self, e: &mut TenantEngine, r: &AdmitRequest) -> u64 {
        admitted(&self.decide(e, r)).lease
    }

    fn release(
        &self,
        e: &mut TenantEngine,
        lease: u64,
        info: &ReleaseInfo,
    ) -> Result<Released, UnknownLease> {
        e.release(lease, info, self.now(), self.wall())
    }

    fn release_ok(&self, e: &mut TenantEngine, lease: u64) -> Released {
        self.release(e, lease, &ok()).expect("lease is live")
    }

    fn snap(&self, e: &TenantEngine) -> TenantSnapshot {
        e.snapshot(self.now(), self.wall())
    }

    /// Whole tokens left in one bucket of the tenant's snapshot.
    fn tokens(&self, e: &TenantEngine, layer: &str, key: &str) -> u64 {
        bucket(&self.snap(e), layer, key).tokens
    }

    fn global_tokens(&self) -> u64 {
        self.shared.global.remaining(
            &bucket::Gcra::new(self.cfg.limits.global.bucket),
            self.now(),
        )
    }
}

impl Clocked for Rig {
    fn clock(&self) -> &FakeClock {
        &self.clock
    }
}

fn cfg(toml: &str) -> Config {
    Config::parse("test.toml", toml).unwrap_or_else(|e| panic!("test config does not parse: {e}"))
}

fn bucket<'a>(s: &'a TenantSnapshot, layer: &str, key: &str) -> &'a BucketSnapshot {
    s.buckets
        .iter()
        .find(|b| b.layer == layer && b.key == key)
        .unwrap_or_else(|| panic!("no {layer} bucket {key:?} in {:?}", s.buckets))
}

fn ok() -> ReleaseInfo {
    ReleaseInfo {
        outcome: Outcome::Ok,
        upstream_status: None,
        retry_after: None,
        duration_ms: None,
    }
}

fn rate_limited(retry_after: Option<Duration>) -> ReleaseInfo {
    ReleaseInfo {
        outcome: Outcome::UpstreamRateLimited,
        upstream_status: Some(429),
        retry_after,
        duration_ms: Some(20),
    }
}

/// Asserts a retryable shed of `scope` whose hint is the true wait `wait_ns` (plus allowed jitter).
fn assert_shed(d: &Decision, scope: Scope, wait_ns: u64) {
    let s = shed(d);
    assert_eq!(s.scope, scope, "scope of {s:?}");
    assert!(s.retryable, "{scope:?} sheds are retryable");
    let w = hint_window(wait_ns);
    assert!(
        w.contains(&s.retry_after_ms),
        "{scope:?}: retry_after_ms {} not in {w:?}",
        s.retry_after_ms
    );
    assert!(
        s.message.contains("Wait ") || scope == Scope::DailyQuota,
        "{}",
        s.message
    );
}

fn assert_oversized(d: &Decision, limit: &str) {
    let s = shed(d);
    assert_eq!(s.scope, Scope::Oversized);
    assert!(!s.retryable);
    assert_eq!(s.retry_after_ms, 0);
    assert!(
        s.message.contains(&format!("the limit is {limit}")),
        "{}",
        s.message
    );
}

fn remaining(d: &Decision, layer: Layer) -> u64 {
    d.layers
        .iter()
        .find(|l| l.layer == layer)
        .unwrap_or_else(|| panic!("layer {layer:?} not in {:?}", d.layers))
        .remaining
}

// ---- 1. every scope produces its shed ---------------------------------------------------------------

#[test]
fn subject_bucket_sheds_with_scope_subject() {
    let rig = Rig::new("[limits.subject]\nrate = \"1/s\"\nburst = 2\n");
    let mut e = rig.engine("acme");
    for left in [1, 0] {
        let d = rig.decide(&mut e, &call("bot", "search"));
        admitted_now(&d);
        assert_eq!(remaining(&d, Layer::Subject), left);
    }
    let d = rig.decide(&mut e, &call("bot", "search"));
    assert_shed(&d, Scope::Subject, SEC);
    assert_eq!(shed(&d).reason, "rate limit reached");
    assert!(
        shed(&d)
            .message
            .contains("this agent has made too many tool calls"),
        "{}",
        shed(&d).message
    );
    // another subject of the same tenant has its own bucket
    admitted_now(&rig.decide(&mut e, &call("other", "search")));
    // one token comes back per second
    rig.advance_ms(999);
    assert_eq!(
        shed(&rig.decide(&mut e, &call("bot", "search"))).scope,
        Scope::Subject
    );
    rig.advance_ms(1);
    admitted_now(&rig.decide(&mut e, &call("bot", "search")));
}

#[test]
fn tool_bucket_sheds_with_scope_subject_tool_and_spares_other_tools() {
    let rig = Rig::new("[tools.search]\nrate = \"1/s\"\nburst = 2\n");
    let mut e = rig.engine("acme");
    for left in [1, 0] {
        let d = rig.decide(&mut e, &call("bot", "search"));
        admitted_now(&d);
        assert_eq!(remaining(&d, Layer::SubjectTool), left);
    }
    let d = rig.decide(&mut e, &call("bot", "search"));
    assert_shed(&d, Scope::SubjectTool, SEC);
    assert!(
        shed(&d)
            .message
            .contains("the search tool has been called too often"),
        "{}",
        shed(&d).message
    );
    // other tools of the same subject, and the same tool of another subject, are not limited by it
    let d = rig.decide(&mut e, &call("bot", "fetch"));
    admitted_now(&d);
    assert!(
        d.layers.iter().all(|l| l.layer != Layer::SubjectTool),
        "fetch has no tool bucket"
    );
    admitted_now(&rig.decide(&mut e, &call("bot2", "search")));
    assert_eq!(rig.tokens(&e, "subject_tool", "bot/search"), 0);
    assert_eq!(rig.tokens(&e, "subject_tool", "bot2/search"), 1);
}

#[test]
fn tenant_bucket_sheds_with_scope_tenant_across_subjects() {
    let rig = Rig::new("[limits.tenant]\nrate = \"1/s\"\nburst = 3\n");
    let mut e = rig.engine("acme");
    for s in ["s0", "s1", "s2"] {
        admitted_now(&rig.decide(&mut e, &call(s, "search")));
    }
    let d = rig.decide(&mut e, &call("s3", "search"));
    assert_shed(&d, Scope::Tenant, SEC);
    assert!(
        shed(&d)
            .message
            .contains("overall tool-call quota for this account"),
        "{}",
        shed(&d).message
    );
    // another tenant has its own tenant bucket
    let mut other = rig.engine("globex");
    admitted_now(&rig.decide(&mut other, &call("s3", "search")));
}

const WAREHOUSE: &str = r#"
[tools.get_sales]
upstream = "warehouse"
[upstreams.warehouse]
rate = "1/s"
burst = 2
"#;

#[test]
fn upstream_bucket_sheds_with_scope_tenant_upstream_per_tenant() {
    let rig = Rig::new(WAREHOUSE);
    let mut acme = rig.engine("acme");
    let mut globex = rig.engine("globex");
    let d = rig.decide(&mut acme, &call("a", "get_sales"));
    admitted_now(&d);
    assert_eq!(
        d.resolved.upstream.as_deref(),
        Some("warehouse"),
        "the tool's upstream applies"
    );
    admitted_now(&rig.decide(&mut acme, &call("b", "get_sales")));
    let d = rig.decide(&mut acme, &call("c", "get_sales"));
    assert_shed(&d, Scope::TenantUpstream, SEC);
    // the text gives the hint (1 s plus jitter) in whole seconds, rounded up
    let wait = match refusal::whole_seconds(shed(&d).retry_after_ms) {
        1 => "Wait 1 second,".to_string(),
        n => format!("Wait {n} seconds,"),
    };
    assert!(
        shed(&d).message.starts_with(&format!(
            "Rate limited by the warehouse quota for this account. {wait}"
        )),
        "{}",
        shed(&d).message
    );
    // another tool naming the same upstream spends the same budget
    assert_eq!(
        shed(&rig.decide(&mut acme, &call("c", "report").up("warehouse"))).scope,
        Scope::TenantUpstream
    );
    // the budget is per tenant: globex has its own
    admitted_now(&rig.decide(&mut globex, &call("a", "get_sales")));
    admitted_now(&rig.decide(&mut globex, &call("b", "get_sales")));
    assert_eq!(rig.tokens(&acme, "tenant_upstream", "warehouse"), 0);
    assert_eq!(rig.tokens(&globex, "tenant_upstream", "warehouse"), 0);
}

const MAPS: &str = r#"
[tools.geocode]
upstream = "maps"
[upstreams.maps]
rate = "1/s"
burst = 2
shared = true
"#;

#[test]
fn shared_upstream_is_one_budget_across_tenants() {
    let rig = Rig::new(MAPS);
    let mut acme = rig.engine("acme");
    let mut globex = rig.engine("globex");
    admitted_now(&rig.decide(&mut acme, &call("a", "geocode")));
    admitted_now(&rig.decide(&mut acme, &call("a", "geocode")));
    let d = rig.decide(&mut globex, &call("g", "geocode"));
    assert_shed(&d, Scope::TenantUpstream, SEC);
    assert!(
        shed(&d)
            .message
            .contains("the maps quota, which all accounts share"),
        "{}",
        shed(&d).message
    );
    // globex spent nothing of its own
    assert_eq!(rig.tokens(&globex, "subject", "g"), 20);
    assert_eq!(rig.tokens(&globex, "tenant", "globex"), 50);
    // the shared bucket is not reported as a per-tenant bucket
    assert!(rig
        .snap(&globex)
        .buckets
        .iter()
        .all(|b| b.layer != "tenant_upstream"));
    rig.advance_ms(1000);
    admitted_now(&rig.decide(&mut globex, &call("g", "geocode")));
    assert_eq!(
        shed(&rig.decide(&mut acme, &call("a", "geocode"))).scope,
        Scope::TenantUpstream
    );
}

#[test]
fn global_bucket_sheds_with_scope_global_across_tenants() {
    let rig = Rig::new("[limits.global]\nrate = \"1/s\"\nburst = 2\n");
    let mut acme = rig.engine("acme");
    let mut globex = rig.engine("globex");
    admitted_now(&rig.decide(&mut acme, &call("a", "search")));
    admitted_now(&rig.decide(&mut acme, &call("b", "search")));
    let d = rig.decide(&mut globex, &call("g", "search"));
    assert_shed(&d, Scope::Global, SEC);
    assert!(
        shed(&d).message.contains("too many calls overall"),
        "{}",
        shed(&d).message
    );
    assert_eq!(rig.tokens(&globex, "subject", "g"), 20);
    assert_eq!(rig.tokens(&globex, "tenant", "globex"), 50);
    assert_eq!(rig.global_tokens(), 0);
}

/// Two tenants on plan `free` (whose global bucket is its own: 1/s, burst 2), one without a plan.
const PLAN_GLOBAL: &str = "[limits.global]\nrate = \"1/s\"\nburst = 100\n\
    [plans.free.global]\nburst = 2\n\
    [tenants.globex]\nplan = \"free\"\n[tenants.initech]\nplan = \"free\"\n";

#[test]
fn a_plan_global_bucket_is_shared_by_the_plans_tenants_in_place_of_the_global_one() {
    let rig = Rig::new(PLAN_GLOBAL);
    let mut globex = rig.engine("globex");
    let mut initech = rig.engine("initech");
    let mut acme = rig.engine("acme");
    let d = rig.decide(&mut globex, &call("a", "search"));
    admitted_now(&d);
    let global = d.layers.iter().find(|l| l.layer == Layer::Global).unwrap();
    assert_eq!((global.burst, global.remaining), (2.0, 1), "{global:?}");
    admitted_now(&rig.decide(&mut globex, &call("b", "search")));
    // The plan's bucket is empty for every tenant of the plan ...
    let d = rig.decide(&mut initech, &call("i", "search"));
    assert_shed(&d, Scope::Global, SEC);
    assert_eq!(
        rig.tokens(&initech, "subject", "i"),
        20,
        "a refusal spends nothing"
    );
    // ... and the tenants outside it pass [limits.global], which the plan's calls did not spend.
    assert_eq!(rig.global_tokens(), 100);
    admitted_now(&rig.decide(&mut acme, &call("x", "search")));
    assert_eq!(rig.global_tokens(), 99);
    rig.advance_ms(1000);
    admitted_now(&rig.decide(&mut initech, &call("i", "search")));
}

#[test]
fn reload_rescales_a_plan_global_bucket_and_drops_it_with_the_override() {
    let rig = Rig::new(PLAN_GLOBAL);
    let mut globex = rig.engine("globex");
    admitted_now(&rig.decide(&mut globex, &call("a", "search")));
    admitted_now(&rig.decide(&mut globex, &call("b", "search")));
    let reload = |from: &Arc<Config>, to: &str, e: &mut TenantEngine| {
        let to = Arc::new(cfg(to));
        rig.shared.reconfigure(from, &to, rig.now());
        e.set_config(to.clone(), rig.now());
        to
    };
    // A larger burst keeps the two tokens spent: two more fit, not four.
    let bigger = PLAN_GLOBAL.replace("burst = 2", "burst = 4");
    let now_cfg = reload(&rig.cfg, &bigger, &mut globex);
    let mut initech = rig.engine_with(&now_cfg, "initech");
    admitted_now(&rig.decide(&mut initech, &call("i", "search")));
    admitted_now(&rig.decide(&mut globex, &call("c", "search")));
    assert_shed(
        &rig.decide(&mut initech, &call("j", "search")),
        Scope::Global,
        SEC,
    );
    // Without the override the plan's tenants pass [limits.global] again (full: 100 tokens).
    let plain = PLAN_GLOBAL.replace("[plans.free.global]\nburst = 2\n", "[plans.free.subject]\n");
    reload(&now_cfg, &plain, &mut globex);
    admitted_now(&rig.decide(&mut globex, &call("d", "search")));
    assert_eq!(rig.global_tokens(), 99);
}

#[test]
fn subject_concurrency_sheds_with_scope_concurrency() {
    let rig = Rig::new("[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let l1 = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("a", "search"));
    // no lease has finished yet: the hint is the 1 s default run, and a margin for the release
    assert_shed(&d, Scope::Concurrency, SEC + 50 * MS);
    assert_eq!(shed(&d).reason, "too many calls in flight");
    assert!(
        shed(&d).message.contains("Start fewer calls in parallel"),
        "{}",
        shed(&d).message
    );
    assert!(
        shed(&d).message.contains("from this agent"),
        "{}",
        shed(&d).message
    );
    // the refused call spent nothing: one call's tokens gone from the subject bucket
    assert_eq!(rig.tokens(&e, "subject", "a"), 19);
    // another subject has its own slots
    admitted_now(&rig.decide(&mut e, &call("b", "search")));
    assert_eq!(e.inflight(), 2);

    rig.advance_ms(200);
    rig.release_ok(&mut e, l1);
    let _l2 = admitted_now(&rig.decide(&mut e, &call("c", "search")));
    // now the hint is how long the tool's calls run (200 ms so far), and a 20 ms margin
    assert_shed(
        &rig.decide(&mut e, &call("c", "search")),
        Scope::Concurrency,
        220 * MS,
    );
}

#[test]
fn tenant_concurrency_sheds_with_scope_concurrency() {
    let rig = Rig::new("[limits.tenant]\nconcurrency = 2\n");
    let mut e = rig.engine("acme");
    let la = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    admitted_now(&rig.decide(&mut e, &call("b", "search")));
    let d = rig.decide(&mut e, &call("c", "search"));
    assert_shed(&d, Scope::Concurrency, SEC + 50 * MS);
    // c has nothing in flight: the text must not blame its own calls
    assert!(
        shed(&d).message.contains("from this account"),
        "{}",
        shed(&d).message
    );
    assert_eq!(e.inflight(), 2);
    assert_eq!(rig.snap(&e).inflight, 2);
    rig.release_ok(&mut e, la);
    assert_eq!(e.inflight(), 1);
    admitted_now(&rig.decide(&mut e, &call("c", "search")));
}

#[test]
fn subject_daily_quota_sheds_until_utc_midnight() {
    let rig = Rig::new("[limits.subject]\ndaily_quota = 3\n");
    let mut e = rig.engine("acme");
    for _ in 0..3 {
        let l = rig.lease(&mut e, &call("a", "search"));
        rig.release_ok(&mut e, l);
    }
    let d = rig.decide(&mut e, &call("a", "search"));
    // noon: twelve hours to midnight UTC
    assert_shed(&d, Scope::DailyQuota, 12 * 3600 * SEC);
    assert_eq!(shed(&d).reason, "daily quota used up");
    let secs = refusal::whole_seconds(shed(&d).retry_after_ms);
    assert!((43_200..=43_201).contains(&secs));
    assert!(
        shed(&d).message.contains(&format!(
            "quota of this agent is used up; it resets at midnight UTC. Wait {secs} seconds, then retry"
        )),
        "{}",
        shed(&d).message
    );
    // a quota refusal holds no slot and spends no tokens
    assert_eq!(e.inflight(), 0);
    assert_eq!(rig.tokens(&e, "subject", "a"), 17);
    assert_eq!(rig.snap(&e).subjects[0].quota_used, 3.0);
    // the subject quota is per subject
    admitted_now(&rig.decide(&mut e, &call("b", "search")));
}

#[test]
fn tenant_daily_quota_sheds_across_subjects_and_counts_cost() {
    let rig = Rig::new("[limits.tenant]\ndaily_quota = 5\n");
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search").cost(2.0)));
    admitted_now(&rig.decide(&mut e, &call("b", "search").cost(2.0)));
    assert_eq!(rig.snap(&e).quota.day_used, 4.0);
    assert_eq!(rig.snap(&e).quota.daily_quota, Some(5.0));
    assert_shed(
        &rig.decide(&mut e, &call("c", "search").cost(2.0)),
        Scope::DailyQuota,
        12 * 3600 * SEC,
    );
    // exactly what is left still fits
    admitted_now(&rig.decide(&mut e, &call("c", "search").cost(1.0)));
    let d = rig.decide(&mut e, &call("d", "search"));
    assert_shed(&d, Scope::DailyQuota, 12 * 3600 * SEC);
    assert!(
        shed(&d)
            .message
            .contains("quota of this account is used up"),
        "{}",
        shed(&d).message
    );
    assert_eq!(rig.snap(&e).quota.day_used, 5.0);
}

#[test]
fn upstream_penalty_sheds_with_scope_upstream_penalty() {
    let rig = Rig::new(WAREHOUSE);
    let mut e = rig.engine("acme");
    let up: Arc<str> = Arc::from("warehouse");
    assert_eq!(
        e.feedback(&up, 429, Some(Duration::from_secs(5)), rig.now()),
        Some(Duration::from_secs(5))
    );
    let d = rig.decide(&mut e, &call("a", "get_sales"));
    assert_shed(&d, Scope::UpstreamPenalty, 5 * SEC);
    assert_eq!(shed(&d).reason, "upstream asked to slow down");
    assert!(
        shed(&d)
            .message
            .contains("The warehouse service asked for calls to slow down"),
        "{}",
        shed(&d).message
    );
    // nothing was spent by the refusal
    assert_eq!(rig.tokens(&e, "tenant", "acme"), 50);
    assert_eq!(e.inflight(), 0);
}

#[test]
fn cost_larger_than_a_bucket_is_oversized_and_spends_nothing() {
    let rig = Rig::new(
        "[limits.subject]\nrate = \"1/s\"\nburst = 2\n[tools.bulk]\ncost = 6\nrate = \"1/s\"\nburst = 5\n",
    );
    let mut e = rig.engine("acme");
    let d = rig.decide(&mut e, &call("a", "search").cost(3.0));
    assert_oversized(&d, "2");
    assert!(
        shed(&d).message.contains("Make the request smaller"),
        "{}",
        shed(&d).message
    );
    assert_eq!(e.inflight(), 0);
    // the whole burst is still there
    let d = rig.decide(&mut e, &call("a", "search").cost(2.0));
    admitted_now(&d);
    assert_eq!(remaining(&d, Layer::Subject), 0);
    // a tool's default cost over the tool bucket's burst (checked before the empty subject bucket)
    let d = rig.decide(&mut e, &call("b", "bulk").cost(6.0));
    assert_oversized(&d, "2");
    let rig = Rig::new("[tools.bulk]\ncost = 6\nrate = \"1/s\"\nburst = 5\n");
    let mut e = rig.engine("acme");
    let d = rig.decide(&mut e, &call("b", "bulk"));
    assert_eq!(d.resolved.cost, 6.0, "the tool's cost class applies");
    assert_oversized(&d, "5");
    admitted_now(&rig.decide(&mut e, &call("b", "bulk").cost(5.0)));
}

#[test]
fn cost_larger_than_a_daily_quota_is_oversized() {
    let rig = Rig::new(
        "[limits.subject]\nburst = 100\ndaily_quota = 10\n[limits.tenant]\nburst = 100\ndaily_quota = 30\n",
    );
    let mut e = rig.engine("acme");
    assert_oversized(&rig.decide(&mut e, &call("a", "search").cost(11.0)), "10");
    assert_eq!(rig.snap(&e).quota.day_used, 0.0);
    admitted_now(&rig.decide(&mut e, &call("a", "search").cost(10.0)));
    // with the quota partly used, a call that fits the quota but not what is left waits for midnight
    assert_shed(
        &rig.decide(&mut e, &call("a", "search").cost(1.0)),
        Scope::DailyQuota,
        12 * 3600 * SEC,
    );
    let rig =
        Rig::new("[limits.subject]\nburst = 100\n[limits.tenant]\nburst = 100\ndaily_quota = 30\n");
    let mut e = rig.engine("acme");
    assert_oversized(&rig.decide(&mut e, &call("a", "search").cost(31.0)), "30");
}

/// The limit an oversized refusal names is the largest cost that fits every layer and quota the call
/// passes, whichever layer it overflowed first; a call of that cost is then admitted.
#[test]
fn an_oversized_refusal_names_the_smallest_limit_on_the_path() {
    let rig = Rig::new(
        "[limits.subject]\nrate = \"100/min\"\nburst = 100\n[limits.tenant]\nrate = \"30/min\"\nburst = 30\n",
    );
    let mut e = rig.engine("acme");
    // Over the subject bucket (checked first) and the tenant's: the tenant's 30 is named.
    assert_oversized(&rig.decide(&mut e, &call("a", "search").cost(150.0)), "30");
    // Within the subject's burst, over the tenant's.
    assert_oversized(&rig.decide(&mut e, &call("a", "search").cost(99.0)), "30");
    admitted_now(&rig.decide(&mut e, &call("a", "search").cost(30.0)));

    // A daily quota smaller than every burst is the limit, whatever overflowed.
    let rig =
        Rig::new("[limits.subject]\nburst = 100\ndaily_quota = 40\n[limits.tenant]\nburst = 50\n");
    let mut e = rig.engine("acme");
    assert_oversized(&rig.decide(&mut e, &call("a", "search").cost(60.0)), "40");
    // A tool bucket smaller than the quota is the limit when the quota is what overflowed.
    let rig = Rig::new(
        "[limits.subject]\nburst = 100\ndaily_quota = 40\n[tools.bulk]\nrate = \"1/s\"\nburst = 5\n",
    );
    let mut e = rig.engine("acme");
    assert_oversized(&rig.decide(&mut e, &call("a", "bulk").cost(45.0)), "5");
    admitted_now(&rig.decide(&mut e, &call("a", "bulk").cost(5.0)));
}

// ---- 2. refunds -------------------------------------------------------------------------------------

#[test]
fn a_tenant_refusal_gives_back_subject_and_global_tokens() {
    let rig = Rig::new("[limits.subject]\nrate = \"1/s\"\nburst = 10\n[limits.tenant]\nrate = \"1/min\"\nburst = 3\n");
    let mut e = rig.engine("acme");
    for _ in 0..3 {
        admitted_now(&rig.decide(&mut e, &call("a", "search")));
    }
    assert_eq!(rig.tokens(&e, "subject", "a"), 7);
    assert_eq!(rig.global_tokens(), 4997);

    let d = rig.decide(&mut e, &call("b", "search"));
    assert_shed(&d, Scope::Tenant, 60 * SEC);
    // the decision's layers show the state after the refund
    assert_eq!(remaining(&d, Layer::Subject), 10);
    assert_eq!(remaining(&d, Layer::Tenant), 0);
    assert_eq!(remaining(&d, Layer::Global), 4997);
    assert_eq!(rig.tokens(&e, "subject", "b"), 10);

    let d = rig.decide(&mut e, &call("a", "search"));
    assert_eq!(shed(&d).scope, Scope::Tenant);
    assert_eq!(remaining(&d, Layer::Subject), 7);
    assert_eq!(rig.tokens(&e, "subject", "a"), 7);
    assert_eq!(rig.global_tokens(), 4997);
    // and the slots of the refused calls were given back
    assert_eq!(e.inflight(), 3);
}

#[test]
fn an_upstream_refusal_gives_back_every_earlier_layer() {
    let rig = Rig::new(
        "[tools.get_sales]\nupstream = \"warehouse\"\nrate = \"1/s\"\nburst = 5\n[upstreams.warehouse]\nrate = \"1/min\"\nburst = 1\n",
    );
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "get_sales")));
    let d = rig.decide(&mut e, &call("b", "get_sales"));
    assert_shed(&d, Scope::TenantUpstream, 60 * SEC);
    assert_eq!(rig.tokens(&e, "subject", "b"), 20);
    assert_eq!(rig.tokens(&e, "subject_tool", "b/get_sales"), 5);
    assert_eq!(rig.tokens(&e, "tenant", "acme"), 49);
    assert_eq!(rig.global_tokens(), 4999);
    assert_eq!(e.inflight(), 1);
}

#[test]
fn a_bucket_refusal_gives_back_daily_quota() {
    let rig = Rig::new(
        "[limits.subject]\nrate = \"1/min\"\nburst = 2\ndaily_quota = 100\n[limits.tenant]\ndaily_quota = 1000\n",
    );
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    for _ in 0..3 {
        assert_eq!(
            shed(&rig.decide(&mut e, &call("a", "search"))).scope,
            Scope::Subject
        );
    }
    let s = rig.snap(&e);
    assert_eq!(s.subjects[0].quota_used, 2.0);
    assert_eq!(s.quota.day_used, 2.0);
    assert_eq!(s.inflight, 2);
}

#[test]
fn a_global_refusal_gives_back_daily_quota_too() {
    // the refusing layer is the last one, after the quota and four buckets took their share
    let rig = Rig::new(
        "[limits.global]\nrate = \"1/min\"\nburst = 1\n[limits.tenant]\ndaily_quota = 10\n",
    );
    let mut acme = rig.engine("acme");
    let mut globex = rig.engine("globex");
    admitted_now(&rig.decide(&mut acme, &call("a", "search")));
    assert_shed(
        &rig.decide(&mut globex, &call("g", "search").cost(1.0)),
        Scope::Global,
        60 * SEC,
    );
    let s = rig.snap(&globex);
    assert_eq!(s.quota.day_used, 0.0);
    assert_eq!(bucket(&s, "tenant", "globex").tokens, 50);
}

// ---- 3. holds ---------------------------------------------------------------------------------------

const FAST_ONE: &str = "[limits.subject]\nrate = \"10/s\"\nburst = 1\n";

#[test]
fn a_hold_lasts_exactly_until_the_token_refills() {
    let rig = Rig::new(FAST_ONE);
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search").wait_ms(250)));
    rig.advance_ms(30);
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_eq!(admitted(&d).hold_ns, 70 * MS);
    assert_eq!(remaining(&d, Layer::Subject), 0);
    // a second held call queues behind the first inside the bucket
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_eq!(admitted(&d).hold_ns, 170 * MS);
    // the next would need 270 ms: beyond its 250 ms it is shed, told the true wait
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_shed(&d, Scope::Subject, 270 * MS);
    // with a longer allowance it is not held into the token promised to the call just refused:
    // it is promised the one after (the daemon waits for it on its caller's behalf)
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(400));
    assert_shed(&d, Scope::Subject, 370 * MS);
}

#[test]
fn a_hold_on_a_later_layer_takes_the_longest_wait() {
    let rig = Rig::new("[limits.tenant]\nrate = \"4/s\"\nburst = 1\n");
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("b", "search").wait_ms(1000));
    assert_eq!(admitted(&d).hold_ns, 250 * MS);
    assert_eq!(remaining(&d, Layer::Subject), 19);
}

#[test]
fn cancelling_a_held_lease_returns_its_tokens_and_slot() {
    let rig = Rig::new("[limits.subject]\nrate = \"10/s\"\nburst = 1\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let l1 = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    rig.release_ok(&mut e, l1);
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    let held = admitted(&d).lease;
    assert_eq!(admitted(&d).hold_ns, 100 * MS);
    assert_eq!(rig.tokens(&e, "tenant", "acme"), 48);
    // the held call has the only slot
    assert_eq!(
        shed(&rig.decide(&mut e, &call("a", "search"))).scope,
        Scope::Concurrency
    );
    assert_eq!(e.inflight(), 1);

    // its caller goes away
    assert_eq!(e.cancel_lease(held, rig.now(), rig.wall()), Ok(vec![]));
    assert_eq!(e.inflight(), 0);
    assert_eq!(rig.tokens(&e, "tenant", "acme"), 49);
    assert_eq!(
        e.cancel_lease(held, rig.now(), rig.wall()),
        Err(UnknownLease)
    );
    assert_eq!(rig.release(&mut e, held, &ok()).unwrap_err(), UnknownLease);
    // 100 ms later the first call's token is back, and the cancelled one's reservation is gone
    rig.advance_ms(100);
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
}

#[test]
fn cancelling_a_lease_that_was_not_held_frees_its_slot_but_keeps_the_tokens_spent() {
    let rig = Rig::new("[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let l = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    assert_eq!(e.cancel_lease(l, rig.now(), rig.wall()), Ok(vec![]));
    assert_eq!(e.inflight(), 0);
    assert_eq!(rig.tokens(&e, "subject", "a"), 19);
}

// ---- 4. the concurrency queue -----------------------------------------------------------------------

#[test]
fn a_release_grants_queued_calls_oldest_first() {
    let rig = Rig::new("[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let l1 = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let (w2, dl2) = rig.queue(&mut e, &call("a", "search").wait_ms(1000));
    assert_eq!(dl2, t0 + SEC);
    rig.advance_ms(10);
    let (w3, dl3) = rig.queue(&mut e, &call("a", "fetch").wait_ms(1000));
    assert_eq!(dl3, t0 + 1010 * MS);
    assert_ne!(w2, w3);
    assert_eq!(rig.snap(&e).waiting, 2);
    assert_eq!(e.next_waiter_deadline(), Some(dl2));

    rig.advance_ms(90);
    let r = rig.release_ok(&mut e, l1);
    assert_eq!(r.granted.len(), 1, "one slot, one grant");
    let (id, d) = &r.granted[0];
    assert_eq!(*id, w2, "oldest first");
    assert_eq!(&*d.resolved.tool, "search");
    let a2 = admitted(d);
    assert_eq!(a2.queued_ns, 100 * MS);
    assert_eq!(a2.hold_ns, 0);
    assert_eq!(rig.snap(&e).waiting, 1);

    rig.advance_ms(200);
    let r = rig.release_ok(&mut e, a2.lease);
    assert_eq!(r.granted.len(), 1);
    assert_eq!(r.granted[0].0, w3);
    assert_eq!(&*r.granted[0].1.resolved.tool, "fetch");
    assert_eq!(admitted(&r.granted[0].1).queued_ns, 290 * MS);
    assert_eq!(rig.snap(&e).waiting, 0);
    assert_eq!(e.inflight(), 1);
}

#[test]
fn queued_calls_of_a_blocked_subject_do_not_block_other_subjects() {
    let rig = Rig::new("[limits.subject]\nconcurrency = 1\n[limits.tenant]\nconcurrency = 2\n");
    let mut e = rig.engine("acme");
    let la = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let lb = admitted_now(&rig.decide(&mut e, &call("b", "search")));
    let (wa, _) = rig.queue(&mut e, &call("a", "search").wait_ms(1000));
    let (wc, _) = rig.queue(&mut e, &call("c", "search").wait_ms(1000));
    // b's slot goes to c: a's waiter still waits for a's own slot
    let r = rig.release_ok(&mut e, lb);
    assert_eq!(r.granted.iter().map(|g| g.0).collect::<Vec<_>>(), vec![wc]);
    let r = rig.release_ok(&mut e, la);
    assert_eq!(r.granted.iter().map(|g| g.0).collect::<Vec<_>>(), vec![wa]);
}

#[test]
fn a_cancelled_waiter_is_skipped() {
    let rig = Rig::new("[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let l1 = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let (w2, _) = rig.queue(&mut e, &call("a", "search").wait_ms(1000));
    let (w3, _) = rig.queue(&mut e, &call("a", "search").wait_ms(1000));
    assert!(e.cancel_waiter(w2));
    assert!(!e.cancel_waiter(w2), "already gone");
    assert!(!e.cancel_waiter(l1), "a lease is not a waiter");
    let r = rig.release_ok(&mut e, l1);
    assert_eq!(r.granted.iter().map(|g| g.0).collect::<Vec<_>>(), vec![w3]);
}

#[test]
fn waiters_past_their_deadline_are_shed_with_scope_concurrency() {
    let rig = Rig::new("[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let l1 = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let (w2, _) = rig.queue(&mut e, &call("a", "search").wait_ms(500));
    let (w3, _) = rig.queue(&mut e, &call("a", "search").wait_ms(600));
    assert_eq!(e.expire_waiters(t0 + 499 * MS), vec![]);
    let out = e.expire_waiters(t0 + 500 * MS);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, w2);
    // The slot frees at 1 s and goes to w3, queued ahead; w2 is promised the one after that.
    assert_shed(&out[0].1, Scope::Concurrency, 1_550 * MS);
    assert_eq!(e.next_waiter_deadline(), Some(t0 + 600 * MS));
    // a release after w3's deadline does not grant it: it is shed instead, and the slot stays free
    rig.advance_to(t0 + 600 * MS);
    let r = rig.release_ok(&mut e, l1);
    assert_eq!(r.granted.len(), 1);
    assert_eq!(r.granted[0].0, w3);
    assert_eq!(shed(&r.granted[0].1).scope, Scope::Concurrency);
    assert_eq!(e.inflight(), 0);
    assert_eq!(e.next_waiter_deadline(), None);
}

#[test]
fn the_queue_is_bounded_and_a_zero_wait_never_queues() {
    let rig = Rig::new("[server]\nmax_queue = 1\n[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    assert_shed(
        &rig.decide(&mut e, &call("a", "search")),
        Scope::Concurrency,
        SEC + 50 * MS,
    );
    rig.queue(&mut e, &call("a", "search").wait_ms(1000));
    // refused at the same moment as the first: behind the queued call and the promised one
    assert_shed(
        &rig.decide(&mut e, &call("a", "search").wait_ms(1000)),
        Scope::Concurrency,
        3_050 * MS,
    );
    assert_eq!(rig.snap(&e).waiting, 1);
}

#[test]
fn concurrency_hints_follow_the_slots_as_they_are_expected_to_free() {
    // Two slots, no run reported yet (the 1 s default): the refused calls are promised the slots
    // in rounds of two, each round a run (and a 50 ms margin) after the one before.
    let rig = Rig::new("[limits.subject]\nconcurrency = 2\n");
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    for k in 0..8u64 {
        let d = rig.decide(&mut e, &call("a", "search"));
        assert_shed(&d, Scope::Concurrency, (k / 2 + 1) * 1_050 * MS);
    }
    // Another subject's refusals are its own.
    admitted_now(&rig.decide(&mut e, &call("b", "search")));
    admitted_now(&rig.decide(&mut e, &call("b", "search")));
    assert_shed(
        &rig.decide(&mut e, &call("b", "search")),
        Scope::Concurrency,
        1_050 * MS,
    );
    // Nobody came back: past their grace the promises are forgotten, and the calls in flight,
    // late now, are expected to end soon (the floor, a tenth of a run).
    rig.advance_ms(6_000);
    assert_shed(
        &rig.decide(&mut e, &call("a", "search")),
        Scope::Concurrency,
        150 * MS,
    );
}

#[test]
fn tenant_concurrency_hints_follow_the_slots_of_the_whole_tenant() {
    let rig = Rig::new("[limits.tenant]\nconcurrency = 4\n");
    let mut e = rig.engine("acme");
    for s in ["a", "b", "c", "d"] {
        admitted_now(&rig.decide(&mut e, &call(s, "search")));
    }
    // Four slots free at 1 s: the first four refused get one each, the fifth waits a round.
    for s in ["e", "f", "g", "h"] {
        let d = rig.decide(&mut e, &call(s, "search"));
        assert_shed(&d, Scope::Concurrency, 1_050 * MS);
    }
    let d = rig.decide(&mut e, &call("i", "search"));
    assert_shed(&d, Scope::Concurrency, 2_100 * MS);
}

// ---- 5. lease expiry --------------------------------------------------------------------------------

#[test]
fn an_unreleased_lease_expires_after_the_lease_ttl() {
    let rig = Rig::new("[server]\nlease_ttl = \"10s\"\n[limits.subject]\nconcurrency = 1\n");
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let l1 = admitted_now(&rig.decide(&mut e, &call("a", "search").up("warehouse")));
    let (w, _) = rig.queue(&mut e, &call("a", "search").wait_ms(30_000));
    assert_eq!(
        e.expire_leases(t0 + 10 * SEC - 1, rig.wall()),
        (vec![], vec![])
    );
    assert_eq!(e.inflight(), 1);

    rig.advance_to(t0 + 10 * SEC);
    let (expired, granted) = e.expire_leases(rig.now(), rig.wall());
    assert_eq!(
        expired,
        vec![(
            Arc::from("a"),
            Arc::from("search"),
            Some(Arc::from("warehouse"))
        )]
    );
    assert_eq!(granted.len(), 1);
    assert_eq!(granted[0].0, w);
    assert_eq!(admitted(&granted[0].1).queued_ns, 10 * SEC);
    // the expired lease is unknown now
    assert_eq!(rig.release(&mut e, l1, &ok()).unwrap_err(), UnknownLease);
    assert_eq!(e.lease_count(), 1);
    assert_eq!(e.inflight(), 1);
}

#[test]
fn a_released_lease_is_unknown_on_a_second_release_and_never_expires_twice() {
    let rig = Rig::new("[server]\nlease_ttl = \"10s\"\n");
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let l = admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let r = rig.release_ok(&mut e, l);
    assert_eq!(
        (&*r.subject, &*r.tool, r.upstream, r.penalty),
        ("a", "search", None, None)
    );
    assert_eq!(rig.release(&mut e, l, &ok()).unwrap_err(), UnknownLease);
    assert_eq!(rig.release(&mut e, 12345, &ok()).unwrap_err(), UnknownLease);
    assert_eq!(e.expire_leases(t0 + 20 * SEC, rig.wall()), (vec![], vec![]));
    assert_eq!(e.inflight(), 0);
    assert_eq!(e.lease_count(), 0);
}

#[test]
fn a_held_lease_expires_a_ttl_after_its_hold_ends() {
    let rig =
        Rig::new("[server]\nlease_ttl = \"10s\"\n[limits.subject]\nrate = \"10/s\"\nburst = 1\n");
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_eq!(admitted(&d).hold_ns, 100 * MS);
    assert_eq!(
        e.expire_leases(t0 + 10 * SEC, rig.wall()).0.len(),
        1,
        "only the unheld lease"
    );
    assert_eq!(
        e.expire_leases(t0 + 10 * SEC + 100 * MS - 1, rig.wall())
            .0
            .len(),
        0
    );
    assert_eq!(
        e.expire_leases(t0 + 10 * SEC + 100 * MS, rig.wall())
            .0
            .len(),
        1
    );
    assert_eq!(e.inflight(), 0);
}

#[test]
fn leases_expire_at_their_own_ends_whatever_order_those_come_in() {
    // A held call's lease ends after those admitted after it; a reload that shortens the TTL makes
    // new leases end before older ones. Each must expire at its own end, no earlier and no later.
    let base = "[limits.subject]\nrate = \"10/s\"\nburst = 1\n";
    let rig = Rig::new(&format!("[server]\nlease_ttl = \"10s\"\n{base}"));
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    admitted_now(&rig.decide(&mut e, &call("held", "search")));
    let held = admitted(&rig.decide(&mut e, &call("held", "search").wait_ms(500))).hold_ns;
    assert_eq!(held, 100 * MS);
    let mut ends = vec![(t0 + 10 * SEC, "held"), (t0 + 10 * SEC + held, "held")];
    for (i, s) in ["a", "b"].into_iter().enumerate() {
        rig.advance_to(t0 + (i as u64 + 1) * 10 * MS);
        admitted_now(&rig.decide(&mut e, &call(s, "search")));
        ends.push((rig.now() + 10 * SEC, s));
    }
    e.set_config(
        Arc::new(cfg(&format!("[server]\nlease_ttl = \"2s\"\n{base}"))),
        rig.now(),
    );
    for (i, s) in ["c", "d"].into_iter().enumerate() {
        rig.advance_to(t0 + (i as u64 + 3) * 10 * MS);
        admitted_now(&rig.decide(&mut e, &call(s, "search")));
        ends.push((rig.now() + 2 * SEC, s));
    }
    ends.sort();
    assert_eq!(e.next_lease_expiry(), Some(ends[0].0));
    for (at, subject) in ends {
        assert_eq!(
            e.expire_leases(at - 1, rig.wall()).0,
            vec![],
            "{subject} early"
        );
        let (expired, _) = e.expire_leases(at, rig.wall());
        assert_eq!(expired.len(), 1, "{subject} at its end");
        assert_eq!(&*expired[0].0, subject);
    }
    assert_eq!(e.lease_count(), 0);
    assert_eq!(e.next_lease_expiry(), None);
}

// ---- 6. penalties -----------------------------------------------------------------------------------

const PENALTY_CFG: &str = r#"
[tools.get_sales]
upstream = "warehouse"
[tools.geocode]
upstream = "maps"
[upstreams.warehouse]
rate = "100/s"
burst = 100
[upstreams.maps]
rate = "100/s"
burst = 100
shared = true
"#;

/// Releases a fresh `tool` lease of tenant `e` with `info`, returning the penalty it started.
fn release_with(
    rig: &Rig,
    e: &mut TenantEngine,
    tool: &str,
    info: &ReleaseInfo,
) -> Option<Duration> {
    let l = rig.lease(e, &call("worker", tool));
    rig.release(e, l, info).expect("live lease").penalty
}

/// Asserts that `tool` is in the penalty box of `e` for exactly `left_ns` more, then out of it.
/// Asserts the penalty box refuses `tool` for `left_ns` more and then lets it through: the first call
/// refused is told the penalty's end; the next, refused 1 ms before the end, is told a refill step of
/// the upstream's budget after it (see `penalty_hints_are_staggered_along_the_upstreams_refill`).
fn assert_penalised_for(rig: &Rig, e: &mut TenantEngine, tool: &str, left_ns: u64) {
    let t = rig.now();
    assert_shed(
        &rig.decide(e, &call("a", tool)),
        Scope::UpstreamPenalty,
        left_ns,
    );
    rig.advance_to(t + left_ns - MS);
    let next = shed(&rig.decide(e, &call("a", tool))).clone();
    assert_eq!(next.scope, Scope::UpstreamPenalty);
    assert!(
        (2..=1 + 100).contains(&next.retry_after_ms),
        "1 ms to the end plus one step: {next:?}"
    );
    rig.advance_to(t + left_ns);
    admitted_now(&rig.decide(e, &call("a", tool)));
}

#[test]
fn an_upstream_rate_limited_release_penalises_the_upstream_for_retry_after() {
    let rig = Rig::new(PENALTY_CFG);
    let mut e = rig.engine("acme");
    let info = ReleaseInfo {
        outcome: Outcome::UpstreamRateLimited,
        upstream_status: None,
        ..rate_limited(None)
    };
    let info = ReleaseInfo {
        retry_after: Some(Duration::from_secs(30)),
        ..info
    };
    assert_eq!(
        release_with(&rig, &mut e, "get_sales", &info),
        Some(Duration::from_secs(30))
    );
    // other tools on the same upstream are paused too; tools on other upstreams are not
    assert_eq!(
        shed(&rig.decide(&mut e, &call("b", "report").up("warehouse"))).scope,
        Scope::UpstreamPenalty
    );
    admitted_now(&rig.decide(&mut e, &call("b", "search")));
    let p = &rig.snap(&e).penalties;
    assert_eq!(p.len(), 1);
    assert_eq!(
        (p[0].upstream.as_str(), p[0].shared, p[0].retry_after_ms),
        ("warehouse", false, 30_000)
    );
    rig.advance_ms(10_000);
    assert_shed(
        &rig.decide(&mut e, &call("b", "get_sales")),
        Scope::UpstreamPenalty,
        20 * SEC,
    );
    assert_penalised_for(&rig, &mut e, "get_sales", 20 * SEC);
    assert!(rig.snap(&e).penalties.is_empty());
}

#[test]
fn a_429_status_with_outcome_ok_penalises_too() {
    let rig = Rig::new(PENALTY_CFG);
    let mut e = rig.engine("acme");
    let info = ReleaseInfo {
        upstream_status: Some(429),
        retry_after: Some(Duration::from_secs(30)),
        ..ok()
    };
    assert_eq!(
        release_with(&rig, &mut e, "get_sales", &info),
        Some(Duration::from_secs(30))
    );
    assert_penalised_for(&rig, &mut e, "get_sales", 30 * SEC);
}

#[test]
fn other_outcomes_and_statuses_do_not_penalise() {
    let rig = Rig::new(PENALTY_CFG);
    let mut e = rig.engine("acme");
    for info in [
        ok(),
        ReleaseInfo {
            outcome: Outcome::Error,
            upstream_status: Some(503),
            retry_after: Some(Duration::from_secs(30)),
            duration_ms: None,
        },
        ReleaseInfo {
            outcome: Outcome::Cancelled,
            ..ok()
        },
    ] {
        assert_eq!(release_with(&rig, &mut e, "get_sales", &info), None);
    }
    // a 429 on a lease with no upstream has nothing to penalise
    assert_eq!(
        release_with(&rig, &mut e, "search", &rate_limited(None)),
        None
    );
    let up: Arc<str> = Arc::from("warehouse");
    assert_eq!(
        e.feedback(&up, 503, Some(Duration::from_secs(30)), rig.now()),
        None
    );
    admitted_now(&rig.decide(&mut e, &call("a", "get_sales")));
    assert!(rig.snap(&e).penalties.is_empty());
}

#[test]
fn a_429_without_retry_after_penalises_for_one_second() {
    let rig = Rig::new(PENALTY_CFG);
    let mut e = rig.engine("acme");
    assert_eq!(
        release_with(&rig, &mut e, "get_sales", &rate_limited(None)),
        Some(Duration::from_secs(1))
    );
    assert_penalised_for(&rig, &mut e, "get_sales", SEC);
}

#[test]
fn feedback_429_penalises_and_never_shortens_a_longer_penalty() {
    let rig = Rig::new(PENALTY_CFG);
    let mut e = rig.engine("acme");
    let up: Arc<str> = Arc::from("warehouse");
    assert_eq!(
        e.feedback(&up, 429, Some(Duration::from_secs(30)), rig.now()),
        Some(Duration::from_secs(30))
    );
    assert_eq!(
        e.feedback(&up, 429, Some(Duration::from_secs(5)), rig.now()),
        Some(Duration::from_secs(5))
    );
    assert_penalised_for(&rig, &mut e, "get_sales", 30 * SEC);
    assert_eq!(
        e.feedback(&up, 429, None, rig.now()),
        Some(Duration::from_secs(1))
    );
    assert_penalised_for(&rig, &mut e, "get_sales", SEC);
}

#[test]
fn penalty_hints_promise_the_budgets_slots_after_the_penalty() {
    // warehouse refills 100/s (burst 100), halved by the 429 to 50/s: the calls refused during the
    // penalty are promised the budget's slots after its end, the full burst at the end and then
    // one refill step (20 ms) apart. (Concurrency out of the way: with the default 32 slots and
    // no run reported yet, the 33rd call would be promised a slot a second later.)
    let rig = Rig::new(&format!(
        "{PENALTY_CFG}[limits.tenant]\nconcurrency = 1000\n"
    ));
    let mut e = rig.engine("acme");
    let up: Arc<str> = Arc::from("warehouse");
    e.feedback(&up, 429, Some(Duration::from_secs(10)), rig.now());
    for k in 0..100u64 {
        let d = rig.decide(&mut e, &call(&format!("s{k}"), "get_sales"));
        assert_shed(&d, Scope::UpstreamPenalty, 10 * SEC);
    }
    for k in 1..4u64 {
        let d = rig.decide(&mut e, &call("late", "get_sales"));
        assert_shed(&d, Scope::UpstreamPenalty, 10 * SEC + k * 20 * MS);
    }
    // A call that costs 5 takes five steps of the refill.
    let d = rig.decide(&mut e, &call("big", "get_sales").cost(5.0));
    assert_shed(&d, Scope::UpstreamPenalty, 10 * SEC + 8 * 20 * MS);
}

#[test]
fn a_shared_upstream_penalty_hint_is_the_shared_budgets_slot_after_it() {
    // maps is shared (100/s, burst 100): after the penalty its burst is back, for either tenant.
    let rig = Rig::new(PENALTY_CFG);
    let mut acme = rig.engine("acme");
    let mut globex = rig.engine("globex");
    let up: Arc<str> = Arc::from("maps");
    acme.feedback(&up, 429, Some(Duration::from_secs(5)), rig.now());
    for k in 0..4u64 {
        let e = if k % 2 == 0 { &mut acme } else { &mut globex };
        let d = rig.decide(e, &call("a", "geocode"));
        assert_shed(&d, Scope::UpstreamPenalty, 5 * SEC);
    }
}

#[test]
fn without_an_upstream_budget_penalty_hints_follow_the_tenants_refill_and_start_over() {
    // No budget for the upstream: the step is the tenant's (600/min, 100 ms a call). The spread
    // covers the penalty's length (1 s here) and then starts over, so a loop of refusals cannot
    // push the hints of others further and further out.
    let rig = Rig::new("[limits.tenant]\nrate = \"600/min\"\nburst = 1000\n");
    let mut e = rig.engine("acme");
    let up: Arc<str> = Arc::from("crm");
    e.feedback(&up, 429, Some(Duration::from_secs(1)), rig.now());
    for k in 0..=10u64 {
        let d = rig.decide(&mut e, &call("a", "t").up("crm"));
        assert_shed(&d, Scope::UpstreamPenalty, SEC + k * 100 * MS);
    }
    let d = rig.decide(&mut e, &call("a", "t").up("crm"));
    assert_shed(&d, Scope::UpstreamPenalty, SEC);
}

#[test]
fn a_shared_upstream_penalty_pauses_every_tenant_a_per_tenant_one_does_not() {
    let rig = Rig::new(PENALTY_CFG);
    let mut acme = rig.engine("acme");
    let mut globex = rig.engine("globex");
    let thirty = Some(Duration::from_secs(30));
    assert_eq!(
        release_with(&rig, &mut acme, "geocode", &rate_limited(thirty)),
        thirty
    );
    assert_eq!(
        release_with(&rig, &mut acme, "get_sales", &rate_limited(thirty)),
        thirty
    );

    // the shared one reaches globex, the per-tenant one does not
    assert_shed(
        &rig.decide(&mut globex, &call("g", "geocode")),
        Scope::UpstreamPenalty,
        30 * SEC,
    );
    assert!(shed(&rig.decide(&mut globex, &call("g", "geocode")))
        .message
        .contains("The maps service asked"));
    admitted_now(&rig.decide(&mut globex, &call("g", "get_sales")));
    let p = &rig.snap(&globex).penalties;
    assert_eq!(p.len(), 1);
    assert_eq!(
        (p[0].upstream.as_str(), p[0].shared, p[0].retry_after_ms),
        ("maps", true, 30_000)
    );

    // feedback from globex on the shared upstream reaches acme as well
    rig.advance_ms(30_000);
    admitted_now(&rig.decide(&mut acme, &call("a", "geocode")));
    let maps: Arc<str> = Arc::from("maps");
    globex.feedback(&maps, 429, Some(Duration::from_secs(7)), rig.now());
    assert_penalised_for(&rig, &mut acme, "geocode", 7 * SEC);
}

#[test]

fn a_queued_call_is_not_granted_into_a_penalty_its_slot_release_started() {
    let rig = Rig::new(&format!("[limits.subject]\nconcurrency = 1\n{PENALTY_CFG}"));
    let mut e = rig.engine("acme");
    let l1 = rig.lease(&mut e, &call("a", "get_sales"));
    let (w, _) = rig.queue(&mut e, &call("a", "get_sales").wait_ms(2000));
    let r = rig
        .release(&mut e, l1, &rate_limited(Some(Duration::from_secs(30))))
        .expect("live lease");
    assert_eq!(r.penalty, Some(Duration::from_secs(30)));
    assert_eq!(r.granted.len(), 1);
    assert_eq!(r.granted[0].0, w);
    // the upstream just answered 429: the waiter is refused like a new call would be, not sent to it
    assert_shed(&r.granted[0].1, Scope::UpstreamPenalty, 30 * SEC);
    assert_eq!(e.inflight(), 0);
}

#[test]
fn a_reported_delay_penalises_for_exactly_that_long_to_the_millisecond() {
    // The API turns a Retry-After (delay-seconds or HTTP-date) into a delay; the engine keeps
    // whatever delay it is given, to the millisecond, and a zero delay (a date in the past) is none.
    let rig = Rig::new(PENALTY_CFG);
    let mut e = rig.engine("acme");

    release_with(
        &rig,
        &mut e,
        "get_sales",
        &rate_limited(Some(Duration::from_secs(30))),
    );
    assert_penalised_for(&rig, &mut e, "get_sales", 30 * SEC);

    rig.advance_ms(250);
    let d = Duration::from_millis(44_750);
    release_with(&rig, &mut e, "get_sales", &rate_limited(Some(d)));
    assert_penalised_for(&rig, &mut e, "get_sales", 44_750 * MS);

    release_with(
        &rig,
        &mut e,
        "get_sales",
        &rate_limited(Some(Duration::ZERO)),
    );
    admitted_now(&rig.decide(&mut e, &call("a", "get_sales")));
}

// ---- 7. daily rollover ------------------------------------------------------------------------------

#[test]
fn daily_quota_comes_back_at_utc_midnight() {
    let rig = Rig::at(
        "[limits.subject]\ndaily_quota = 2\n[limits.tenant]\ndaily_quota = 3\n",
        LAST_SECOND - 1000,
    );
    let mut e = rig.engine("acme");
    for _ in 0..2 {
        let l = rig.lease(&mut e, &call("a", "search"));
        rig.release_ok(&mut e, l);
    }
    let l = rig.lease(&mut e, &call("b", "search"));
    rig.release_ok(&mut e, l);
    rig.advance_ms(1000);
    assert_eq!(rig.wall(), LAST_SECOND);
    assert_shed(
        &rig.decide(&mut e, &call("a", "search")),
        Scope::DailyQuota,
        SEC,
    );
    assert_shed(
        &rig.decide(&mut e, &call("c", "search")),
        Scope::DailyQuota,
        SEC,
    );
    assert_eq!(rig.snap(&e).quota.resets_in_ms, 1000);
    rig.advance_ms(999);
    assert_shed(
        &rig.decide(&mut e, &call("c", "search")),
        Scope::DailyQuota,
        MS,
    );
    rig.advance_ms(1);
    assert_eq!(rig.wall() % 86_400_000, 0, "00:00:00.000 UTC");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    assert_eq!(
        shed(&rig.decide(&mut e, &call("a", "search"))).scope,
        Scope::DailyQuota
    );
    let s = rig.snap(&e);
    assert_eq!(s.quota.day_used, 2.0);
    assert_eq!(s.quota.resets_in_ms, 86_400_000);
}

// ---- 8. plans ---------------------------------------------------------------------------------------

#[test]
fn a_plan_overrides_the_limits_of_its_tenants_only() {
    let rig = Rig::new(
        "[plans.free.subject]\nrate = \"30/min\"\nburst = 5\n[tenants.globex]\nplan = \"free\"\n",
    );
    let mut globex = rig.engine("globex");
    let mut acme = rig.engine("acme");
    for _ in 0..5 {
        admitted_now(&rig.decide(&mut globex, &call("g", "search")));
    }
    let d = rig.decide(&mut globex, &call("g", "search"));
    assert_shed(&d, Scope::Subject, 2 * SEC);
    let l = d.layers[0].clone();
    assert_eq!((l.layer, l.burst, l.window_secs), (Layer::Subject, 5.0, 10));
    let s = rig.snap(&globex);
    assert_eq!(s.plan.as_deref(), Some("free"));
    assert_eq!(bucket(&s, "subject", "g").rate_per_sec, 0.5);

    for _ in 0..20 {
        let l = admitted_now(&rig.decide(&mut acme, &call("g", "search")));
        rig.release_ok(&mut acme, l);
    }
    let d = rig.decide(&mut acme, &call("g", "search"));
    assert_shed(&d, Scope::Subject, 500 * MS);
    assert_eq!((d.layers[0].burst, d.layers[0].window_secs), (20.0, 10));
    let s = rig.snap(&acme);
    assert_eq!(s.plan, None);
    assert_eq!(bucket(&s, "subject", "g").rate_per_sec, 2.0);
    // the plan overrides the subject layer only: the tenant layer is the base one for both
    assert_eq!(bucket(&rig.snap(&globex), "tenant", "globex").burst, 50.0);
}

// ---- 9. shadow mode ---------------------------------------------------------------------------------

#[test]
fn shadow_mode_admits_what_it_would_shed_and_spends_nothing() {
    let toml = "[limits.tenant]\nrate = \"1/min\"\nburst = 2\n";
    let shadow_rig = Rig::new(&format!("[server]\nmode = \"shadow\"\n{toml}"));
    let enforce_rig = Rig::new(toml);
    let mut sh = shadow_rig.engine("acme");
    let mut en = enforce_rig.engine("acme");
    for _ in 0..2 {
        let d = shadow_rig.decide(&mut sh, &call("a", "search"));
        assert_eq!(admitted(&d).mode, Mode::Shadow);
        assert_eq!(admitted(&d).would_shed, None);
        admitted_now(&enforce_rig.decide(&mut en, &call("a", "search")));
    }
    for _ in 0..3 {
        let d = shadow_rig.decide(&mut sh, &call("a", "search"));
        let a = admitted(&d);
        assert_eq!(a.mode, Mode::Shadow);
        assert_eq!(a.hold_ns, 0);
        let would = a.would_shed.as_ref().expect("would have been shed");
        assert_eq!(would.scope, Scope::Tenant);
        assert!(would.retryable);
        // the same call in enforce mode is shed the same way, with the same remaining tokens
        let de = enforce_rig.decide(&mut en, &call("a", "search"));
        assert_eq!(shed(&de).scope, Scope::Tenant);
        assert_eq!(d.layers, de.layers);
        assert_eq!(remaining(&d, Layer::Subject), 18);
        assert_eq!(remaining(&d, Layer::Tenant), 0);
    }
    let s = shadow_rig.snap(&sh);
    assert_eq!(bucket(&s, "subject", "a").tokens, 18);
    assert_eq!(bucket(&s, "tenant", "acme").tokens, 0);
    assert_eq!(shadow_rig.global_tokens(), 4998);
    // shadow admissions of would-be-shed calls hold no slot but can be released
    assert_eq!(s.inflight, 2);
    assert_eq!(s.leases, 5);
}

#[test]
fn shadow_mode_reports_concurrency_and_quota_refusals_without_queueing() {
    let rig = Rig::new(
        "[server]\nmode = \"shadow\"\n[limits.subject]\nconcurrency = 1\ndaily_quota = 2\n",
    );
    let mut e = rig.engine("acme");
    admitted(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(1000));
    let would = admitted(&d).would_shed.as_ref().expect("would be shed");
    assert_eq!(would.scope, Scope::Concurrency);
    assert_eq!(e.inflight(), 1);
    assert_eq!(rig.snap(&e).waiting, 0);
    assert_eq!(
        rig.release(&mut e, admitted(&d).lease, &ok())
            .map(|r| r.granted.len()),
        Ok(0)
    );
    assert_eq!(
        e.inflight(),
        1,
        "releasing a shadow stand-in frees no one else's slot"
    );

    let rig = Rig::new("[server]\nmode = \"shadow\"\n[limits.subject]\ndaily_quota = 2\n");
    let mut e = rig.engine("acme");
    admitted(&rig.decide(&mut e, &call("a", "search").cost(2.0)));
    let d = rig.decide(&mut e, &call("a", "search"));
    assert_eq!(
        admitted(&d).would_shed.as_ref().map(|s| s.scope),
        Some(Scope::DailyQuota)
    );
    assert_eq!(rig.snap(&e).subjects[0].quota_used, 2.0);
    assert_eq!(e.inflight(), 1);
}

// ---- 10. reload -------------------------------------------------------------------------------------

#[test]
fn reload_keeps_missing_tokens_leases_and_quota() {
    let rig = Rig::new("[limits.subject]\nrate = \"1/s\"\nburst = 10\ndaily_quota = 100\n");
    let mut e = rig.engine("acme");
    let leases: Vec<u64> = (0..6)
        .map(|_| rig.lease(&mut e, &call("a", "search")))
        .collect();
    let before = rig.snap(&e);
    assert_eq!(bucket(&before, "subject", "a").tokens, 4);
    assert_eq!(bucket(&before, "tenant", "acme").tokens, 44);

    e.set_config(
        Arc::new(cfg(
            "[limits.subject]\nrate = \"2/s\"\nburst = 10\ndaily_quota = 100\n",
        )),
        rig.now(),
    );
    let s = rig.snap(&e);
    let b = bucket(&s, "subject", "a");
    assert_eq!(
        (b.tokens, b.rate_per_sec, b.reset_ms),
        (4, 2.0, 3000),
        "6 tokens missing, at the new rate"
    );
    assert_eq!(bucket(&s, "tenant", "acme").tokens, 44);
    assert_eq!(s.subjects[0].quota_used, 6.0);
    assert_eq!((s.leases, s.inflight), (6, 6));
    rig.release_ok(&mut e, leases[0]);

    // refills at the new rate: one token per 500 ms
    rig.advance_ms(500);
    assert_eq!(rig.tokens(&e, "subject", "a"), 5);
    // a bigger burst keeps the 5 missing tokens missing
    e.set_config(
        Arc::new(cfg(
            "[limits.subject]\nrate = \"2/s\"\nburst = 20\ndaily_quota = 100\n",
        )),
        rig.now(),
    );
    assert_eq!(rig.tokens(&e, "subject", "a"), 15);
    assert_eq!(rig.snap(&e).subjects[0].quota_used, 6.0);
    // a lower quota applies to what was already used today
    e.set_config(
        Arc::new(cfg(
            "[limits.subject]\nrate = \"2/s\"\nburst = 20\ndaily_quota = 6\n",
        )),
        rig.now(),
    );
    assert_eq!(
        shed(&rig.decide(&mut e, &call("a", "search"))).scope,
        Scope::DailyQuota
    );
    for l in &leases[1..] {
        rig.release_ok(&mut e, *l);
    }
    assert_eq!(e.inflight(), 0);
}

#[test]

fn cancelling_a_held_lease_after_a_reload_that_adds_a_layer_refunds_what_it_took() {
    // the held call took subject, tenant (held 100 ms) and global; the reload gives its tool a bucket
    let before = "[limits.tenant]\nrate = \"10/s\"\nburst = 1\n";
    let rig = Rig::new(before);
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_eq!(admitted(&d).hold_ns, 100 * MS);
    let held = admitted(&d).lease;
    e.set_config(
        Arc::new(cfg(&format!(
            "{before}[tools.search]\nrate = \"1/s\"\nburst = 5\n"
        ))),
        rig.now(),
    );
    e.cancel_lease(held, rig.now(), rig.wall())
        .expect("live lease");
    // the tenant token reserved for the held call is back: 100 ms on, a call fits at once
    rig.advance_ms(100);
    admitted_now(&rig.decide(&mut e, &call("b", "fetch")));
}

#[test]

fn cancelling_a_held_lease_after_a_reload_that_drops_a_layer_mints_nothing() {
    // the held call took subject, subject_tool, tenant (held 100 ms) and global; the reload drops the tool bucket
    let after = "[limits.tenant]\nrate = \"10/s\"\nburst = 1\n";
    let rig = Rig::new(&format!(
        "{after}[tools.search]\nrate = \"1/s\"\nburst = 5\n"
    ));
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_eq!(admitted(&d).hold_ns, 100 * MS);
    e.set_config(Arc::new(cfg(after)), rig.now());
    e.cancel_lease(admitted(&d).lease, rig.now(), rig.wall())
        .expect("live lease");
    // the first call's tenant token is still spent; the global bucket got back the held call's token
    assert_eq!(rig.tokens(&e, "tenant", "acme"), 0);
    assert_eq!(rig.global_tokens(), 4999);
    assert_eq!(
        shed(&rig.decide(&mut e, &call("b", "fetch"))).scope,
        Scope::Tenant
    );
}

#[test]

fn cancelling_a_held_lease_after_a_rate_reload_refunds_one_token_not_two() {
    let rig = Rig::new("[limits.tenant]\nrate = \"10/s\"\nburst = 1\n");
    let mut e = rig.engine("acme");
    admitted_now(&rig.decide(&mut e, &call("a", "search")));
    let d = rig.decide(&mut e, &call("a", "search").wait_ms(250));
    assert_eq!(admitted(&d).hold_ns, 100 * MS);
    // twice the rate: the two missing tokens now refill in 100 ms
    e.set_config(
        Arc::new(cfg("[limits.tenant]\nrate = \"20/s\"\nburst = 1\n")),
        rig.now(),
    );
    assert_eq!(bucket(&rig.snap(&e), "tenant", "acme").reset_ms, 100);
    e.cancel_lease(admitted(&d).lease, rig.now(), rig.wall())
        .expect("live lease");
    // one token (the first call's) is still missing: 50 ms at the new rate
    let s = rig.snap(&e);
    assert_eq!(
        (
            bucket(&s, "tenant", "acme").tokens,
            bucket(&s, "tenant", "acme").reset_ms
        ),
        (0, 50)
    );
}

// ---- 11. retry-hint spreading -----------------------------------------------------------------------

const SPREAD_CFG: &str = r#"
[limits.subject]
rate = "2/s"
burst = 20
concurrency = 1000
[limits.tenant]
rate = "1000/s"
burst = 1000
concurrency = 1000
"#;

/// Fires 60 calls at one instant at a 2/s, burst-20 bucket, then retries each refused one once, in time
/// order, at the moment it was told (`own_hints`) or at the first refusal's hint (a plain bucket, which
/// tells everyone the time to the next token). Returns (admitted retries, refused calls).
fn retry_after_burst(own_hints: bool) -> (usize, usize) {
    let rig = Rig::new(SPREAD_CFG);
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let mut hints = Vec::new();
    for _ in 0..60 {
        match rig.decide(&mut e, &call("bot", "search")).verdict {
            Verdict::Admitted(a) => assert_eq!(a.hold_ns, 0),
            Verdict::Shed(s) => {
                assert_eq!(s.scope, Scope::Subject);
                hints.push(s.retry_after_ms);
            }
        }
    }
    assert_eq!(hints.len(), 40);
    // the k-th refusal is promised the k-th token after the burst: k refills of 500 ms
    for (k, h) in hints.iter().enumerate() {
        let w = hint_window((k as u64 + 1) * 500 * MS);
        assert!(w.contains(h), "hint {k}: {h} ms not in {w:?}");
    }
    let mut retry_at: Vec<u64> = if own_hints {
        hints.clone()
    } else {
        vec![hints[0]; hints.len()]
    };
    retry_at.sort_unstable();
    let mut ok = 0;
    for ms in retry_at {
        rig.advance_to(t0 + ms * MS);
        if rig.decide(&mut e, &call("bot", "search")).is_admitted() {
            ok += 1;
        }
    }
    (ok, hints.len())
}

#[test]
fn staggered_hints_let_almost_every_obedient_retry_in() {
    let (ok, n) = retry_after_burst(true);
    let share = ok as f64 / n as f64;
    println!(
        "retry-hint spreading: {ok}/{n} retries admitted ({:.1}%)",
        share * 100.0
    );
    assert!(share >= 0.9, "only {ok}/{n} retries admitted");
}

#[test]
fn a_plain_bucket_hint_lets_few_retries_in() {
    let (ok, n) = retry_after_burst(false);
    let share = ok as f64 / n as f64;
    println!(
        "plain token bucket (same hint for all): {ok}/{n} retries admitted ({:.1}%)",
        share * 100.0
    );
    assert!(share < 0.2, "{ok}/{n} retries admitted");
}

// ---- 12. prune and rest -----------------------------------------------------------------------------

#[test]
fn prune_drops_subjects_at_rest_once_their_last_call_is_ten_seconds_old() {
    let rig = Rig::new("");
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let l = rig.lease(&mut e, &call("a", "search"));
    rig.release_ok(&mut e, l);
    assert!(!e.is_at_rest(rig.now(), rig.wall()));
    rig.advance_to(t0 + 499 * MS);
    e.prune(rig.now(), rig.wall());
    assert_eq!(
        e.subject_count(),
        1,
        "the subject bucket is still refilling"
    );
    assert!(!e.is_at_rest(rig.now(), rig.wall()));
    rig.advance_to(t0 + 500 * MS);
    // At rest, so nothing would be lost by dropping the engine, but a subject that called moments ago
    // is likely to call again: its state is kept for ten seconds after its last call.
    assert!(e.is_at_rest(rig.now(), rig.wall()));
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 1);
    rig.advance_to(t0 + 10 * SEC - 1);
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 1);
    rig.advance_to(t0 + 10 * SEC);
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 0);
    assert!(rig.snap(&e).subjects.is_empty());
    assert!(e.is_at_rest(rig.now(), rig.wall()));
    assert!(!e.has_state(rig.now(), rig.wall()));
}

#[test]
fn a_steady_caller_keeps_its_state_across_prunes_and_a_one_off_caller_does_not() {
    let rig = Rig::new("[server]\nlease_ttl = \"2s\"\n");
    let mut e = rig.engine("acme");
    let has = |e: &TenantEngine, s: &str| rig.snap(e).subjects.iter().any(|x| x.subject == s);
    // The one-off caller's lease is never released: it ends at its TTL.
    rig.lease(&mut e, &call("once", "search"));
    for _ in 0..10 {
        let l = rig.lease(&mut e, &call("steady", "search"));
        rig.release_ok(&mut e, l);
        rig.advance_ms(4_000);
        e.expire_leases(rig.now(), rig.wall());
        e.prune(rig.now(), rig.wall());
        assert!(has(&e, "steady"));
    }
    assert!(!has(&e, "once"), "expired at 2 s, dropped 10 s later");
}

#[test]
fn an_outstanding_lease_keeps_the_engine_busy() {
    let rig = Rig::new("");
    let mut e = rig.engine("acme");
    let l = rig.lease(&mut e, &call("a", "search"));
    rig.advance_ms(60_000);
    assert!(!e.is_at_rest(rig.now(), rig.wall()));
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 1);
    assert_eq!(rig.snap(&e).subjects[0].inflight, 1);
    rig.release_ok(&mut e, l);
    assert!(e.is_at_rest(rig.now(), rig.wall()));
    rig.advance_ms(10_000);
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 0);
}

#[test]
fn promises_and_penalties_keep_state_until_they_pass() {
    let rig = Rig::new(&format!(
        "[limits.subject]\nrate = \"1/min\"\nburst = 1\n{PENALTY_CFG}"
    ));
    let mut e = rig.engine("acme");
    let t0 = rig.now();
    let l = rig.lease(&mut e, &call("a", "search"));
    rig.release_ok(&mut e, l);
    // refused: promised the token at t0 + 60 s, so its bucket owes a slot until t0 + 120 s (long
    // after the ten seconds a subject's state is kept past its last call)
    assert_shed(
        &rig.decide(&mut e, &call("a", "search")),
        Scope::Subject,
        60 * SEC,
    );
    rig.advance_to(t0 + 60 * SEC);
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 1);
    rig.advance_to(t0 + 120 * SEC);
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 0);
    assert!(e.is_at_rest(rig.now(), rig.wall()));

    let up: Arc<str> = Arc::from("warehouse");
    e.feedback(&up, 429, Some(Duration::from_secs(5)), rig.now());
    assert!(!e.is_at_rest(rig.now(), rig.wall()));
    rig.advance_ms(5000);
    // The penalty is over, but the AIMD cut and the adaptive window remember the 429 for the
    // adaptive window (2 minutes) before the state is back at rest.
    assert!(!e.is_at_rest(rig.now(), rig.wall()));
    rig.advance_ms(120_000);
    assert!(e.is_at_rest(rig.now(), rig.wall()));
}

#[test]
fn ten_thousand_one_off_subjects_are_all_pruned() {
    let rig = Rig::new(
        "[limits.tenant]\nrate = \"100000/s\"\nburst = 20000\nconcurrency = 20000\n[limits.global]\nrate = \"100000/s\"\nburst = 20000\n",
    );
    let mut e = rig.engine("acme");
    let mut leases = HashSet::new();
    for i in 0..10_000 {
        let l = admitted_now(&rig.decide(&mut e, &call(&format!("agent-{i}"), "search")));
        assert!(leases.insert(l), "lease ids are unique");
    }
    assert_eq!(e.subject_count(), 10_000);
    for l in leases {
        rig.release_ok(&mut e, l);
    }
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 10_000, "buckets not refilled yet");
    rig.advance_ms(500);
    e.prune(rig.now(), rig.wall());
    assert_eq!(
        e.subject_count(),
        10_000,
        "kept ten seconds past their calls"
    );
    rig.advance_ms(9_500);
    e.prune(rig.now(), rig.wall());
    assert_eq!(e.subject_count(), 0);
    assert_eq!(e.lease_count(), 0);
    assert!(e.is_at_rest(rig.now(), rig.wall()));
    assert_eq!(
        e.expire_leases(rig.now() + 3600 * SEC, rig.wall()),
        (vec![], vec![])
    );
}

// ---- 13. header data --------------------------------------------------------------------------------

#[test]
fn layers_list_every_applied_bucket_in_order_with_policy_and_state() {
    let rig = Rig::new(
        "[tools.get_sales]\nupstream = \"warehouse\"\nrate = \"5/min\"\nburst = 5\n[upstreams.warehouse]\nrate = \"20/s\"\nburst = 20\n",
    );
    let mut e = rig.engine("acme");
    let d = rig.decide(&mut e, &call("a", "get_sales"));
    admitted_now(&d);
    let got: Vec<(Layer, f64, u64, u64, u64)> = d
        .layers
        .iter()
        .map(|l| (l.layer, l.burst, l.window_secs, l.remaining, l.reset_ns))
        .collect();
    assert_eq!(
        got,
        vec![
            (Layer::Subject, 20.0, 10, 19, 500 * MS),
            (Layer::SubjectTool, 5.0, 60, 4, 12 * SEC),
            (Layer::Tenant, 50.0, 5, 49, 100 * MS),
            (Layer::TenantUpstream, 20.0, 1, 19, 50 * MS),
            (Layer::Global, 5000.0, 1, 4999, 200_000),
        ]
    );
    assert_eq!(
        d.tightest().map(|l| (l.layer, l.remaining)),
        Some((Layer::SubjectTool, 4))
    );

    // without a tool bucket or an upstream only three layers apply
    let d = rig.decide(&mut e, &call("a", "search"));
    let layers: Vec<Layer> = d.layers.iter().map(|l| l.layer).collect();
    assert_eq!(layers, vec![Layer::Subject, Layer::Tenant, Layer::Global]);
    assert_eq!(
        d.tightest().map(|l| (l.layer, l.remaining)),
        Some((Layer::Subject, 18))
    );
}

#[test]
fn layers_of_a_shared_upstream_and_of_a_held_call_are_read_after_the_take() {
    let rig = Rig::new(
        "[limits.subject]\nrate = \"1/s\"\nburst = 1\n[upstreams.maps]\nshared = true\nrate = \"10/s\"\nburst = 10\n[tools.route]\nupstream = \"maps\"\n",
    );
    let mut e = rig.engine("acme");
    let state = |d: &Decision, layer: Layer| {
        let l = d.layers.iter().find(|l| l.layer == layer).unwrap();
        (l.remaining, l.reset_ns)
    };
    let d = rig.decide(&mut e, &call("a", "route"));
    admitted_now(&d);
    assert_eq!(state(&d, Layer::Subject), (0, SEC));
    assert_eq!(state(&d, Layer::TenantUpstream), (9, 100 * MS));
    // Another tenant spends the same shared budget: its answer counts both calls.
    let mut other = rig.engine("globex");
    let d = rig.decide(&mut other, &call("b", "route"));
    assert_eq!(state(&d, Layer::TenantUpstream), (8, 200 * MS));
    // A held call reports its bucket as reserved: empty, and full again a hold later than now.
    let d = rig.decide(&mut e, &call("a", "route").wait_ms(2000));
    assert_eq!(admitted(&d).hold_ns, SEC);
    assert_eq!(state(&d, Layer::Subject), (0, 2 * SEC));
    assert_eq!(state(&d, Layer::TenantUpstream), (7, 300 * MS));
}

#[test]
fn window_rounds_up_and_tightest_ties_go_to_the_earlier_layer() {
    let rig = Rig::new("[limits.subject]\nrate = \"3/s\"\nburst = 10\n[limits.tenant]\nrate = \"3/s\"\nburst = 10\n");
    let mut e = rig.engine("acme");
    let d = rig.decide(&mut e, &call("a", "search"));
    assert_eq!(
        d.layers[0].window_secs, 4,
        "10 tokens at 3/s refill in 3.33 s"
    );
    assert_eq!(
        (remaining(&d, Layer::Subject), remaining(&d, Layer::Tenant)),
        (9, 9)
    );
    assert_eq!(d.tightest().map(|l| l.layer), Some(Layer::Subject));
    let d = rig.decide(&mut e, &call("b", "search"));
    assert_eq!(
        (remaining(&d, Layer::Subject), remaining(&d, Layer::Tenant)),
        (9, 8)
    );
    assert_eq!(d.tightest().map(|l| l.layer), Some(Layer::Tenant));
    // a shed decision reports its layers too
    let d = rig.decide(&mut e, &call("c", "search").cost(9.0));
    assert_eq!(shed(&d).scope, Scope::Tenant);
    assert_eq!(
        d.tightest().map(|l| (l.layer, l.remaining)),
        Some((Layer::Tenant, 8))
    );
}

#[test]
fn calls_share_one_copy_of_each_tool_and_upstream_name() {
    let rig = Rig::new(
        "[upstreams.warehouse]\nrate = \"100/s\"\nburst = 100\n\n[tools.get_sales]\nupstream = \"warehouse\"\n",
    );
    let mut e = rig.engine("acme");
    let a = rig.decide(&mut e, &call("bot", "get_sales"));
    let b = rig.decide(&mut e, &call("other", "get_sales"));
    assert_eq!(&*a.resolved.tool, "get_sales");
    assert!(Arc::ptr_eq(&a.resolved.tool, &b.resolved.tool));
    let (ua, ub) = (&a.resolved.upstreams[0].0, &b.resolved.upstreams[0].0);
    assert_eq!(&**ua, "warehouse");
    assert!(Arc::ptr_eq(ua, ub));
    // Many distinct names: the set starts over rather than grow, and every call keeps its name.
    for i in 0..3000 {
        let d = rig.decide(&mut e, &call("bot", &format!("tool{i}")));
        assert_eq!(*d.resolved.tool, *format!("tool{i}"));
    }
    let c = rig.decide(&mut e, &call("bot", "get_sales"));
    assert_eq!(&*c.resolved.tool, "get_sales");
}

#[test]
fn a_subjects_calls_share_its_name_and_an_upstream_sent_with_the_call_is_shared_too() {
    let rig = Rig::new("[upstreams.crm]\nrate = \"100/s\"\nburst = 100\n");
    let mut e = rig.engine("acme");
    let a = rig.decide(&mut e, &call("bot", "search").up("crm"));
    let b = rig.decide(&mut e, &call("bot", "lookup").up("crm"));
    assert_eq!(&*a.resolved.subject, "bot");
    assert!(Arc::ptr_eq(&a.resolved.subject, &b.resolved.subject));
    assert_eq!(a.resolved.upstream.as_deref(), Some("crm"));
    assert!(Arc::ptr_eq(
        a.resolved.upstream.as_ref().unwrap(),
        b.resolved.upstream.as_ref().unwrap()
    ));
    // Another subject has its own name.
    let c = rig.decide(&mut e, &call("other", "search"));
    assert_eq!(&*c.resolved.subject, "other");
    // A call refused before it spends leaves no subject state behind, so the tenant holds none.
    let mut f = rig.engine("initech");
    let d = rig.decide(&mut f, &call("bot", "search").cost(1e9));
    assert_eq!(shed(&d).scope, Scope::Oversized);
    assert_eq!(f.subject_count(), 0);
}

#[test]
fn an_expired_lease_reports_the_label_its_call_was_admitted_under() {
    use crate::engine::labels::SubjectLabels;
    let rig = Rig::new("[server]\nlease_ttl = \"10s\"\n");
    let labels = Arc::new(SubjectLabels::new(2, 1_000));
    let mut e = rig.engine("acme");
    e.set_subject_labels(Some(labels.clone()));
    let t0 = rig.now();
    // Named, one whose own name is the folded label's text (named too: the cap is two), and one
    // folded past the cap.
    for s in ["named", "__other__", "folded"] {
        admitted_now(&rig.decide(&mut e, &call(s, "search")));
    }
    let (expired, _) = e.expire_leases(t0 + 10 * SEC, rig.wall());
    let got: Vec<(&str, &str)> = expired.iter().map(|(l, t, _)| (&**l, &**t)).collect();
    assert_eq!(
        got,
        vec![
            ("named", "search"),
            ("__other__", "search"),
            ("__other__", "search")
        ]
    );
    assert!(
        labels.is_other(&expired[2].0),
        "the folded one is the shared label"
    );
    assert!(
        !labels.is_other(&expired[1].0),
        "a subject named like it keeps its own name"
    );
}

#[test]
fn subjects_are_labelled_in_the_order_they_call_and_a_raised_cap_names_folded_ones() {
    use crate::engine::labels::SubjectLabels;
    let rig = Rig::new("");
    let labels = Arc::new(SubjectLabels::new(2, 1_000));
    let mut e = rig.engine("acme");
    e.set_subject_labels(Some(labels.clone()));
    let label = |e: &mut TenantEngine, s: &str| {
        let d = rig.decide(e, &call(s, "search"));
        d.resolved.subject_label.to_string()
    };
    assert_eq!(label(&mut e, "s1"), "s1");
    assert_eq!(label(&mut e, "s2"), "s2");
    assert_eq!(label(&mut e, "s3"), "__other__");
    assert_eq!(label(&mut e, "s1"), "s1");
    assert_eq!(label(&mut e, "s4"), "__other__");
    // A later actor of the same tenant (the first went idle and stopped) sees the same names.
    let mut again = rig.engine("acme");
    again.set_subject_labels(Some(labels.clone()));
    assert_eq!(label(&mut again, "s5"), "__other__");
    assert_eq!(label(&mut again, "s2"), "s2");
    // A reload with room for one more: s3, folded while its state lives, is named at its next call.
    labels.set_caps(3, 1_000);
    assert_eq!(label(&mut e, "s3"), "s3");
    assert_eq!(label(&mut e, "s4"), "__other__");
    // Without labels (metrics off) every subject is its own label.
    let mut off = rig.engine("initech");
    for i in 0..5 {
        assert_eq!(label(&mut off, &format!("x{i}")), format!("x{i}"));
    }
}
