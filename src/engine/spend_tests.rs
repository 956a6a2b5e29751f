//! Spend budgets through the tenant engine, on a fake clock: reservation with every other layer, the
//! refusals and their texts, settlement at release (spend and cost), shadow mode, plans, the UTC day
//! and forgetting idle runs.

use std::sync::Arc;

use compact_str::CompactString;

use super::spend::SpendBudget;
use super::tenant::{CallSpend, Settlement};
use super::test_support::*;
use super::*;
use crate::clock::{Clock, FakeClock};

const LOOP: &str = r#"
[limits.subject]
rate = "1000/s"
burst = 1000
concurrency = 100
[limits.tenant]
rate = "1000/s"
burst = 1000
concurrency = 100
[spend.usd]
estimate = 0.01
tenant_daily = 50
subject_daily = 5
run = 1.0
currency = "$"
[spend.tokens]
estimate = 100
[tools.search.spend]
usd = 0.05
"#;

struct H {
    clock: FakeClock,
    e: TenantEngine,
}

impl Clocked for H {
    fn clock(&self) -> &FakeClock {
        &self.clock
    }
}

fn h(toml: &str) -> H {
    let (clock, cfg, shared) = harness(toml, NOON);
    H {
        clock,
        e: TenantEngine::new(Arc::from("acme"), cfg, shared, 7),
    }
}

fn in_run(mut r: AdmitRequest, run: &str) -> AdmitRequest {
    Arc::make_mut(r.spend.get_or_insert_with(Default::default))
        .run
        .replace(CompactString::from(run));
    r
}

fn estimate(mut r: AdmitRequest, unit: &str, x: f64) -> AdmitRequest {
    Arc::make_mut(r.spend.get_or_insert_with(Default::default))
        .estimates
        .push((CompactString::from(unit), x));
    r
}

fn ok() -> ReleaseInfo {
    ReleaseInfo {
        outcome: Outcome::Ok,
        upstream_status: None,
        retry_after: None,
        duration_ms: None,
    }
}

fn spent(unit: &str, x: f64) -> Settlement {
    Settlement {
        spent: [(CompactString::from(unit), x)].into_iter().collect(),
        cost: None,
    }
}

impl H {
    fn d(&mut self, r: &AdmitRequest) -> Decision {
        match self.e.admit(r, self.clock.mono(), self.clock.wall_ms()) {
            AdmitResult::Decided(d) => d,
            q => panic!("expected a decision, got {q:?}"),
        }
    }
    fn release(&mut self, lease: u64, s: &Settlement) {
        let info = ok();
        self.release_as(lease, &info, s);
    }
    fn release_as(&mut self, lease: u64, info: &ReleaseInfo, s: &Settlement) {
        let (now, wall) = (self.now(), self.wall());
        self.e.release_settled(lease, info, s, now, wall).unwrap();
    }
    fn usd(&self, d: &Decision) -> (f64, Option<(f64, SpendBudget)>) {
        let v = admitted(d).spend.as_ref().expect("spend is reported");
        let u = v.iter().find(|v| &*v.unit == "usd").unwrap();
        (u.reserved, u.remaining)
    }
}

#[test]
fn a_looping_run_stops_at_its_budget_with_a_refusal_that_waiting_cannot_fix() {
    let mut h = h(LOOP);
    for i in 0..20 {
        let d = h.d(&in_run(call("bot", "search"), "r-1"));
        let (reserved, remaining) = h.usd(&d);
        assert_eq!(reserved, 0.05);
        let (left, budget) = remaining.unwrap();
        assert_eq!(budget, SpendBudget::Run);
        assert!((left - (1.0 - 0.05 * f64::from(i + 1))).abs() < 1e-9);
        let lease = admitted(&d).lease;
        h.release(lease, &Settlement::default());
    }
    let d = h.d(&in_run(call("bot", "search"), "r-1"));
    let s = shed(&d);
    assert_eq!(s.scope, Scope::Spend);
    assert!(!s.retryable);
    assert_eq!(s.retry_after_ms, 0);
    let refusal = s.spend.as_ref().unwrap();
    assert_eq!(&*refusal.unit, "usd");
    assert_eq!(refusal.budget, SpendBudget::Run);
    assert!(refusal.remaining.abs() < 1e-9);
    assert!(
        s.message.contains("budget of $1 for this task is spent"),
        "{}",
        s.message
    );
    assert!(s.message.contains("Waiting will not help"), "{}", s.message);
    assert!(s.message.contains("ask the user"), "{}", s.message);
    assert!(
        !s.message.contains("acme") && !s.message.contains("bot"),
        "{}",
        s.message
    );
    // Another run of the same agent goes on.
    let d = h.d(&in_run(call("bot", "search"), "r-2"));
    admitted(&d);
}

