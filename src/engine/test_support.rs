//! Helpers shared by the engine's fake-clock test modules (`tests.rs`, `upstream_tests.rs`).

use std::sync::Arc;

use super::*;
use std::time::Duration;

use crate::clock::{ceil_ms, Clock, FakeClock, Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::Config;

pub const MS: u64 = NS_PER_MS;
pub const SEC: u64 = NS_PER_SEC;

/// Where the monotonic clock starts, so no test runs at the special instant 0.
pub const START_MS: u64 = 1_000_000;

/// 2026-10-21T12:00:00.000Z (a Wednesday).
pub const NOON: i64 = 1_792_584_000_000;

pub fn call(subject: &str, tool: &str) -> AdmitRequest {
    AdmitRequest {
        subject: subject.into(),
        tool: tool.into(),
        upstream: None,
        cost: None,
        max_wait_ns: 0,
        returning: false,
        spend: None,
    }
}

/// Request modifiers, so a test reads `call("a", "t").cost(3.0).wait_ms(250)`.
pub trait Req {
    fn up(self, upstream: &str) -> Self;
    fn cost(self, cost: f64) -> Self;
    fn wait_ms(self, ms: u64) -> Self;
}

impl Req for AdmitRequest {
    fn up(mut self, upstream: &str) -> Self {
        self.upstream = Some(upstream.into());
        self
    }
    fn cost(mut self, cost: f64) -> Self {
        self.cost = Some(cost);
        self
    }
    fn wait_ms(mut self, ms: u64) -> Self {
        self.max_wait_ns = ms * MS;
        self
    }
}

pub fn admitted(d: &Decision) -> &Admitted {
    match &d.verdict {
        Verdict::Admitted(a) => a,
        Verdict::Shed(s) => panic!(
            "expected an admission, got a shed: {:?} ({}) retry {} ms",
            s.scope, s.reason, s.retry_after_ms
        ),
    }
}

pub fn shed(d: &Decision) -> &Shed {
    match &d.verdict {
        Verdict::Shed(s) => s,
        Verdict::Admitted(a) => panic!("expected a shed, got an admission: {a:?}"),
    }
}

/// Asserts an immediate admission (no hold) and returns its lease.
pub fn admitted_now(d: &Decision) -> u64 {
    let a = admitted(d);
    assert_eq!(a.hold_ns, 0, "admitted without a hold");
    assert_eq!(a.would_shed, None);
    a.lease
}

/// The retry hint the engine gives for a true wait of `wait_ns`: never less than the wait, plus at most
/// 5% of it and at most 100 ms of jitter, in whole milliseconds rounded up.
pub fn hint_window(wait_ns: u64) -> std::ops::RangeInclusive<u64> {
    let jitter_max = (wait_ns / 20).min(100 * MS);
    ceil_ms(wait_ns).max(1)..=ceil_ms(wait_ns + jitter_max).max(1)
}

/// What every fake-clock harness starts from: the parsed config, its cross-tenant budgets, and a fake
/// clock whose wall clock reads `wall_ms` and whose monotonic clock reads [`START_MS`].
pub fn harness(toml: &str, wall_ms: i64) -> (FakeClock, Arc<Config>, Arc<SharedBudgets>) {
    let cfg = Arc::new(
        Config::parse("test.toml", toml)
            .unwrap_or_else(|e| panic!("test config does not parse: {e}")),
    );
    let clock = FakeClock::new(wall_ms - START_MS as i64);
    clock.advance_ms(START_MS);
    let shared = Arc::new(SharedBudgets::new(&cfg));
    (clock, cfg, shared)
}

/// Clock and admission helpers for a test harness that owns a [`FakeClock`].
pub trait Clocked {
    fn clock(&self) -> &FakeClock;

    fn now(&self) -> Nanos {
        self.clock().mono()
    }

    fn wall(&self) -> i64 {
        self.clock().wall_ms()
    }

    fn advance_ms(&self, ms: u64) {
        self.clock().advance_ms(ms);
    }

    /// Moves both clocks forward to the monotonic instant `at`.
    fn advance_to(&self, at: Nanos) {
        let now = self.now();
        assert!(at >= now, "the fake clock only moves forward");
        self.clock().advance(Duration::from_nanos(at - now));
    }

    fn admit(&self, e: &mut TenantEngine, r: &AdmitRequest) -> AdmitResult {
        e.admit(r, self.now(), self.wall())
    }

    /// Admits and expects a decision (not a place in the queue).
    fn decide(&self, e: &mut TenantEngine, r: &AdmitRequest) -> Decision {
        match self.admit(e, r) {
            AdmitResult::Decided(d) => d,
            q => panic!("expected a decision, got {q:?}"),
        }
    }
}
