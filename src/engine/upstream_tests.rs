//! Fake-clock tests of the upstream-aware layer: AIMD repricing on 429s, SRE adaptive throttling,
//! amplification (one call spending several upstreams, all or nothing), budgets sized from a published
//! limit, the max-min fair share of a contended shared upstream, cheap refusal of held and queued calls
//! when their upstream starts a penalty, the retry guidance these refusals give, and a loop on a shared
//! upstream sized above what it takes (a penalty in proportion to a tenant's excess over its share, a
//! rate that settles below a learned ceiling).
//!
//! Like `tests.rs`, every test builds its config from TOML text, engines over one [`SharedBudgets`] and a
//! [`FakeClock`] that moves only when told, so the numbers are exact. Two numbers are statistical by
//! nature: the adaptive throttle's refusals are drawn from the engine's seeded RNG, so those tests are
//! deterministic for a given seed but assert against the probability with a tolerance derived from the
//! binomial spread (they hold for any seed, not only the one used).

use std::sync::Arc;
use std::time::Duration;

use super::tenant::{TenantSnapshot, UpstreamSnapshot};
use super::test_support::*;
use super::*;
use crate::clock::{ceil_ms, FakeClock, Nanos};
use crate::config::Config;

/// Limits so high that only the upstream layers under test can refuse a call.
const ROOMY: &str = r#"
[limits.subject]
rate = "1000000/s"
burst = 1000000
concurrency = 1000000

[limits.tenant]
rate = "1000000/s"
burst = 1000000
concurrency = 1000000

[limits.global]
rate = "1000000/s"
burst = 1000000
"#;

fn roomy(extra: &str) -> String {
    format!("{ROOMY}\n{extra}")
}

// ---- harness ----------------------------------------------------------------------------------------

/// One config, one set of cross-tenant budgets and one fake clock.
struct Sim {
    clock: FakeClock,
    cfg: Arc<Config>,
    shared: Arc<SharedBudgets>,
}

impl Sim {
    fn new(toml: &str) -> Sim {
        let (clock, cfg, shared) = harness(toml, NOON);
        Sim { clock, cfg, shared }
    }

    fn engine(&self, tenant: &str) -> TenantEngine {
        let seed = tenant
            .bytes()
            .fold(0x5eed_u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
        TenantEngine::new(
            Arc::from(tenant),
            self.cfg.clone(),
            self.shared.clone(),
            seed,
        )
    }

    fn queue(&self, e: &mut TenantEngine, r: &AdmitRequest) -> u64 {
        match self.admit(e, r) {
            AdmitResult::Queued { waiter, .. } => waiter,
            AdmitResult::Decided(d) => panic!("expected to be queued, got {:?}", d.verdict),
        }
    }

    /// Admits without a hold and returns the lease.
    fn lease(&self, e: &mut TenantEngine, r: &AdmitRequest) -> u64 {
        admitted_now(&self.decide(e, r))
    }

    fn release(&self, e: &mut TenantEngine, lease: u64, info: &ReleaseInfo) -> Released {
        e.release(lease, info, self.now(), self.wall())
            .expect("lease is live")
    }

    fn feedback(&self, e: &mut TenantEngine, upstream: &str, status: u16, retry: Option<Duration>) {
        e.feedback(&Arc::from(upstream), status, retry, self.now());
    }

    fn snap(&self, e: &TenantEngine) -> TenantSnapshot {
        e.snapshot(self.now(), self.wall())
    }

    /// Whole tokens in one bucket of the tenant's snapshot (`None`: the bucket holds no state yet).
    fn tokens(&self, e: &TenantEngine, layer: &str, key: &str) -> Option<u64> {
        self.snap(e)
            .buckets
            .iter()
            .find(|b| b.layer == layer && b.key == key)
            .map(|b| b.tokens)
    }

    fn global_tokens(&self) -> u64 {
        self.shared.global.remaining(
            &bucket::Gcra::new(self.cfg.limits.global.bucket),
            self.now(),
        )
    }

    /// The tenant's view of `upstream`.
    fn upstream(&self, e: &TenantEngine, upstream: &str) -> UpstreamSnapshot {
        up_view(&self.snap(e), upstream)
    }
}

impl Clocked for Sim {
    fn clock(&self) -> &FakeClock {
        &self.clock
    }
}

fn up_view(s: &TenantSnapshot, upstream: &str) -> UpstreamSnapshot {
    s.upstreams
        .iter()
        .find(|u| u.upstream == upstream)
        .cloned()
        .unwrap_or_else(|| panic!("no upstream {upstream:?} in {:?}", s.upstreams))
}

fn ok() -> ReleaseInfo {
    ReleaseInfo {
        outcome: Outcome::Ok,
        upstream_status: Some(200),
        retry_after: None,
        duration_ms: Some(20),
    }
}

/// A 429 release. `Some(Duration::ZERO)` starts no penalty, so only the AIMD cut and the adaptive
/// window see the 429.
fn r429(retry_after: Option<Duration>) -> ReleaseInfo {
    ReleaseInfo {
        outcome: Outcome::UpstreamRateLimited,
        upstream_status: Some(429),
        retry_after,
        duration_ms: Some(20),
    }
}

fn assert_shed(d: &Decision, scope: Scope, wait_ns: u64) -> Shed {
    let s = shed(d).clone();
    assert_eq!(s.scope, scope, "scope of {s:?}");
    assert!(s.retryable, "{scope:?} sheds are retryable");
    let w = hint_window(wait_ns);
    assert!(
        w.contains(&s.retry_after_ms),
        "{scope:?}: retry_after_ms {} not in {w:?}",
        s.retry_after_ms
    );
    s
}

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!(
        (actual - expected).abs() < 1e-9,
        "{what}: {actual} is not {expected}"
    );
}

// ---- 1. AIMD: a 429 cuts the budget, successes win it back ------------------------------------------

const AIMD_CFG: &str = r#"
[tools.t]
upstream = "u"

[upstreams.u]
rate = "10/s"
burst = 10
aimd_floor = 0.2
aimd_recover = 0.1
adaptive_k = 0
"#;

#[test]
fn a_healthy_release_leaves_the_rate_alone() {
    let sim = Sim::new(&roomy(AIMD_CFG));
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("a", "t"));
    assert_eq!(sim.release(&mut e, l, &ok()).penalty, None);
    let u = sim.upstream(&e, "u");
    assert_eq!(u.multiplier, 1.0);
    assert_eq!(u.effective_rate, Some(10.0));
}

#[test]
fn aimd_cut_and_bucket_refill_after_one_429() {
    let sim = Sim::new(&roomy(AIMD_CFG));
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("a", "t"));
    let rel = sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
    assert_eq!(rel.penalty, Some(Duration::ZERO), "a zero Retry-After");
    let u = sim.upstream(&e, "u");
    assert_eq!(u.configured_rate, Some(10.0));
    assert_eq!(u.multiplier, 0.5);
    assert_eq!(u.effective_rate, Some(5.0));
    let b = sim
        .snap(&e)
        .buckets
        .into_iter()
        .find(|b| b.layer == "tenant_upstream" && b.key == "u")
        .expect("upstream bucket");
    assert_eq!(b.rate_per_sec, 5.0);
    // the token the call took is still missing: 9 of 10 left (the cut keeps missing tokens, not time)
    assert_eq!(b.tokens, 9);

    // Drain the bucket (leases are kept: a successful release would start the recovery).
    let mut leases = Vec::new();
    for _ in 0..9 {
        leases.push(sim.lease(&mut e, &call("a", "t")));
    }
    let t0 = sim.now();
    let s = assert_shed(
        &sim.decide(&mut e, &call("a", "t")),
        Scope::TenantUpstream,
        200 * MS,
    );
    assert!(s.reason.contains("cut to 50%"), "{}", s.reason);
    assert!(s
        .message
        .contains("Rate limited by the u quota for this account"));

    // At 10/s a token would be back after 100 ms; at the cut rate of 5/s it takes 200 ms.
    sim.advance_to(t0 + 100 * MS);
    assert_eq!(
        shed(&sim.decide(&mut e, &call("a", "t"))).scope,
        Scope::TenantUpstream
    );
    sim.advance_to(t0 + 199 * MS);
    assert_eq!(
        shed(&sim.decide(&mut e, &call("a", "t"))).scope,
        Scope::TenantUpstream
    );
    sim.advance_to(t0 + 200 * MS);
    leases.push(sim.lease(&mut e, &call("a", "t")));
    sim.advance_to(t0 + 399 * MS);
    assert_eq!(
        shed(&sim.decide(&mut e, &call("a", "t"))).scope,
        Scope::TenantUpstream
    );
    sim.advance_to(t0 + 400 * MS);
    leases.push(sim.lease(&mut e, &call("a", "t")));
}

