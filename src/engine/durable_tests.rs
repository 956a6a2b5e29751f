//! A tenant engine's kept state through export and import on a fake clock: what a restart keeps,
//! what it drops, by wall-clock time.

use std::sync::Arc;
use std::time::Duration;

use super::test_support::*;
use super::*;
use crate::clock::FakeClock;
use crate::config::Config;
use crate::engine::durable::Instants;

const CFG: &str = "\
[limits.subject]\nrate = \"100/s\"\nburst = 100\ndaily_quota = 3\n\
[limits.tenant]\ndaily_quota = 5\n\
[upstreams.u]\nrate = \"10/s\"\nburst = 10\nadaptive_window = \"60s\"\n\
[upstreams.s]\nrate = \"10/s\"\nburst = 10\nshared = true\n";

struct Side {
    clock: FakeClock,
    cfg: Arc<Config>,
    shared: Arc<SharedBudgets>,
}

impl Clocked for Side {
    fn clock(&self) -> &FakeClock {
        &self.clock
    }
}

/// A fresh process at wall time `wall_ms`.
fn process(wall_ms: i64) -> (Side, TenantEngine) {
    let (clock, cfg, shared) = harness(CFG, wall_ms);
    let e = TenantEngine::new(Arc::from("acme"), cfg.clone(), shared.clone(), 7);
    (Side { clock, cfg, shared }, e)
}

fn spend(side: &Side, e: &mut TenantEngine, subject: &str) -> Decision {
    side.decide(e, &call(subject, "t"))
}

#[test]
fn quota_use_penalties_and_cuts_come_back_after_a_restart() {
    let (a, mut e) = process(NOON);
    for _ in 0..3 {
        admitted(&spend(&a, &mut e, "bot"));
    }
    assert_eq!(shed(&spend(&a, &mut e, "bot")).scope, Scope::DailyQuota);
    // A 429 with 30 s to wait on a per-tenant upstream, one on the shared one.
    e.feedback(&Arc::from("u"), 429, Some(Duration::from_secs(30)), a.now());
    e.feedback(&Arc::from("s"), 429, Some(Duration::from_secs(30)), a.now());
    let kept = e.export_durable(a.now(), a.wall());
    let shared_kept = a.shared.export_durable(
        &a.cfg,
        Instants {
            now: a.now(),
            wall_ms: a.wall(),
        },
    );
    assert_eq!(kept.subjects.len(), 1);
    assert_eq!(kept.quota.map(|q| q.used), Some(3.0));
    assert_eq!(kept.upstreams.len(), 1, "the shared upstream is kept apart");
    assert!(kept.upstreams[0].multiplier < 1.0);
    assert_eq!(shared_kept.len(), 1);

    // Back 10 s later, in a process that has run 12.345 s more (its clocks started elsewhere).
    let (b, mut e2) = process(NOON + 10_000);
    b.advance_ms(12_345);
    e2.import_durable(&kept, b.now(), b.wall());
    b.shared.import_durable(
        &b.cfg,
        &shared_kept,
        Instants {
            now: b.now(),
            wall_ms: b.wall(),
        },
    );
    assert_eq!(shed(&spend(&b, &mut e2, "bot")).scope, Scope::DailyQuota);
    // Another subject shares the tenant's quota of 5: two more fit, not five.
    admitted(&spend(&b, &mut e2, "other"));
    admitted(&spend(&b, &mut e2, "other"));
    assert_eq!(shed(&spend(&b, &mut e2, "other")).scope, Scope::DailyQuota);
    for up in ["u", "s"] {
        let d = b.decide(&mut e2, &call("third", "t").up(up));
        let s = shed(&d);
        assert_eq!(s.scope, Scope::UpstreamPenalty, "{up}");
        // 30 s from the 429, 22.345 s of which have passed (plus jitter).
        assert!(
            (7_655..=8_100).contains(&s.retry_after_ms),
            "{up}: {}",
            s.retry_after_ms
        );
    }
    let again = e2.export_durable(b.now(), b.wall());
    assert_eq!(again.upstreams[0].multiplier, kept.upstreams[0].multiplier);
    assert_eq!(
        again.upstreams[0]
            .window
            .iter()
            .map(|w| w.requests)
            .sum::<u64>(),
        kept.upstreams[0]
            .window
            .iter()
            .map(|w| w.requests)
            .sum::<u64>(),
        "the throttle window came back whole"
    );
}

#[test]
fn a_penalty_that_ended_while_down_and_a_past_days_quota_are_gone() {
    let (a, mut e) = process(NOON);
    for _ in 0..3 {
        admitted(&spend(&a, &mut e, "bot"));
    }
    e.feedback(&Arc::from("u"), 429, Some(Duration::from_secs(30)), a.now());
    let kept = e.export_durable(a.now(), a.wall());

    // 31 s later: the penalty is over, the quota still today's.
    let (b, mut e2) = process(NOON + 31_000);
    e2.import_durable(&kept, b.now(), b.wall());
    admitted(&b.decide(&mut e2, &call("x", "t").up("u")));
    assert_eq!(shed(&spend(&b, &mut e2, "bot")).scope, Scope::DailyQuota);

    // The next UTC day: the quota starts again.
    let (c, mut e3) = process(NOON + 12 * 3_600_000);
    e3.import_durable(&kept, c.now(), c.wall());
    for _ in 0..3 {
        admitted(&spend(&c, &mut e3, "bot"));
    }
    // Nothing left to keep from a resting engine.
    let (d, e4) = process(NOON);
    assert!(e4.export_durable(d.now(), d.wall()).is_empty());
}