#[test]
fn calls_of_one_run_in_flight_together_cannot_overshoot() {
    let mut h = h(LOOP);
    let mut leases = Vec::new();
    for _ in 0..20 {
        let d = h.d(&in_run(call("bot", "search"), "r-1"));
        leases.push(admitted(&d).lease);
    }
    let d = h.d(&in_run(call("bot", "search"), "r-1"));
    assert_eq!(shed(&d).scope, Scope::Spend);
    // One is cancelled: its reservation comes back, and one more call fits.
    let cancelled = ReleaseInfo {
        outcome: Outcome::Cancelled,
        ..ok()
    };
    h.release_as(leases[0], &cancelled, &spent("usd", 0.05));
    let d = h.d(&in_run(call("bot", "search"), "r-1"));
    admitted(&d);
}

#[test]
fn settling_gives_back_charges_on_top_and_a_run_in_debt_stays_refused() {
    let mut h = h(LOOP);
    let d = h.d(&in_run(call("bot", "search"), "r-1"));
    h.release(admitted(&d).lease, &spent("usd", 0.01));
    let d = h.d(&in_run(call("bot", "search"), "r-1"));
    assert!((h.usd(&d).1.unwrap().0 - (1.0 - 0.01 - 0.05)).abs() < 1e-9);
    // This one cost far more than estimated: the run is overspent.
    h.release(admitted(&d).lease, &spent("usd", 1.5));
    let d = h.d(&estimate(in_run(call("bot", "other"), "r-1"), "usd", 0.0));
    let s = shed(&d);
    assert_eq!(s.spend.as_ref().unwrap().budget, SpendBudget::Run);
    assert!((s.spend.as_ref().unwrap().remaining + 0.51).abs() < 1e-9);
    assert!(s.message.contains("overspent by $0.51"), "{}", s.message);
    // An hour later it is still refused: a run's budget never refills while it is remembered.
    h.advance_ms(59 * 60 * 1000);
    let d = h.d(&in_run(call("bot", "search"), "r-1"));
    assert_eq!(shed(&d).scope, Scope::Spend);
}

#[test]
fn a_daily_budget_refuses_until_utc_midnight_and_the_next_day_starts_over() {
    let mut h = h(LOOP);
    // The subject's day (5) is gone in one dear call.
    let d = h.d(&call("bot", "search"));
    h.release(admitted(&d).lease, &spent("usd", 5.0));
    let d = h.d(&call("bot", "search"));
    let s = shed(&d);
    assert_eq!(s.scope, Scope::Spend);
    assert!(s.retryable);
    assert_eq!(s.retry_after_ms, 12 * 3600 * 1000, "noon to midnight");
    assert_eq!(s.spend.as_ref().unwrap().budget, SpendBudget::SubjectDaily);
    assert!(
        s.message.contains("daily budget of $5 for this agent"),
        "{}",
        s.message
    );
    assert!(s.message.contains("Wait 43200 seconds"), "{}", s.message);
    // Another agent of the tenant is not held by this one's day.
    admitted(&h.d(&call("other", "search")));
    h.advance_ms(12 * 3600 * 1000 - 1);
    assert_eq!(shed(&h.d(&call("bot", "search"))).scope, Scope::Spend);
    h.advance_ms(1);
    admitted(&h.d(&call("bot", "search")));
}

#[test]
fn estimates_come_from_the_call_then_the_tool_then_the_unit() {
    let mut h = h(LOOP);
    let d = h.d(&estimate(call("bot", "search"), "usd", 0.3));
    assert_eq!(h.usd(&d).0, 0.3);
    let d = h.d(&call("bot", "search"));
    assert_eq!(h.usd(&d).0, 0.05);
    let d = h.d(&call("bot", "plain"));
    assert_eq!(h.usd(&d).0, 0.01);
    let tokens = admitted(&d).spend.as_ref().unwrap();
    let tokens = tokens.iter().find(|v| &*v.unit == "tokens").unwrap();
    assert_eq!((tokens.reserved, tokens.remaining), (100.0, None));
    // Without a run, the least left is the subject's day.
    assert_eq!(h.usd(&d).1.unwrap().1, SpendBudget::SubjectDaily);
}

#[test]
fn a_call_refused_by_another_layer_reserves_nothing() {
    let mut h = h(&format!("{LOOP}\n[tools.one]\nrate = \"1/h\"\nburst = 1\n"));
    let d = h.d(&in_run(estimate(call("bot", "one"), "usd", 0.6), "r"));
    admitted(&d);
    // The tool's bucket refuses: the 0.6 it would reserve is not taken from the run.
    let d = h.d(&in_run(estimate(call("bot", "one"), "usd", 0.3), "r"));
    assert_eq!(shed(&d).scope, Scope::SubjectTool);
    let d = h.d(&in_run(estimate(call("bot", "x"), "usd", 0.4), "r"));
    assert!(h.usd(&d).1.unwrap().0.abs() < 1e-9);
}