#[test]
fn repeated_429s_floor_and_successes_recover_additively() {
    let sim = Sim::new(&roomy(AIMD_CFG));
    let mut e = sim.engine("acme");
    for expected in [0.5, 0.25, 0.2, 0.2, 0.2] {
        let l = sim.lease(&mut e, &call("a", "t"));
        sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
        let u = sim.upstream(&e, "u");
        assert_eq!(u.multiplier, expected, "aimd_factor 0.5, aimd_floor 0.2");
        assert_close(u.effective_rate.unwrap(), 10.0 * expected, "effective rate");
    }
    // Refill (5 missing tokens at 2/s) so the recovery calls are admitted at once.
    sim.advance_ms(10_000);
    let leases: Vec<u64> = (0..10)
        .map(|_| sim.lease(&mut e, &call("a", "t")))
        .collect();

    // Neither an error nor a 503 is a success: no recovery.
    let mut leases = leases.into_iter();
    let err = ReleaseInfo {
        outcome: Outcome::Error,
        upstream_status: Some(500),
        ..ok()
    };
    sim.release(&mut e, leases.next().unwrap(), &err);
    assert_eq!(sim.upstream(&e, "u").multiplier, 0.2);
    let overloaded = ReleaseInfo {
        upstream_status: Some(503),
        ..ok()
    };
    sim.release(&mut e, leases.next().unwrap(), &overloaded);
    assert_eq!(sim.upstream(&e, "u").multiplier, 0.2);

    // Each success gives back aimd_recover (0.1) of the configured rate, up to 1.
    let mut expected: f64 = 0.2;
    for l in leases {
        sim.release(&mut e, l, &ok());
        expected = (expected + 0.1).min(1.0);
        let u = sim.upstream(&e, "u");
        assert_close(u.multiplier, expected, "multiplier");
        assert!(u.multiplier <= 1.0);
    }
    // 0.2 + 8 × 0.1 lands one ulp short of 1 in floating point; one more success reaches it exactly
    // (see `recovery_lands_exactly_on_the_configured_rate`).
    sim.advance_ms(1000);
    let l = sim.lease(&mut e, &call("a", "t"));
    sim.release(&mut e, l, &ok());
    let u = sim.upstream(&e, "u");
    assert_eq!(
        u.multiplier, 1.0,
        "recovered to exactly the configured rate"
    );
    assert_eq!(u.effective_rate, Some(10.0));
}

#[test]
fn recovery_lands_exactly_on_the_configured_rate() {
    let sim = Sim::new(&roomy(AIMD_CFG));
    let mut e = sim.engine("acme");
    for _ in 0..3 {
        let l = sim.lease(&mut e, &call("a", "t"));
        sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
    }
    assert_eq!(sim.upstream(&e, "u").multiplier, 0.2);
    sim.advance_ms(10_000);
    let leases: Vec<u64> = (0..8).map(|_| sim.lease(&mut e, &call("a", "t"))).collect();
    for l in leases {
        sim.release(&mut e, l, &ok());
    }
    assert_eq!(
        sim.upstream(&e, "u").multiplier,
        1.0,
        "8 × 0.1 on top of 0.2"
    );
}

#[test]
fn a_cut_is_forgotten_on_the_first_admit_after_the_adaptive_window() {
    let sim = Sim::new(&roomy(AIMD_CFG));
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("a", "t"));
    sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
    let cut_at = sim.now();
    assert_eq!(sim.upstream(&e, "u").multiplier, 0.5);

    // adaptive_k = 0: the window is the default 2 minutes.
    sim.advance_to(cut_at + 119 * SEC);
    sim.lease(&mut e, &call("a", "t"));
    assert_eq!(sim.upstream(&e, "u").multiplier, 0.5, "119 s: remembered");

    sim.advance_to(cut_at + 121 * SEC);
    assert_eq!(
        sim.upstream(&e, "u").multiplier,
        0.5,
        "a snapshot does not settle the cut; the next admit does"
    );
    sim.lease(&mut e, &call("a", "t"));
    let u = sim.upstream(&e, "u");
    assert_eq!(u.multiplier, 1.0, "121 s without a 429: forgotten");
    assert_eq!(u.effective_rate, Some(10.0));
    let b = sim
        .snap(&e)
        .buckets
        .into_iter()
        .find(|b| b.layer == "tenant_upstream" && b.key == "u")
        .unwrap();
    assert_eq!(b.rate_per_sec, 10.0);
    assert_eq!(
        b.tokens, 9,
        "the full bucket kept its tokens across the change"
    );
}

#[test]
fn a_cut_is_forgotten_after_a_configured_adaptive_window() {
    let sim = Sim::new(&roomy(
        "[tools.t]\nupstream = \"u\"\n[upstreams.u]\nrate = \"10/s\"\nburst = 10\nadaptive_window = \"30s\"\nadaptive_min_requests = 1000\n",
    ));
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("a", "t"));
    sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
    let cut_at = sim.now();
    sim.advance_to(cut_at + 29 * SEC);
    sim.lease(&mut e, &call("a", "t"));
    assert_eq!(sim.upstream(&e, "u").multiplier, 0.5);
    sim.advance_to(cut_at + 31 * SEC);
    sim.lease(&mut e, &call("a", "t"));
    assert_eq!(sim.upstream(&e, "u").multiplier, 1.0);
}

#[test]
fn a_429_through_one_tenant_cuts_the_shared_rate_every_tenant_sees() {
    let sim = Sim::new(&roomy(
        "[tools.t]\nupstream = \"s\"\n[upstreams.s]\nrate = \"10/s\"\nburst = 10\nshared = true\nadaptive_k = 0\n",
    ));
    let mut a = sim.engine("acme");
    let mut b = sim.engine("globex");
    let l = sim.lease(&mut a, &call("a", "t"));
    sim.release(&mut a, l, &r429(Some(Duration::ZERO)));

    let u = sim.upstream(&b, "s");
    assert!(u.shared);
    assert_eq!(u.multiplier, 0.5);
    assert_eq!(u.effective_rate, Some(5.0));
    // acme's call left one token missing; globex drains the other nine
    for _ in 0..9 {
        sim.lease(&mut b, &call("b", "t"));
    }
    let t0 = sim.now();
    let s = assert_shed(
        &sim.decide(&mut b, &call("b", "t")),
        Scope::TenantUpstream,
        200 * MS,
    );
    assert!(s.reason.contains("cut to 50%"), "{}", s.reason);
    assert!(
        s.message.contains("which all accounts share"),
        "{}",
        s.message
    );
    sim.advance_to(t0 + 199 * MS);
    shed(&sim.decide(&mut b, &call("b", "t")));
    sim.advance_to(t0 + 200 * MS);
    sim.lease(&mut b, &call("b", "t"));

    // a success reported through globex recovers the rate acme sees
    sim.advance_ms(1000);
    let l = sim.lease(&mut b, &call("b", "t"));
    sim.release(&mut b, l, &ok());
    assert_close(sim.upstream(&a, "s").multiplier, 0.55, "shared recovery");
}

// ---- 2. SRE adaptive throttling ---------------------------------------------------------------------

fn sre_cfg(min_requests: u64, k: f64) -> String {
    roomy(&format!(
        "[tools.t]\nupstream = \"u\"\n[upstreams.u]\nadaptive_k = {k:?}\nadaptive_min_requests = {min_requests}\n"
    ))
}

/// Admits `n` calls while the window is still empty (admits record nothing), then releases
/// `rejected` of them with a 429 (no penalty) and the rest as accepted.
fn feed_releases(sim: &Sim, e: &mut TenantEngine, n: usize, rejected: usize) {
    let leases: Vec<u64> = (0..n).map(|_| sim.lease(e, &call("a", "t"))).collect();
    for (i, l) in leases.into_iter().enumerate() {
        let info = if i < rejected {
            r429(Some(Duration::ZERO))
        } else {
            ok()
        };
        sim.release(e, l, &info);
    }
}

#[test]
fn throttle_probability_at_known_counts_through_the_engine() {
    let sim = Sim::new(&sre_cfg(10, 2.0));
    let mut e = sim.engine("acme");
    feed_releases(&sim, &mut e, 80, 60);
    let u = sim.upstream(&e, "u");
    assert_eq!((u.requests, u.accepts), (80, 20));
    // max(0, (80 - 2·20) / 81)
    assert_eq!(u.throttle_probability, 40.0 / 81.0);
    assert_eq!(u.configured_rate, None, "no bucket: adaptive only");

    // more accepts than requests / K: zero
    let sim = Sim::new(&sre_cfg(10, 2.0));
    let mut e = sim.engine("acme");
    feed_releases(&sim, &mut e, 30, 10);
    let u = sim.upstream(&e, "u");
    assert_eq!((u.requests, u.accepts), (30, 20));
    assert_eq!(u.throttle_probability, 0.0);
    for _ in 0..200 {
        sim.lease(&mut e, &call("a", "t"));
    }

    // K = 1.5, through feedback: (10 - 1.5·2) / 11
    let sim = Sim::new(&sre_cfg(0, 1.5));
    let mut e = sim.engine("acme");
    for i in 0..10 {
        let status = if i < 8 { 429 } else { 200 };
        sim.feedback(&mut e, "u", status, Some(Duration::ZERO));
    }
    assert_eq!(sim.upstream(&e, "u").throttle_probability, 7.0 / 11.0);
}

/// Admits `n` calls (never releasing them), and returns (adaptive sheds, expected sheds Σpᵢ, variance
/// Σpᵢ(1−pᵢ)), where pᵢ is the probability the snapshot reports before call i.
fn run_throttled(sim: &Sim, e: &mut TenantEngine, n: usize) -> (usize, f64, f64) {
    let (mut sheds, mut mean, mut var) = (0, 0.0, 0.0);
    for _ in 0..n {
        let p = sim.upstream(e, "u").throttle_probability;
        mean += p;
        var += p * (1.0 - p);
        let d = sim.decide(e, &call("a", "t"));
        match &d.verdict {
            Verdict::Shed(s) => {
                assert_eq!(s.scope, Scope::Adaptive);
                sheds += 1;
            }
            Verdict::Admitted(_) => {}
        }
    }
    (sheds, mean, var)
}

#[test]
fn adaptive_sheds_match_the_probability_and_count_as_requests() {
    // A large window so the local refusals added by the run barely move the probability:
    // r = 100 000, a = 25 000, K = 2 → p = 50 000 / 100 001 ≈ 0.5.
    let sim = Sim::new(&sre_cfg(20, 2.0));
    let mut e = sim.engine("acme");
    for _ in 0..75_000 {
        sim.feedback(&mut e, "u", 429, Some(Duration::ZERO));
    }
    for _ in 0..25_000 {
        sim.feedback(&mut e, "u", 200, None);
    }
    let p0 = sim.upstream(&e, "u").throttle_probability;
    assert_eq!(p0, 50_000.0 / 100_001.0);

    let n = 2000;
    let (sheds, mean, var) = run_throttled(&sim, &mut e, n);
    let share = sheds as f64 / n as f64;
    eprintln!(
        "adaptive: p0 = {p0:.4}, expected sheds {mean:.1} (sd {:.1}), got {sheds} ({share:.4})",
        var.sqrt()
    );
    assert!((share - p0).abs() <= 0.05, "share {share} vs p {p0}");
    assert!(
        (sheds as f64 - mean).abs() <= 4.0 * var.sqrt(),
        "{sheds} sheds, expected {mean:.1} ± {:.1}",
        4.0 * var.sqrt()
    );
    // every local refusal was counted as a request (and never as an accept)
    let u = sim.upstream(&e, "u");
    assert_eq!((u.requests, u.accepts), (100_000 + sheds as u64, 25_000));
}

#[test]
fn local_refusals_feed_the_window_so_the_throttle_tightens_while_nothing_is_accepted() {
    // Small window: r = 80, a = 20, K = 2. Nobody releases, so only local refusals are added and the
    // probability climbs from 40/81 towards 1; the run tracks it call by call.
    let sim = Sim::new(&sre_cfg(10, 2.0));
    let mut e = sim.engine("acme");
    feed_releases(&sim, &mut e, 80, 60);
    let (sheds, mean, var) = run_throttled(&sim, &mut e, 2000);
    eprintln!(
        "adaptive (climbing): expected {mean:.1} (sd {:.1}), got {sheds}",
        var.sqrt()
    );
    assert!((sheds as f64 - mean).abs() <= 4.0 * var.sqrt() + 1.0);
    let u = sim.upstream(&e, "u");
    assert_eq!((u.requests, u.accepts), (80 + sheds as u64, 20));
    let r = u.requests as f64;
    assert_eq!(u.throttle_probability, (r - 40.0) / (r + 1.0));
    assert!(sheds > 1800, "the throttle closed in: {sheds}");
}

#[test]
fn no_adaptive_shed_below_min_requests() {
    let sim = Sim::new(&sre_cfg(100, 2.0));
    let mut e = sim.engine("acme");
    feed_releases(&sim, &mut e, 80, 60);
    let u = sim.upstream(&e, "u");
    assert_eq!(
        u.throttle_probability, 0.0,
        "the snapshot shows what the throttle applies: nothing below adaptive_min_requests"
    );
    assert_eq!((u.requests, u.accepts), (80, 20), "while still counting");
    let sheds = (0..500)
        .filter(|_| !sim.decide(&mut e, &call("a", "t")).is_admitted())
        .count();
    assert_eq!(sheds, 0, "80 requests < adaptive_min_requests = 100");
    assert_eq!(sim.upstream(&e, "u").requests, 80, "no local refusals");

    // 20 more rejected requests reach the minimum: p = (100 - 40) / 101
    for _ in 0..20 {
        sim.feedback(&mut e, "u", 429, Some(Duration::ZERO));
    }
    assert_eq!(sim.upstream(&e, "u").throttle_probability, 60.0 / 101.0);
    let sheds = (0..50)
        .filter(|_| !sim.decide(&mut e, &call("a", "t")).is_admitted())
        .count();
    assert!(sheds > 0, "at the minimum the throttle applies");
}

#[test]
fn adaptive_k_zero_disables_the_throttle() {
    let sim = Sim::new(&sre_cfg(0, 0.0));
    assert!(sim.cfg.upstreams["u"].adaptive.is_none());
    let mut e = sim.engine("acme");
    for _ in 0..200 {
        sim.feedback(&mut e, "u", 429, Some(Duration::ZERO));
    }
    feed_releases(&sim, &mut e, 100, 100);
    let u = sim.upstream(&e, "u");
    assert_eq!((u.requests, u.accepts), (0, 0), "nothing is recorded");
    assert_eq!(u.throttle_probability, 0.0);
    for _ in 0..1000 {
        sim.lease(&mut e, &call("a", "t"));
    }
}

// ---- 3. amplification -------------------------------------------------------------------------------

fn amp_cfg() -> String {
    roomy(
        r#"
[tools.sync_customers]
upstreams = { crm = 200, erp = 1 }

[tools.single]
upstream = "erp"

[upstreams.crm]
rate = "1/min"
burst = 1000
adaptive_k = 0

[upstreams.erp]
rate = "1/min"
burst = 2
adaptive_k = 0
"#,
    )
}

const BIG: u64 = 1_000_000;

#[test]
fn an_amplified_call_charges_each_upstream_units_times_cost() {
    let sim = Sim::new(&amp_cfg());
    let mut e = sim.engine("acme");
    let d = sim.decide(&mut e, &call("agent", "sync_customers").cost(2.0));
    admitted_now(&d);
    assert_eq!(
        d.resolved.upstreams,
        vec![(Arc::from("crm"), 200.0), (Arc::from("erp"), 1.0)]
    );
    assert_eq!(
        d.resolved.upstream.as_deref(),
        Some("crm"),
        "the primary upstream is the one spent most"
    );
    assert_eq!(sim.tokens(&e, "tenant_upstream", "crm"), Some(600));
    assert_eq!(sim.tokens(&e, "tenant_upstream", "erp"), Some(0));
    assert_eq!(sim.tokens(&e, "subject", "agent"), Some(BIG - 2));
    assert_eq!(sim.tokens(&e, "tenant", "acme"), Some(BIG - 2));
    let ups: Vec<_> = d
        .layers
        .iter()
        .filter(|l| l.layer == Layer::TenantUpstream)
        .map(|l| (l.burst, l.remaining))
        .collect();
    assert_eq!(ups, vec![(1000.0, 600), (2.0, 0)]);
}

#[test]
fn a_refusal_on_the_second_upstream_spends_nothing_on_the_first() {
    let sim = Sim::new(&amp_cfg());
    let mut e = sim.engine("acme");
    sim.lease(&mut e, &call("agent", "sync_customers"));
    sim.lease(&mut e, &call("agent", "sync_customers"));
    let before = (
        sim.tokens(&e, "tenant_upstream", "crm"),
        sim.tokens(&e, "tenant_upstream", "erp"),
        sim.tokens(&e, "subject", "agent"),
        sim.tokens(&e, "tenant", "acme"),
        sim.global_tokens(),
    );
    assert_eq!(
        before,
        (Some(600), Some(0), Some(BIG - 2), Some(BIG - 2), BIG - 2)
    );
    // erp is empty (1/min): one token in 60 s
    let s = assert_shed(
        &sim.decide(&mut e, &call("agent", "sync_customers")),
        Scope::TenantUpstream,
        60 * SEC,
    );
    assert!(s.message.contains("the erp quota"), "{}", s.message);
    let after = (
        sim.tokens(&e, "tenant_upstream", "crm"),
        sim.tokens(&e, "tenant_upstream", "erp"),
        sim.tokens(&e, "subject", "agent"),
        sim.tokens(&e, "tenant", "acme"),
        sim.global_tokens(),
    );
    assert_eq!(after, before, "the crm reservation of 200 was given back");
}