#[test]
fn shadow_mode_predicts_the_refusal_and_spends_nothing() {
    let mut h = h(&format!("[server]\nmode = \"shadow\"\n{LOOP}"));
    for _ in 0..20 {
        admitted(&h.d(&in_run(call("bot", "search"), "r")));
    }
    for _ in 0..3 {
        let d = h.d(&in_run(call("bot", "search"), "r"));
        let w = admitted(&d).would_shed.as_ref().unwrap();
        assert_eq!(w.scope, Scope::Spend);
        assert!(!w.retryable);
    }
    let snap = h.e.snapshot(h.now(), h.wall());
    let usd = snap.spend.iter().find(|s| s.unit == "usd").unwrap();
    assert!((usd.day_spent - 1.0).abs() < 1e-9, "{usd:?}");
}

#[test]
fn plans_override_budgets() {
    let (clock, cfg, shared) = harness(
        &format!("{LOOP}\n[plans.free.spend.usd]\nrun = 0.1\n[tenants.acme]\nplan = \"free\"\n"),
        NOON,
    );
    let mut h = H {
        clock,
        e: TenantEngine::new(Arc::from("acme"), cfg.clone(), shared.clone(), 1),
    };
    for _ in 0..2 {
        admitted(&h.d(&in_run(call("bot", "search"), "r")));
    }
    let d = h.d(&in_run(call("bot", "search"), "r"));
    assert!(shed(&d).message.contains("budget of $0.1 for this task"));
    let mut other = TenantEngine::new(Arc::from("globex"), cfg, shared, 1);
    for _ in 0..3 {
        let (now, wall) = (h.now(), h.wall());
        let d = other.admit(&in_run(call("bot", "search"), "r"), now, wall);
        assert!(matches!(d, AdmitResult::Decided(ref d) if d.is_admitted()));
    }
}

#[test]
fn an_idle_run_is_forgotten_after_run_idle() {
    let mut h = h(&LOOP.replace("run = 1.0", "run = 1.0\nrun_idle = \"10m\""));
    let d = h.d(&in_run(call("bot", "search"), "r"));
    h.release(admitted(&d).lease, &spent("usd", 1.0));
    assert_eq!(
        shed(&h.d(&in_run(call("bot", "search"), "r"))).scope,
        Scope::Spend
    );
    // The refused call is not a use of the run: ten minutes after its last admitted call it is
    // forgotten.
    h.advance_ms(10 * 60 * 1000 + 1);
    admitted(&h.d(&in_run(call("bot", "search"), "r")));
    // Pruning drops runs idle past the longest run_idle (tokens keeps the default hour).
    h.advance_ms(3600 * 1000 + 1);
    h.e.prune(h.now(), h.wall());
    assert_eq!(h.e.snapshot(h.now(), h.wall()).spend_runs, Some(0));
}

#[test]
fn release_cost_settles_buckets_and_the_daily_quota_so_a_cache_hit_is_free() {
    let toml = "[limits.subject]\nrate = \"1/h\"\nburst = 2\ndaily_quota = 2\n";
    let mut h = h(toml);
    let free = Settlement {
        spent: Default::default(),
        cost: Some(0.0),
    };
    for _ in 0..10 {
        let d = h.d(&call("bot", "search"));
        h.release(admitted(&d).lease, &free);
    }
    // Charged on top: a call that cost 2 takes the whole burst and quota.
    let d = h.d(&call("bot", "search"));
    let dear = Settlement {
        spent: Default::default(),
        cost: Some(2.0),
    };
    h.release(admitted(&d).lease, &dear);
    let d = h.d(&call("bot", "search"));
    assert_eq!(shed(&d).scope, Scope::DailyQuota);
}

#[test]
fn a_lease_that_expires_keeps_its_estimate_and_a_cancelled_call_gives_it_back() {
    let mut h = h(&format!("[server]\nlease_ttl = \"10s\"\n{LOOP}"));
    admitted(&h.d(&estimate(in_run(call("bot", "x"), "r"), "usd", 0.6)));
    h.advance_ms(10_000);
    let (now, wall) = (h.now(), h.wall());
    h.e.expire_leases(now, wall);
    let d = h.d(&estimate(in_run(call("bot", "x"), "r"), "usd", 0.5));
    assert_eq!(shed(&d).scope, Scope::Spend);
    let d = h.d(&estimate(in_run(call("bot", "x"), "r"), "usd", 0.4));
    let cancelled = ReleaseInfo {
        outcome: Outcome::Cancelled,
        ..ok()
    };
    h.release_as(admitted(&d).lease, &cancelled, &Settlement::default());
    let d = h.d(&estimate(in_run(call("bot", "x"), "r"), "usd", 0.4));
    assert!(h.usd(&d).1.unwrap().0.abs() < 1e-9);
}

#[test]
fn without_spend_units_nothing_is_reported() {
    let mut h = h("");
    let d = h.d(&in_run(call("bot", "x"), "r"));
    assert!(admitted(&d).spend.is_none());
    assert!(d.resolved.spend.is_none());
    let _ = CallSpend::default();
}