#[test]
fn the_request_upstream_overrides_the_tools_upstreams() {
    let sim = Sim::new(&amp_cfg());

    // naming one of the tool's upstreams spends only that one, at the tool's units
    let mut e = sim.engine("a1");
    let d = sim.decide(&mut e, &call("agent", "sync_customers").up("erp"));
    admitted_now(&d);
    assert_eq!(d.resolved.upstreams, vec![(Arc::from("erp"), 1.0)]);
    assert_eq!(sim.tokens(&e, "tenant_upstream", "erp"), Some(1));
    assert_eq!(
        sim.tokens(&e, "tenant_upstream", "crm"),
        None,
        "crm untouched"
    );

    let mut e = sim.engine("a2");
    let d = sim.decide(&mut e, &call("agent", "sync_customers").up("crm").cost(2.0));
    admitted_now(&d);
    assert_eq!(d.resolved.upstreams, vec![(Arc::from("crm"), 200.0)]);
    assert_eq!(sim.tokens(&e, "tenant_upstream", "crm"), Some(600));
    assert_eq!(sim.tokens(&e, "tenant_upstream", "erp"), None);

    // an upstream the tool does not list: the cost, multiplier 1 (API.md's single-upstream semantics)
    let mut e = sim.engine("a3");
    let d = sim.decide(&mut e, &call("agent", "unlisted").up("crm").cost(3.0));
    admitted_now(&d);
    assert_eq!(d.resolved.upstreams, vec![(Arc::from("crm"), 1.0)]);
    assert_eq!(sim.tokens(&e, "tenant_upstream", "crm"), Some(997));

    // a tool with a single `upstream` is `{ erp = 1 }`
    let mut e = sim.engine("a4");
    let d = sim.decide(&mut e, &call("agent", "single").cost(2.0));
    admitted_now(&d);
    assert_eq!(d.resolved.upstreams, vec![(Arc::from("erp"), 1.0)]);
    assert_eq!(d.resolved.upstream.as_deref(), Some("erp"));
    assert_eq!(sim.tokens(&e, "tenant_upstream", "erp"), Some(0));
}

#[test]
fn a_penalty_on_either_upstream_sheds_the_amplified_call_naming_it() {
    let sim = Sim::new(&amp_cfg());
    let mut e = sim.engine("acme");
    sim.feedback(&mut e, "erp", 429, Some(Duration::from_secs(5)));
    let t0 = sim.now();
    let s = assert_shed(
        &sim.decide(&mut e, &call("agent", "sync_customers")),
        Scope::UpstreamPenalty,
        5 * SEC,
    );
    assert!(s.message.starts_with("The erp service"), "{}", s.message);
    assert!(!s.message.contains("crm"), "{}", s.message);
    assert_eq!(
        sim.tokens(&e, "tenant_upstream", "crm"),
        None,
        "nothing spent"
    );
    assert_eq!(sim.tokens(&e, "subject", "agent"), None, "nothing spent");
    // the same tool aimed at crm alone is not paused
    admitted_now(&sim.decide(&mut e, &call("agent", "sync_customers").up("crm")));

    // now crm asks for a longer pause: the call names crm, with crm's wait
    sim.feedback(&mut e, "crm", 429, Some(Duration::from_secs(9)));
    let s = assert_shed(
        &sim.decide(&mut e, &call("agent", "sync_customers")),
        Scope::UpstreamPenalty,
        9 * SEC,
    );
    assert!(s.message.starts_with("The crm service"), "{}", s.message);
    sim.advance_to(t0 + 6 * SEC);
    let s = assert_shed(
        &sim.decide(&mut e, &call("agent", "sync_customers")),
        Scope::UpstreamPenalty,
        3 * SEC,
    );
    assert!(s.message.starts_with("The crm service"));
    // erp's penalty is over; only crm is paused
    admitted_now(&sim.decide(&mut e, &call("agent", "single")));
}

#[test]
fn a_429_released_on_an_amplified_call_penalises_every_upstream_it_spent() {
    // A release cannot say which of the call's upstreams answered 429, so all of them are paused.
    let sim = Sim::new(&amp_cfg());
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("agent", "sync_customers"));
    sim.release(&mut e, l, &r429(Some(Duration::from_secs(4))));
    let mut p: Vec<_> = sim
        .snap(&e)
        .penalties
        .iter()
        .map(|p| (p.upstream.clone(), p.retry_after_ms))
        .collect();
    p.sort();
    assert_eq!(p, vec![("crm".into(), 4000), ("erp".into(), 4000)]);
}

#[test]
fn an_amplified_call_larger_than_an_upstream_burst_is_oversized() {
    let sim = Sim::new(&amp_cfg());
    let mut e = sim.engine("acme");
    // 6 × 200 = 1200 > crm's burst of 1000 (1000 / 200 = 5 cost units), and 6 > erp's burst of 2:
    // the limit named is the one every upstream admits, 2
    let s = shed(&sim.decide(&mut e, &call("agent", "sync_customers").cost(6.0))).clone();
    assert_eq!(s.scope, Scope::Oversized);
    assert!(!s.retryable);
    assert_eq!(s.retry_after_ms, 0);
    assert!(
        s.message.contains("it costs 6 units; the limit is 2"),
        "{}",
        s.message
    );
    // 3 × 200 = 600 fits crm, but 3 × 1 > erp's burst of 2
    let s = shed(&sim.decide(&mut e, &call("agent", "sync_customers").cost(3.0))).clone();
    assert_eq!(s.scope, Scope::Oversized);
    assert!(
        s.message.contains("it costs 3 units; the limit is 2"),
        "{}",
        s.message
    );
    // 2 fits both; nothing was spent by the oversized calls
    assert_eq!(sim.tokens(&e, "subject", "agent"), None);
    admitted_now(&sim.decide(&mut e, &call("agent", "sync_customers").cost(2.0)));
    assert_eq!(sim.tokens(&e, "tenant_upstream", "crm"), Some(600));
}

// ---- 4. budgets sized from a published limit --------------------------------------------------------

/// Calls every millisecond from now to now + `secs` inclusive; returns how many were admitted.
fn admitted_over(sim: &Sim, e: &mut TenantEngine, secs: u64) -> usize {
    let t0 = sim.now();
    let mut n = 0;
    for i in 0..=secs * 1000 {
        sim.advance_to(t0 + i * MS);
        if sim.decide(e, &call("a", "t")).is_admitted() {
            n += 1;
        }
    }
    n
}

#[test]
fn a_published_limit_minus_batch_traffic_sets_the_rate() {
    let sim = Sim::new(&roomy(
        "[tools.t]\nupstream = \"crm\"\n[upstreams.crm]\npublished_limit = \"20/s\"\nreserved_for_batch = \"8/s\"\nheadroom = 1.0\nburst = 5\nadaptive_k = 0\n",
    ));
    let mut e = sim.engine("acme");
    // burst + 12/s × 10 s, with calls every millisecond over exactly 10 s (both ends included)
    assert_eq!(admitted_over(&sim, &mut e, 10), 5 + 12 * 10);
    let u = sim.upstream(&e, "crm");
    assert_eq!(u.published_limit, Some(20.0));
    assert_eq!(u.reserved_for_batch, Some(8.0));
    assert_eq!(u.configured_rate, Some(12.0));
    assert_eq!(u.effective_rate, Some(12.0));
}

#[test]
fn the_default_headroom_budgets_seventy_percent_of_what_batch_leaves() {
    let sim = Sim::new(&roomy(
        "[tools.t]\nupstream = \"crm\"\n[upstreams.crm]\npublished_limit = \"20/s\"\nreserved_for_batch = \"8/s\"\nadaptive_k = 0\n",
    ));
    let mut e = sim.engine("acme");
    // 12 × 0.7 = 8.4/s; the burst defaults to one second of it, rounded up: 9
    assert_eq!(admitted_over(&sim, &mut e, 10), 9 + 84);
    assert_close(
        sim.upstream(&e, "crm").configured_rate.unwrap(),
        8.4,
        "derived rate",
    );
}

// ---- 5. fair share of a contended shared upstream ---------------------------------------------------

const FAIR_CFG: &str = r#"
[tools.call]
upstream = "api"

[upstreams.api]
rate = "20/s"
burst = 20
shared = true
"#;

#[derive(Debug, Default)]
struct Tally {
    admitted: usize,
    shed: usize,
    held: usize,
    hold_ns: u64,
    max_hold_ns: u64,
}

impl Tally {
    fn record(&mut self, sim: &Sim, e: &mut TenantEngine, d: &Decision) {
        match &d.verdict {
            Verdict::Admitted(a) => {
                self.admitted += 1;
                if a.hold_ns > 0 {
                    self.held += 1;
                }
                self.hold_ns += a.hold_ns;
                self.max_hold_ns = self.max_hold_ns.max(a.hold_ns);
                // the call runs (after its hold, which the fake clock does not wait for) and ends well
                sim.release(e, a.lease, &ok());
            }
            Verdict::Shed(s) => {
                assert_eq!(s.scope, Scope::TenantUpstream, "{s:?}");
                self.shed += 1;
            }
        }
    }
}

#[test]
fn light_tenants_keep_their_calls_while_a_loop_gets_the_rest() {
    let sim = Sim::new(&roomy(FAIR_CFG));
    let mut light1 = sim.engine("light1");
    let mut light2 = sim.engine("light2");
    let mut looper = sim.engine("loop");
    let (mut l1, mut l2, mut lp) = (Tally::default(), Tally::default(), Tally::default());
    let light = call("agent", "call").wait_ms(2000);
    let hot = call("agent", "call");
    let t0 = sim.now();
    let mut early = None;
    // 20 s of calls: the loop every 10 ms first, then the light tenants every 500 ms (light2 offset
    // by 250 ms), so the loop always gets the first try at a token.
    for tick in 0..2000u64 {
        sim.advance_to(t0 + tick * 10 * MS);
        let d = sim.decide(&mut looper, &hot);
        lp.record(&sim, &mut looper, &d);
        if tick % 50 == 0 {
            let d = sim.decide(&mut light1, &light);
            l1.record(&sim, &mut light1, &d);
        }
        if tick % 50 == 25 {
            let d = sim.decide(&mut light2, &light);
            l2.record(&sim, &mut light2, &d);
        }
        if tick == 0 {
            // nobody has reported demand yet: not contended
            early = Some((
                sim.upstream(&looper, "api").fair_share,
                sim.upstream(&light1, "api").fair_share,
            ));
        }
    }
    eprintln!("fair share: loop {lp:?}\n light1 {l1:?}\n light2 {l2:?}");
    assert_eq!(early, Some((None, None)));

    // every light call was admitted, a few after a short hold behind the loop's last token
    assert_eq!((l1.admitted, l1.shed), (40, 0));
    assert_eq!((l2.admitted, l2.shed), (40, 0));
    // The shared bucket is exactly balanced (16 + 2 + 2 = 20/s) and the loop tries every 10 ms, so a
    // light call usually finds it empty and reserves the next token: at most one refill interval
    // (50 ms at 20/s) of hold per call, 80 × 50 ms = 4 s at most over 80 calls (measured: 3.95 s).
    for t in [&l1, &l2] {
        assert!(t.max_hold_ns <= 50 * MS, "at most one token's wait: {t:?}");
    }
    assert!(
        l1.hold_ns + l2.hold_ns <= 80 * 50 * MS,
        "holds are short: {} ms in all",
        (l1.hold_ns + l2.hold_ns) / MS
    );
    // The loop gets the rest: burst 20 + (20 − 4)/s × 20 s = 340. Tolerance: the last try is at
    // 19.99 s, by when the shared bucket has handed out at most 20 + 399 tokens, and the lights took
    // 80 of them, so 339 is a hard ceiling. Below it we allow 10 (3%) for tokens the loop cannot use
    // while its fair sub-bucket is empty and for the start, before demand reports exist.
    let ceiling = 20 + 399 - 80;
    assert!(
        (ceiling - 10..=ceiling).contains(&lp.admitted),
        "loop admitted {} (expected {}..={ceiling}; 20 + 16 × 20 = 340 in continuous time)",
        lp.admitted,
        ceiling - 10
    );
    assert_eq!(lp.admitted + lp.shed, 2000);

    let share = |e: &TenantEngine| sim.upstream(e, "api").fair_share;
    let (s_loop, s1, s2) = (share(&looper), share(&light1), share(&light2));
    eprintln!("fair shares: loop {s_loop:?} light1 {s1:?} light2 {s2:?}");
    assert!((s_loop.unwrap() - 16.0).abs() < 0.5, "{s_loop:?}");
    assert!((s1.unwrap() - 2.0).abs() < 0.25, "{s1:?}");
    assert!((s2.unwrap() - 2.0).abs() < 0.25, "{s2:?}");

    // The loop stops; once its demand report is older than 2 s the upstream is no longer contended.
    let t1 = sim.now();
    for tick in 1..=800u64 {
        sim.advance_to(t1 + tick * 10 * MS);
        if tick % 50 == 0 {
            let d = sim.decide(&mut light1, &light);
            l1.record(&sim, &mut light1, &d);
        }
        if tick % 50 == 25 {
            let d = sim.decide(&mut light2, &light);
            l2.record(&sim, &mut light2, &d);
        }
    }
    assert_eq!(share(&light1), None);
    assert_eq!(share(&looper), None);
}

#[test]
fn plan_weights_split_a_contended_upstream_two_to_one() {
    let sim = Sim::new(&roomy(&format!(
        "{FAIR_CFG}\n[plans.gold]\nweight = 2\n[plans.basic]\nweight = 1\n[tenants.big]\nplan = \"gold\"\n[tenants.small]\nplan = \"basic\"\n"
    )));
    let mut big = sim.engine("big");
    let mut small = sim.engine("small");
    let (mut b, mut s) = (Tally::default(), Tally::default());
    let (mut b_steady, mut s_steady) = (0, 0);
    let hot = call("agent", "call");
    let t0 = sim.now();
    for tick in 0..2000u64 {
        sim.advance_to(t0 + tick * 10 * MS);
        // alternate who tries first, so neither gets the first try at every token
        let order: [bool; 2] = if tick % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_big in order {
            let (e, t, steady) = if is_big {
                (&mut big, &mut b, &mut b_steady)
            } else {
                (&mut small, &mut s, &mut s_steady)
            };
            let before = t.admitted;
            let d = sim.decide(e, &hot);
            t.record(&sim, e, &d);
            if tick >= 500 && t.admitted > before {
                *steady += 1;
            }
        }
    }
    let ratio = b_steady as f64 / s_steady as f64;
    eprintln!(
        "weighted: big {} small {} (after 5 s: {b_steady} vs {s_steady}, ratio {ratio:.3})",
        b.admitted, s.admitted
    );
    let (sb, ss) = (
        sim.upstream(&big, "api").fair_share.unwrap(),
        sim.upstream(&small, "api").fair_share.unwrap(),
    );
    assert!((sb - 40.0 / 3.0).abs() < 0.1, "{sb}");
    assert!((ss - 20.0 / 3.0).abs() < 0.1, "{ss}");
    // From 5 s on (the fair buckets start full, so for the first ~2 s both tenants spend their
    // bursts and split the shared tokens about evenly) the split is 2:1.
    assert!((1.95..=2.05).contains(&ratio), "ratio {ratio}");
    // together they use the whole upstream: 20 + 20/s × 20 s
    assert!((b.admitted + s.admitted).abs_diff(420) <= 10);
}

// ---- 6. held and queued calls are shed cheaply when their upstream starts a penalty --------------------

fn queue_cfg() -> String {
    "[limits.subject]\nconcurrency = 1\n[tools.t]\nupstream = \"u\"\n[tools.v]\nupstream = \"v\"\n[upstreams.u]\nrate = \"100/s\"\nburst = 100\nadaptive_k = 0\n[upstreams.v]\nrate = \"100/s\"\nburst = 100\nadaptive_k = 0\n".to_string()
}

#[test]
fn a_429_release_refuses_the_calls_queued_for_that_upstream_at_once() {
    let sim = Sim::new(&queue_cfg());
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("a", "t"));
    let on_u = sim.queue(&mut e, &call("a", "t").wait_ms(2000));
    let on_v = sim.queue(&mut e, &call("a", "v").wait_ms(2000));
    let rel = sim.release(&mut e, l, &r429(Some(Duration::from_secs(3))));
    assert_eq!(rel.granted.len(), 2, "{:?}", rel.granted);
    let (id, d) = &rel.granted[0];
    assert_eq!(*id, on_u);
    let s = assert_shed(d, Scope::UpstreamPenalty, 3 * SEC);
    assert!(s.message.starts_with("The u service"), "{}", s.message);
    // the slot goes to the call queued for another upstream
    let (id, d) = &rel.granted[1];
    assert_eq!(*id, on_v);
    admitted_now(d);
    assert_eq!(sim.snap(&e).waiting, 0);
}

#[test]
fn a_429_feedback_refuses_the_calls_queued_for_that_upstream_via_drain() {
    let sim = Sim::new(&queue_cfg());
    let mut e = sim.engine("acme");
    let _l = sim.lease(&mut e, &call("a", "t"));
    let on_u = sim.queue(&mut e, &call("a", "t").wait_ms(2000));
    let _on_v = sim.queue(&mut e, &call("a", "v").wait_ms(2000));
    assert!(e.drain_decisions().is_empty());
    sim.feedback(&mut e, "u", 429, Some(Duration::from_secs(5)));
    let drained = e.drain_decisions();
    assert_eq!(drained.len(), 1, "{drained:?}");
    assert_eq!(drained[0].0, on_u);
    assert_shed(&drained[0].1, Scope::UpstreamPenalty, 5 * SEC);
    assert_eq!(
        sim.snap(&e).waiting,
        1,
        "the call queued for v keeps waiting"
    );
    assert!(e.drain_decisions().is_empty(), "drained once");
}

#[test]
fn a_zero_retry_after_does_not_shed_queued_calls() {
    let sim = Sim::new(&queue_cfg());
    let mut e = sim.engine("acme");
    let l = sim.lease(&mut e, &call("a", "t"));
    let on_u = sim.queue(&mut e, &call("a", "t").wait_ms(2000));
    let rel = sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
    assert_eq!(rel.granted.len(), 1);
    assert_eq!(rel.granted[0].0, on_u);
    // the upstream asked for no pause at all, so the freed slot should go to the queued call
    admitted_now(&rel.granted[0].1);
}

#[test]
fn queued_calls_are_told_the_longest_running_penalty() {
    let sim = Sim::new(
        "[limits.subject]\nconcurrency = 1\n[tools.t]\nupstream = \"s\"\n[upstreams.s]\nrate = \"100/s\"\nburst = 100\nshared = true\nadaptive_k = 0\n",
    );
    let mut a = sim.engine("acme");
    let mut b = sim.engine("globex");
    let l = sim.lease(&mut a, &call("a", "t"));
    let waiter = sim.queue(&mut a, &call("a", "t").wait_ms(2000));
    // globex learns the shared upstream wants 30 s; acme's queued call is not told (other engine)
    sim.feedback(&mut b, "s", 429, Some(Duration::from_secs(30)));
    assert!(a.drain_decisions().is_empty());
    // acme's own call then gets a 429 asking for 2 s
    let rel = sim.release(&mut a, l, &r429(Some(Duration::from_secs(2))));
    assert_eq!(rel.granted[0].0, waiter);
    // the queued call should be told the 30 s the upstream is actually paused for
    assert_shed(&rel.granted[0].1, Scope::UpstreamPenalty, 30 * SEC);
}

fn hold_cfg(shared: bool) -> String {
    format!(
        "[limits.subject]\nrate = \"1/min\"\nburst = 10\nconcurrency = 10\n[tools.t]\nupstream = \"u\"\n[upstreams.u]\nrate = \"1/s\"\nburst = 1\nshared = {shared}\naimd_factor = 1.0\nadaptive_k = 0\n"
    )
}

#[test]
fn a_held_call_whose_upstream_429s_before_the_hold_ends_is_shed_and_refunded() {
    // aimd_factor = 1.0 keeps the rate still, so the refund shows as whole tokens.
    let sim = Sim::new(&hold_cfg(false));
    let mut e = sim.engine("acme");
    let t0 = sim.now();
    let first = sim.lease(&mut e, &call("a", "t"));
    let d = sim.decide(&mut e, &call("a", "t").wait_ms(2000));
    let held = admitted(&d);
    assert_eq!(held.hold_ns, SEC);
    let held = held.lease;
    assert_eq!(sim.tokens(&e, "subject", "a"), Some(8));
    assert_eq!(sim.tokens(&e, "tenant_upstream", "u"), Some(0));

    // without a penalty the hold check lets the call go
    sim.advance_to(t0 + 500 * MS);
    assert_eq!(e.confirm_hold(held, sim.now(), sim.wall()), Ok(None));

    // the first call's 429 (Retry-After 5 s) arrives while the second is still held
    sim.release(&mut e, first, &r429(Some(Duration::from_secs(5))));
    sim.advance_to(t0 + SEC);
    let d = e
        .confirm_hold(held, sim.now(), sim.wall())
        .expect("live lease")
        .expect("shed by the penalty");
    let s = assert_shed(&d, Scope::UpstreamPenalty, 4500 * MS);
    assert!(s.message.contains("retrying sooner cannot help"));
    // everything the held call took is back: the subject token and the upstream token
    assert_eq!(sim.tokens(&e, "subject", "a"), Some(9));
    assert_eq!(sim.tokens(&e, "tenant_upstream", "u"), Some(1));
    assert_eq!(sim.snap(&e).inflight, 0, "its slot is free");
    assert_eq!(
        e.release(held, &ok(), sim.now(), sim.wall()),
        Err(UnknownLease),
        "the lease is gone"
    );
    // after the penalty the next call finds the token at once
    sim.advance_to(t0 + 5500 * MS);
    sim.lease(&mut e, &call("a", "t"));
}

#[test]
fn a_held_call_on_a_shared_upstream_is_shed_by_another_tenants_429() {
    let sim = Sim::new(&hold_cfg(true));
    let mut a = sim.engine("acme");
    let mut b = sim.engine("globex");
    sim.lease(&mut a, &call("a", "t"));
    let held = admitted(&sim.decide(&mut a, &call("a", "t").wait_ms(2000))).clone();
    assert_eq!(held.hold_ns, SEC);
    sim.feedback(&mut b, "u", 429, Some(Duration::from_secs(3)));
    sim.advance_ms(1000);
    let d = a
        .confirm_hold(held.lease, sim.now(), sim.wall())
        .unwrap()
        .expect("shed");
    let s = assert_shed(&d, Scope::UpstreamPenalty, 2 * SEC);
    assert!(s.message.contains("The u service"));
    assert_eq!(sim.tokens(&a, "subject", "a"), Some(9));
}

// ---- 7. retry guidance ------------------------------------------------------------------------------

#[test]
fn an_upstream_penalty_tells_its_retry_after_and_that_sooner_cannot_help() {
    let sim = Sim::new(&roomy(
        "[tools.t]\nupstream = \"u\"\n[upstreams.u]\nrate = \"1/s\"\nburst = 1\nadaptive_k = 0\n",
    ));
    let mut e = sim.engine("acme");
    // the bucket is empty (1 s to wait) *and* the upstream asks for 7 s: the penalty is checked
    // first, so the call hears the longer, upstream-given wait
    sim.lease(&mut e, &call("a", "t"));
    sim.feedback(&mut e, "u", 429, Some(Duration::from_secs(7)));
    let s = assert_shed(
        &sim.decide(&mut e, &call("a", "t")),
        Scope::UpstreamPenalty,
        7 * SEC,
    );
    assert!((7000..=7100).contains(&s.retry_after_ms));
    assert_eq!(s.reason, "upstream asked to slow down");
    assert!(
        s.message.contains("retrying sooner cannot help"),
        "{}",
        s.message
    );
    assert!(s.message.contains("Do not retry sooner"));
    let secs = s.retry_after_ms.div_ceil(1000);
    assert!(
        s.message.contains(&format!("Wait {secs} seconds")),
        "{}",
        s.message
    );
    let p = &sim.snap(&e).penalties;
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].upstream.as_str(), p[0].retry_after_ms), ("u", 7000));
}

#[test]
fn an_adaptive_refusal_says_retrying_at_once_will_not_help() {
    let sim = Sim::new(&sre_cfg(0, 2.0));
    let mut e = sim.engine("acme");
    for _ in 0..90 {
        sim.feedback(&mut e, "u", 429, Some(Duration::ZERO));
    }
    for _ in 0..10 {
        sim.feedback(&mut e, "u", 200, None);
    }
    let mut seen = 0;
    for _ in 0..200 {
        let p = sim.upstream(&e, "u").throttle_probability;
        let d = sim.decide(&mut e, &call("a", "t"));
        if let Verdict::Shed(_) = d.verdict {
            // 2 s per accepted-to-rejected ratio, between 1 and 30 s
            let wait = (2.0 * p / (1.0 - p).max(0.05)).clamp(1.0, 30.0);
            let s = assert_shed(&d, Scope::Adaptive, (wait * SEC as f64) as u64);
            assert!(
                s.message.contains("Retrying at once will not help"),
                "{}",
                s.message
            );
            assert!(s
                .message
                .contains("The u service is rejecting most requests"));
            assert!(
                s.reason
                    .contains(&format!("throttling {:.0}% of calls", p * 100.0)),
                "{}",
                s.reason
            );
            seen += 1;
        }
    }
    assert!(seen > 150, "p starts at 80/101 and climbs: {seen}");
}

#[test]
fn adaptive_refusals_at_one_moment_are_told_times_a_refill_step_apart() {
    // u refills 20/s, cut to its floor of half by the 429s: a step is 100 ms. The throttle's wait
    // (about 8 s at this rejection rate) is where the spread starts.
    let sim = Sim::new(&roomy(
        "[tools.t]\nupstream = \"u\"\n[upstreams.u]\nrate = \"20/s\"\nburst = 1000\naimd_floor = 0.5\nadaptive_k = 2.0\nadaptive_min_requests = 0\n",
    ));
    let mut e = sim.engine("acme");
    // A thousand answers, so the refusals below (each counted as a request) hardly move the
    // rejection rate, and with it the wait: what spreads the hints is the stagger.
    // (The healthy answers first: they would win back the rate the 429s cut.)
    for _ in 0..100 {
        sim.feedback(&mut e, "u", 200, None);
    }
    for _ in 0..900 {
        sim.feedback(&mut e, "u", 429, Some(Duration::ZERO));
    }
    let mut hints = Vec::new();
    for _ in 0..40 {
        let p = sim.upstream(&e, "u").throttle_probability;
        let d = sim.decide(&mut e, &call("a", "t"));
        if let Verdict::Shed(s) = &d.verdict {
            let wait = (2.0 * p / (1.0 - p).max(0.05)).clamp(1.0, 30.0);
            assert!(
                s.retry_after_ms as f64 >= wait * 1000.0 - 1.0,
                "{s:?} p {p}"
            );
            hints.push(s.retry_after_ms);
        }
    }
    assert!(hints.len() >= 12, "{hints:?}");
    assert!(hints.windows(2).all(|w| w[1] >= w[0]), "{hints:?}");
    let n = hints.len() as u64;
    // About 100 ms apart on average (each hint has up to 100 ms of jitter of its own).
    assert!(
        hints[hints.len() - 1] - hints[0] >= (n - 1) * 90,
        "not a step apart: {hints:?}"
    );
}

/// Refused calls are promised staggered retry slots. A loop that ignores its hints takes a new promise
/// on every try; with one promise cursor per shared bucket, that would push every other tenant's hint
/// out without bound. Cursors are per tenant, so another tenant's hint stays near its token.
#[test]
fn a_loop_ignoring_its_hints_does_not_inflate_other_tenants_hints() {
    let sim = Sim::new(&roomy(FAIR_CFG));
    let mut looper = sim.engine("loop");
    let mut other = sim.engine("other");
    let hot = call("agent", "call");
    let t0 = sim.now();
    for tick in 0..2000u64 {
        sim.advance_to(t0 + tick * 10 * MS);
        if let Verdict::Admitted(a) = &sim.decide(&mut looper, &hot).verdict {
            sim.release(&mut looper, a.lease, &ok());
        }
    }
    // a token comes back every 50 ms; another tenant that did not wait is refused, but should be
    // told a wait near that, not one behind all the promises the loop never came back for
    let d = sim.decide(&mut other, &hot);
    let s = shed(&d);
    eprintln!(
        "other tenant's hint after the loop: {} ms",
        s.retry_after_ms
    );
    assert_eq!(s.scope, Scope::TenantUpstream);
    // at most one refill interval (50 ms at 20/s) plus 5% jitter
    assert!(
        s.retry_after_ms <= 53,
        "told to wait {} ms for a token at most 50 ms away",
        s.retry_after_ms
    );
}

// ---- 8. a loop on a shared upstream whose budget is above what the upstream takes ------------------

/// The fair share config with a budget three times what the upstream really takes (20/s), and no
/// adaptive throttle (its refusals are random; these tests follow the penalty and the AIMD rate).
const LOOP_CFG: &str = r#"
[tools.call]
upstream = "api"

[upstreams.api]
rate = "60/s"
burst = 10
shared = true
adaptive_k = 0
"#;

/// Lets a loop and a light tenant run on the FAIR_CFG upstream for 3 s, so both have reported their
/// demand. Returns the lease of a loop call still in flight.
fn loop_beside_a_light_tenant(
    sim: &Sim,
    looper: &mut TenantEngine,
    light: &mut TenantEngine,
) -> u64 {
    let t0 = sim.now();
    let mut in_flight = None;
    for tick in 0..300u64 {
        sim.advance_to(t0 + tick * 10 * MS);
        if let Verdict::Admitted(a) = &sim.decide(looper, &call("agent", "call")).verdict {
            if let Some(l) = in_flight.replace(a.lease) {
                sim.release(looper, l, &ok());
            }
        }
        if tick % 50 == 0 {
            let d = sim.decide(light, &call("agent", "call").wait_ms(2000));
            sim.release(light, admitted(&d).lease, &ok());
        }
    }
    in_flight.expect("the loop has a call in flight")
}

#[test]
fn a_tenant_within_its_share_is_not_paused_by_the_penalty_a_loop_provoked() {
    let sim = Sim::new(&roomy(FAIR_CFG));
    let mut looper = sim.engine("loop");
    let mut light = sim.engine("light");
    let lease = loop_beside_a_light_tenant(&sim, &mut looper, &mut light);
    let api = sim.shared.upstream("api").unwrap();
    let (mine, its) = (
        api.share_of("light").unwrap(),
        api.share_of("loop").unwrap(),
    );
    assert!(!mine.bottlenecked && its.bottlenecked, "{mine:?} {its:?}");
    assert_eq!(mine.excess(), 0.0);
    // The loop asks for 100 calls/s and its share is 18/s: 82% of what it asks for is past its share.
    assert!((0.8..0.85).contains(&its.excess()), "{its:?}");

    // The loop's call in flight comes back 429 with Retry-After: 1.
    let t = sim.now();
    sim.release(&mut looper, lease, &r429(Some(Duration::from_secs(1))));
    let pause = (its.excess() * SEC as f64).round() as u64;

    // The loop waits out its part of the second...
    let s = shed(&sim.decide(&mut looper, &call("agent", "call"))).clone();
    assert_eq!(s.scope, Scope::UpstreamPenalty, "{s:?}");
    assert!(s.retry_after_ms >= ceil_ms(pause), "{s:?}, pause {pause}");
    // ...while the light tenant's calls go on: admitted, and not taken back when a hold ends.
    let d = sim.decide(&mut light, &call("agent", "call").wait_ms(2000));
    let a = admitted(&d).clone();
    sim.advance_ms(a.hold_ns / MS + 1);
    assert_eq!(light.confirm_hold(a.lease, sim.now(), sim.wall()), Ok(None));
    sim.release(&mut light, a.lease, &ok());

    // Its pause is fixed when the 429 arrived, however the shares move meanwhile.
    sim.advance_to(t + pause - MS);
    let s = shed(&sim.decide(&mut looper, &call("agent", "call"))).clone();
    assert_eq!(s.scope, Scope::UpstreamPenalty);
    // (Meanwhile the 429 cut the budget and the loop's share with it, which would lengthen it.)
    assert!(api.share_of("loop").unwrap().excess() > its.excess());
    sim.advance_to(t + pause);
    if let Verdict::Shed(s) = &sim.decide(&mut looper, &call("agent", "call")).verdict {
        assert_ne!(s.scope, Scope::UpstreamPenalty, "{s:?}");
    }
}

#[test]
fn with_no_tenant_past_its_share_a_shared_penalty_pauses_every_tenant_for_all_of_it() {
    // Two light tenants, 2 calls/s each of a 20/s budget: not contended, no shares. A 429 then says
    // the upstream takes less than they send together: both are over, both wait it all out.
    let sim = Sim::new(&roomy(FAIR_CFG));
    let mut a = sim.engine("acme");
    let mut b = sim.engine("globex");
    let t0 = sim.now();
    let mut last = None;
    for tick in 0..6u64 {
        sim.advance_to(t0 + tick * 500 * MS);
        for e in [&mut a, &mut b] {
            let l = sim.lease(e, &call("agent", "call"));
            sim.release(e, l, &ok());
        }
        last = Some(sim.lease(&mut a, &call("agent", "call")));
    }
    assert_eq!(sim.upstream(&a, "api").fair_share, None, "not contended");
    let t = sim.now();
    sim.release(&mut a, last.unwrap(), &r429(Some(Duration::from_secs(2))));
    for e in [&mut a, &mut b] {
        assert_shed(
            &sim.decide(e, &call("agent", "call")),
            Scope::UpstreamPenalty,
            2 * SEC,
        );
    }
    sim.advance_to(t + 2 * SEC);
    for e in [&mut a, &mut b] {
        sim.lease(e, &call("agent", "call"));
    }
}

#[test]
fn a_429_during_a_running_penalty_does_not_cut_the_shared_rate_again() {
    let sim = Sim::new(&roomy(LOOP_CFG));
    let mut e = sim.engine("acme");
    let leases: Vec<u64> = (0..3)
        .map(|_| sim.lease(&mut e, &call("a", "call")))
        .collect();
    // Three calls were in flight when the upstream started refusing: one cut, not three.
    for l in leases {
        sim.release(&mut e, l, &r429(Some(Duration::from_secs(1))));
    }
    assert_eq!(sim.upstream(&e, "api").multiplier, 0.5);
    // Once the penalty is over, a new 429 is news: the rate is cut again.
    sim.advance_ms(1000);
    let l = sim.lease(&mut e, &call("a", "call"));
    sim.release(&mut e, l, &r429(Some(Duration::from_secs(1))));
    assert_eq!(sim.upstream(&e, "api").multiplier, 0.25);
}

#[test]
fn the_shared_rate_learns_its_ceiling_from_what_was_served_and_settles_below_it() {
    let sim = Sim::new(&roomy(LOOP_CFG));
    let mut e = sim.engine("acme");
    let api = sim.shared.upstream("api").unwrap();
    // The upstream serves 20 calls/s for 3 s, then refuses one.
    for _ in 0..60 {
        let l = sim.lease(&mut e, &call("a", "call"));
        sim.release(&mut e, l, &ok());
        sim.advance_ms(50);
    }
    let l = sim.lease(&mut e, &call("a", "call"));
    sim.release(&mut e, l, &r429(Some(Duration::ZERO)));
    // Ceiling 20/60, and the rate goes straight to 10% below it, not to half of 60/s.
    assert!(
        (api.ceiling() - 1.0 / 3.0).abs() < 1e-9,
        "{}",
        api.ceiling()
    );
    let u = sim.upstream(&e, "api");
    assert_close(u.multiplier, 0.3, "settle point");
    assert_close(u.effective_rate.unwrap(), 18.0, "effective rate");
    // Healthy answers at the hold move nothing until the first probe, 10 s after the 429: then the
    // rate is 5% above the ceiling (21/s) for 3 s, and back at the hold after it.
    let t429 = sim.now();
    for _ in 0..99 {
        sim.advance_ms(100);
        let l = sim.lease(&mut e, &call("a", "call"));
        sim.release(&mut e, l, &ok());
        assert_close(
            sim.upstream(&e, "api").effective_rate.unwrap(),
            18.0,
            "held",
        );
    }
    sim.advance_to(t429 + 10 * SEC);
    sim.lease(&mut e, &call("a", "call"));
    assert_close(
        sim.upstream(&e, "api").effective_rate.unwrap(),
        21.0,
        "probing",
    );
    sim.advance_to(t429 + 13 * SEC);
    sim.lease(&mut e, &call("a", "call"));
    assert_close(
        sim.upstream(&e, "api").effective_rate.unwrap(),
        18.0,
        "after the probe",
    );
    // Two minutes without a 429 forget nothing: the probes find the capacity again.
    sim.advance_ms(121_000);
    let l = sim.lease(&mut e, &call("a", "call"));
    sim.release(&mut e, l, &ok());
    assert!((api.ceiling() - 1.0 / 3.0).abs() < 1e-9);
}

/// The upstream's own limit on the fake clock: a token bucket.
struct RealLimit {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Nanos,
}

impl RealLimit {
    fn new(rate: f64, burst: f64, now: Nanos) -> Self {
        RealLimit {
            rate,
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// Whether the upstream serves a call at `now` (else it answers 429).
    fn serves(&mut self, now: Nanos) -> bool {
        let refill = (now - self.at) as f64 / SEC as f64 * self.rate;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.at = now;
        let ok = self.tokens >= 1.0;
        if ok {
            self.tokens -= 1.0;
        }
        ok
    }
}

/// What happens next to a call in flight, on the fake clock.
enum Next {
    /// A held call's hold ends: checked, then sent to the upstream.
    HoldEnds { lease: u64 },
    /// The upstream answered; the MCP server releases the lease.
    Answered { lease: u64, served: bool },
}

/// What one simulated second of [`loop_run`] saw: calls the upstream served and answered 429, and
/// the light tenants' calls and how many of them the upstream served.
#[derive(Debug, Default, Clone, Copy)]
struct Second {
    served: u64,
    bounced: u64,
    light_calls: u64,
    light_served: u64,
}

/// The loop scenario on the fake clock, for `secs` seconds: the upstream takes `limit(second)`
/// calls/s (burst 10) and admitd is told 60/s. The loop keeps four calls in flight and tries again
/// every 5 ms; two light tenants call 3 times a second each, and wait up to 2 s. Every upstream
/// call takes 20 ms. Returns what each second saw.
fn loop_run(sim: &Sim, secs: u64, limit: impl Fn(u64) -> f64) -> Vec<Second> {
    const TICK: u64 = 5 * MS;
    const LATENCY: u64 = 20 * MS;
    let mut engines = [sim.engine("loop"), sim.engine("acme"), sim.engine("globex")];
    let mut upstream = RealLimit::new(limit(0), 10.0, sim.now());
    let t0 = sim.now();
    let mut events: Vec<(Nanos, usize, Next)> = Vec::new();
    let mut loop_in_flight = 0;
    let mut seconds = vec![Second::default(); secs as usize];
    for tick in 0..(secs * SEC / TICK) {
        let now = t0 + tick * TICK;
        let second = (tick * TICK / SEC) as usize;
        upstream.rate = limit(second as u64);
        sim.advance_to(now);
        // What is due, in time order.
        events.sort_by_key(|e| std::cmp::Reverse(e.0));
        while events.last().is_some_and(|e| e.0 <= now) {
            let (_, who, next) = events.pop().unwrap();
            let e = &mut engines[who];
            match next {
                Next::HoldEnds { lease } => {
                    if e.confirm_hold(lease, now, sim.wall()).unwrap().is_some() {
                        continue; // shed at the end of its hold: a light call lost
                    }
                    let ok = upstream.serves(now);
                    let s = &mut seconds[second];
                    s.served += u64::from(ok);
                    s.bounced += u64::from(!ok);
                    s.light_served += u64::from(ok);
                    let lease = Next::Answered { lease, served: ok };
                    events.push((now + LATENCY, who, lease));
                }
                Next::Answered { lease, served } => {
                    let info = if served {
                        ok()
                    } else {
                        r429(Some(Duration::from_secs(1)))
                    };
                    sim.release(e, lease, &info);
                    if who == 0 {
                        loop_in_flight -= 1;
                    }
                }
            }
        }
        if loop_in_flight < 4 {
            if let Verdict::Admitted(a) = &sim.decide(&mut engines[0], &call("bot", "call")).verdict
            {
                let ok = upstream.serves(now);
                let s = &mut seconds[second];
                s.served += u64::from(ok);
                s.bounced += u64::from(!ok);
                loop_in_flight += 1;
                let lease = Next::Answered {
                    lease: a.lease,
                    served: ok,
                };
                events.push((now + LATENCY, 0, lease));
            }
        }
        for who in [1, 2] {
            // every 335 ms (67 ticks), globex half a period behind acme
            if tick % 67 != (who as u64 - 1) * 33 {
                continue;
            }
            let d = sim.decide(&mut engines[who], &call("agent", "call").wait_ms(2000));
            seconds[second].light_calls += 1;
            if let Verdict::Admitted(a) = &d.verdict {
                events.push((now + a.hold_ns, who, Next::HoldEnds { lease: a.lease }));
            }
        }
    }
    seconds
}

/// The sum of `seconds[from..to]`.
fn total(seconds: &[Second], from: usize, to: usize) -> Second {
    seconds[from..to]
        .iter()
        .fold(Second::default(), |t, s| Second {
            served: t.served + s.served,
            bounced: t.bounced + s.bounced,
            light_calls: t.light_calls + s.light_calls,
            light_served: t.light_served + s.light_served,
        })
}

#[test]
fn a_loop_on_a_shared_upstream_sized_too_high_leaves_light_tenants_their_calls() {
    // Five minutes on an upstream that takes 20/s, judged from 20 s on: long enough for the probe
    // schedule to widen to its widest and probe many times.
    let sim = Sim::new(&roomy(LOOP_CFG));
    let seconds = loop_run(&sim, 300, |_| 20.0);
    let t = total(&seconds, 20, 300);
    let secs = 280.0;
    let (light_share, bounced_share, served_share) = (
        t.light_served as f64 / t.light_calls as f64,
        t.bounced as f64 / secs / 20.0,
        t.served as f64 / secs / 20.0,
    );
    let api = sim.shared.upstream("api").unwrap();
    eprintln!(
        "light tenants kept {} of {} calls; the upstream served {} and answered 429 to {} (429s \
         {:.2}% of its limit, served {:.1}% of it); probe {:?}",
        t.light_served,
        t.light_calls,
        t.served,
        t.bounced,
        bounced_share * 100.0,
        served_share * 100.0,
        api.probe()
    );
    assert!(light_share >= 0.99, "light tenants kept {light_share}");
    assert!(bounced_share <= 0.01, "429s: {bounced_share} of the limit");
    assert!(served_share >= 0.85, "served {served_share} of the limit");
}

#[test]
fn a_raised_limit_is_found_again_within_a_minute() {
    // 20/s for two minutes (the probe schedule is at its widest), then 40/s.
    let sim = Sim::new(&roomy(LOOP_CFG));
    let seconds = loop_run(&sim, 240, |s| if s < 120 { 20.0 } else { 40.0 });
    // The first second from which five seconds in a row served at least 85% of 40/s.
    let found = (120..235).find(|&s| total(&seconds, s, s + 5).served >= 5 * 34);
    let after = total(&seconds, 180, 240);
    eprintln!(
        "85% of the raised limit used {:?} s after it rose; then served {:.1}/s with {} 429s \
         in 60 s; probe {:?}",
        found.map(|s| s - 120),
        after.served as f64 / 60.0,
        after.bounced,
        sim.shared.upstream("api").unwrap().probe()
    );
    let found = found.expect("85% of the raised limit never used");
    assert!(found - 120 <= 60, "{} s", found - 120);
    // and it settles there again
    assert!(after.served as f64 / 60.0 >= 34.0, "{after:?}");
    assert!(after.bounced as f64 / 60.0 <= 0.4, "{after:?}");
}
