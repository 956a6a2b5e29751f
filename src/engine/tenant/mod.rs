//! The admission engine for one tenant: every layer of docs/architecture.md, as plain data driven by
//! `now`.
//!
//! A [`TenantEngine`] owns one tenant's buckets (subject, subject×tool, tenant, tenant×upstream),
//! concurrency slots, daily quotas, upstream penalty boxes, adaptive-throttle windows, leases and the FIFO
//! queue of calls waiting for a slot. The cross-tenant layers (global, shared upstreams) live in
//! [`SharedBudgets`] and are taken last. It never blocks, sleeps or spawns: every method takes the
//! monotonic `now` (and the wall clock where calendar days matter) and returns what happened. The tenant
//! actor feeds it messages and timers; tests feed it a fake clock.
//!
//! Order of checks for a call, each refusal giving back what earlier layers took:
//! oversized → upstream penalty → adaptive throttle → concurrency (subject, tenant; may queue) → daily
//! quota (subject, tenant) → buckets (subject, `subject_tool`, tenant, `tenant_upstream` for every upstream
//! the call spends, global).
//!
//! Upstreams are more than a bucket: a 429 reported on release or feedback starts a penalty (until the
//! upstream's Retry-After), cuts that budget's effective rate (AIMD, see [`super::adaptive`]) and feeds the
//! adaptive throttle; successes recover it. A tool may spend several upstreams at once (amplification),
//! charged all or nothing.
//!
//! The engine is split along the path of one decision. This module holds the engine's state and the
//! order of the steps ([`TenantEngine::admit`]); the rooms it uses:
//! - [`plan`]: which layers a call passes and at what shape (deciding the call before touching state);
//! - [`store`]: the state those layers read and write (buckets, slots, quota counters, refunds);
//! - [`interpret`]: turning what the state answered into a decision (refusals, retry hints, layer
//!   states for the headers, shadow mode);
//! - [`upstream`]: each upstream's penalty box, AIMD rate, adaptive throttle and fair-share demand;
//! - [`subjects`]: the table of subjects' states and their metric labels;
//! - [`calls`]: what happens after admission (leases, releases, the queue, expiry);
//! - [`snapshot`]: snapshots, gauges and the engine's resting state.

mod calls;
mod interpret;
mod names;
mod persist;
mod plan;
mod promises;
mod remote;
mod snapshot;
mod spend;
mod store;
mod subjects;
mod tasks;
mod upstream;

use calls::*;
use interpret::*;
use names::intern;
use plan::*;
use promises::*;
pub use remote::*;
pub use snapshot::*;
use store::*;
use subjects::*;
pub use tasks::PollAnswer;
use tasks::Tasks;
use upstream::*;

use std::collections::VecDeque;
use std::hash::BuildHasher;

/// The engine's maps are keyed by caller-supplied names and lease numbers and looked up several times
/// per decision: a fast seeded hasher (foldhash) instead of `SipHash`. The seed is random per map, so
/// keys cannot be chosen to collide.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::Arc;
use std::time::Duration;

use compact_str::CompactString;
use serde::Serialize;
use smallvec::SmallVec;

use super::adaptive::{adaptive_wait, aimd_cut, aimd_recover, SreWindow};
use super::bucket::{
    stagger, stagger_atomic, stagger_window, AtomicBucket, Bucket, Gcra, Promise, Take,
    PROMISE_HORIZON,
};
use super::leases::{Expiries, Leases};
use super::refusal::{self, RefusalContext};
use super::rng::Rng;
use super::shared::{SharedBudgets, SharedUpstream};
use super::slots::{self, RunTimeBook, SlotPromise};
use super::spend::{SpendLedger, SpendView, SpendViews};
use super::types::*;
use crate::clock::{ceil_ms, ms_until_utc_midnight, utc_day, Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::{BucketSpec, Config, Mode, TenantLimits, UpstreamConfig};
use crate::engine::labels::SubjectLabels;

/// A call asking to be admitted.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmitRequest {
    /// Names as sent (inline up to 24 bytes): the engine hands out its own shared copies, the
    /// subject's kept in the subject's state, tool and upstream names in the tenant's name set.
    pub subject: CompactString,
    pub tool: CompactString,
    pub upstream: Option<CompactString>,
    pub cost: Option<f64>,
    /// The longest the caller may be held, already capped by the server's `max_wait`.
    pub max_wait_ns: u64,
    /// The caller comes back for a bucket slot it was promised (the daemon asking again on its
    /// behalf, see the API's admission): it may be held into promised tokens, since its own is
    /// among them, where any other call is held only behind every promise.
    pub returning: bool,
    /// The call's run and spend estimates, when it names either (behind a pointer: most calls do
    /// not; an `Arc`, because the request is cloned for each ask of the tenant's actor).
    pub spend: Option<Arc<CallSpend>>,
}

/// What a call says about its spend: the agent run it belongs to, and its own estimates by unit name.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallSpend {
    pub run: Option<CompactString>,
    pub estimates: SmallVec<[(CompactString, f64); 2]>,
}

/// What a release reports beyond [`ReleaseInfo`]: the call's actual spend per unit, and its actual
/// cost in cost units.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Settlement {
    pub spent: SmallVec<[(CompactString, f64); 2]>,
    pub cost: Option<f64>,
}

/// The engine's answer to an admission request. The large variant is the common one: boxing it
/// would cost an allocation per decision to save a copy of a queued call's two words.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum AdmitResult {
    Decided(Decision),
    /// No concurrency slot is free: the call waits in the tenant's queue. Its decision comes from a later
    /// `release`, `cancel_lease`, `expire_leases`, `expire_waiters` or `drain_decisions` call, by this id.
    Queued {
        waiter: u64,
        deadline: Nanos,
    },
}

/// What a release reports.
#[derive(Debug, Clone, PartialEq)]
pub struct ReleaseInfo {
    pub outcome: Outcome,
    pub upstream_status: Option<u16>,
    /// Already parsed from the upstream's Retry-After.
    pub retry_after: Option<Duration>,
    pub duration_ms: Option<u64>,
}

impl ReleaseInfo {
    /// A 429, by its outcome or its status: a penalty, an AIMD cut, a rejection.
    pub fn rate_limited(&self) -> bool {
        self.outcome == Outcome::UpstreamRateLimited || self.upstream_status == Some(429)
    }

    /// Whether the upstream's answer counts at all besides a 429 (a cancelled call's does not).
    pub fn reports_answer(&self) -> bool {
        self.outcome != Outcome::Cancelled
    }

    /// Whether the upstream accepted the call: 503 is the other "overloaded" answer, not an
    /// accept (but no penalty either).
    pub fn accepted(&self) -> bool {
        self.upstream_status != Some(503)
    }

    /// Whether the answer shows a healthy upstream (an ok outcome, a status below 500): it
    /// recovers the AIMD rate and counts as served.
    pub fn healthy(&self) -> bool {
        self.outcome == Outcome::Ok && self.upstream_status.is_none_or(|s| s < 500)
    }
}

/// How an upstream's answer reported outside a lease (`POST /v1/feedback`) with `status` other
/// than 429 counts, as a release's does: (accepted, healthy).
pub fn feedback_answer(status: u16) -> (bool, bool) {
    (status != 503, status < 500)
}

/// What a release did.
#[derive(Debug, Clone, PartialEq)]
pub struct Released {
    pub subject: Arc<str>,
    pub tool: Arc<str>,
    pub upstream: Option<Arc<str>>,
    /// The penalty the release started, if it reported a 429.
    pub penalty: Option<Duration>,
    /// Queued calls decided because of this release: granted a slot, or shed by the penalty it started.
    pub granted: Vec<(u64, Decision)>,
}

/// The lease does not exist here (never issued, released already, or expired).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownLease;

/// An expired lease as telemetry counts it: (subject label, tool, primary upstream).
pub type ExpiredLease = (Arc<str>, Arc<str>, Option<Arc<str>>);

/// The admission state of one tenant.
pub struct TenantEngine {
    tenant: Arc<str>,
    policy: Policy,
    shared: Arc<SharedBudgets>,
    subjects: Subjects,
    tenant_bucket: Bucket,
    upstreams: HashMap<Arc<str>, UpstreamState>,
    /// Decides subjects' metric labels ([`TenantEngine::subject_names`]).
    labels: Option<Arc<SubjectLabels>>,
    inflight: u32,
    quota: QuotaCounter,
    leases: Leases<Lease>,
    expiries: Expiries,
    /// No lease expires before this (the earliest entry of `expiries`, or later once it is stale), so
    /// an admission learns whether leases are due without reading `expiries`.
    next_expiry: Nanos,
    /// Leases expired outside [`TenantEngine::expire_leases`] (by an admission that needed their
    /// slot) and not yet taken with [`TenantEngine::take_expired`].
    expired: Vec<ExpiredLease>,
    waiters: VecDeque<Waiter>,
    /// Decisions for queued calls made outside `release` (a penalty from feedback sheds the calls
    /// queued for that upstream at once); the actor collects them with `drain_decisions`.
    pending: Vec<(u64, Decision)>,
    next_id: u64,
    rng: Rng,
    /// This tenant's promise cursor on the global bucket.
    global_promised: Nanos,
    /// How long calls run, per subject and tool, for concurrency retry hints.
    run_times: RunTimeBook,
    /// Slots promised to calls refused for want of the tenant's concurrency slots, in time order.
    slot_promises: Vec<SlotPromise>,
    last_active: Nanos,
    /// The call being decided is [`AdmitRequest::returning`] (false outside [`TenantEngine::admit`]).
    returning: bool,
    /// Renewed leases and MCP tasks (see [`tasks`]).
    tasks: Tasks,
    /// Spend reserved and settled: the tenant's and subjects' days, runs, live reservations.
    spend: SpendLedger,
}

impl TenantEngine {
    pub fn new(tenant: Arc<str>, cfg: Arc<Config>, shared: Arc<SharedBudgets>, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let next_id = rng.next_u64() >> 12;
        TenantEngine {
            policy: Policy::new(cfg, &tenant, &shared),
            tenant,
            shared,
            subjects: Subjects::default(),
            tenant_bucket: Bucket::default(),
            upstreams: HashMap::default(),
            labels: None,
            inflight: 0,
            quota: QuotaCounter::default(),
            leases: Leases::new(rng.next_u64()),
            expiries: Expiries::default(),
            next_expiry: Nanos::MAX,
            expired: Vec::new(),
            waiters: VecDeque::new(),
            pending: Vec::new(),
            global_promised: 0,
            next_id,
            rng,
            run_times: RunTimeBook::default(),
            slot_promises: Vec::new(),
            last_active: 0,
            returning: false,
            tasks: Tasks::default(),
            spend: SpendLedger::default(),
        }
    }

    pub fn tenant(&self) -> &Arc<str> {
        &self.tenant
    }

    pub fn config(&self) -> &Arc<Config> {
        &self.policy.cfg
    }

    /// Switches to a new config, keeping every live bucket's missing tokens, every lease and quota.
    pub fn set_config(&mut self, cfg: Arc<Config>, now: Nanos) {
        if Arc::ptr_eq(&cfg, &self.policy.cfg) {
            return;
        }
        let old = std::mem::replace(
            &mut self.policy,
            Policy::new(cfg, &self.tenant, &self.shared),
        );
        let new = &self.policy;
        if !std::ptr::eq(old.global(&self.shared), new.global(&self.shared)) {
            // Promises made on another bucket say nothing about this one.
            self.global_promised = 0;
        }
        self.tenant_bucket
            .rescale(now, &old.tenant_g, &new.tenant_g);
        for s in self.subjects.values_mut() {
            s.bucket.rescale(now, &old.subject_g, &new.subject_g);
            let Some(extra) = &mut s.extra else { continue };
            extra.tools.retain_mut(|(tool, b)| {
                let o = old.cfg.tools.get(&**tool).and_then(|t| t.bucket);
                match (o, new.cfg.tools.get(&**tool).and_then(|t| t.bucket)) {
                    (Some(o), Some(n)) => {
                        b.rescale(now, &Gcra::new(o), &Gcra::new(n));
                        true
                    }
                    _ => false,
                }
            });
        }
        for (name, u) in &mut self.upstreams {
            let o = old.upstream(name).and_then(|u| u.bucket);
            let n = new.upstream(name).and_then(|u| u.bucket);
            match (o, n) {
                (Some(o), Some(n)) => {
                    u.bucket
                        .rescale(now, &scaled(o, u.multiplier), &scaled(n, u.multiplier));
                }
                _ => u.bucket = Bucket::default(),
            }
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id
    }

    /// Starts loading the lease slot the next admission will write (see [`crate::prefetch`]).
    pub fn prefetch_lease_slot(&self) {
        self.leases.prefetch_next();
    }

    /// Decides a call, or queues it for a concurrency slot.
    pub fn admit(&mut self, req: &AdmitRequest, now: Nanos, wall_ms: i64) -> AdmitResult {
        self.returning = req.returning;
        let result = self.decide(req, now, wall_ms);
        self.returning = false;
        result
    }

    fn decide(&mut self, req: &AdmitRequest, now: Nanos, wall_ms: i64) -> AdmitResult {
        self.last_active = now;
        let r = self.resolve(req);
        let cfg = Arc::clone(&self.policy.cfg);
        let configs = upstream_configs(&cfg, &r);
        self.settle_cuts(&r, &configs, now);
        self.note_demand(&r, &configs, now);
        let plan = self.plan_for(&r, &configs);

        if let Some(shed) = self.oversized(&r, &plan) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if let Some(shed) = self.penalty(&r, &plan, now) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if let Some(shed) = self.adaptive(&r, &configs, now) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if self.take_slots_if_free(&r) || self.take_expired_slots(&r, now, wall_ms) {
            self.claim_slot_promise(&r.subject, now);
            return AdmitResult::Decided(self.after_slots(
                r,
                &plan,
                now,
                wall_ms,
                req.max_wait_ns,
                0,
            ));
        }
        let enforce = self.policy.cfg.server.mode == Mode::Enforce;
        if enforce && req.max_wait_ns > 0 && self.waiters.len() < self.policy.cfg.server.max_queue {
            let id = self.next_id();
            let deadline = now.saturating_add(req.max_wait_ns);
            self.waiters.push_back(Waiter {
                id,
                resolved: r,
                enqueued: now,
                deadline,
            });
            return AdmitResult::Queued {
                waiter: id,
                deadline,
            };
        }
        let shed = self.concurrency_shed(&r, now);
        AdmitResult::Decided(self.refuse(r, &plan, shed, now))
    }

    /// Quota and buckets, once the call holds its concurrency slots.
    fn after_slots(
        &mut self,
        r: Resolved,
        plan: &[LayerPlan],
        now: Nanos,
        wall_ms: i64,
        max_wait: u64,
        queued_ns: u64,
    ) -> Decision {
        let day = utc_day(wall_ms);
        let (subject_quota, tenant_quota) = (
            self.policy.limits.subject.daily_quota,
            self.policy.limits.tenant.daily_quota,
        );
        // The subject's use is looked up only when there is a quota to hold it to.
        let over_subject = subject_quota.is_some_and(|q| {
            let used = self
                .subjects
                .get(&r.subject)
                .map_or(0.0, |s| s.quota_used_on(day));
            used + r.cost > q + 1e-9
        });
        let over_tenant = tenant_quota.is_some_and(|q| self.quota.used_on(day) + r.cost > q + 1e-9);
        if over_subject || over_tenant {
            self.free_slots(&r.subject, now);
            let wait = ms_until_utc_midnight(wall_ms) * NS_PER_MS;
            let upstream = r.upstream.clone();
            let shed = self.shed_by(
                &r,
                upstream.as_deref(),
                Scope::DailyQuota,
                wait,
                !over_subject,
            );
            return self.refuse(r, plan, shed, now);
        }
        let spend = match r.spend.as_deref() {
            None => None,
            Some(sp) => match self.spend_check(&r.subject, sp, day, now) {
                Ok(views) => Some(views),
                Err(short) => {
                    self.free_slots(&r.subject, now);
                    let shed = self.spend_shed(&r, &short, wall_ms);
                    return self.refuse(r, plan, shed, now);
                }
            },
        };
        let mut charge = Charge {
            cost: r.cost,
            quota_day: day,
            ..Charge::default()
        };
        if subject_quota.is_some() {
            self.subject_mut(&r).extra_mut().quota.add(day, r.cost);
            charge.quota_subject = true;
        }
        if tenant_quota.is_some() {
            self.quota.add(day, r.cost);
            charge.quota_tenant = true;
        }

        let mut hold = 0u64;
        let several = several_upstreams(plan);
        let mut layers = Vec::with_capacity(plan.len());
        for (i, lp) in plan.iter().enumerate() {
            match self.take_layer(lp, &r, now, max_wait) {
                (Take::Ok { wait }, remaining, reset_ns) => {
                    charge.taken.push((lp.layer, lp.upstream.clone()));
                    hold = hold.max(wait);
                    layers.push(layer_state(lp, several, remaining, reset_ns));
                }
                (Take::Short { .. }, _, _) => {
                    // Give back everything, then promise this caller a slot behind earlier refusals.
                    self.undo_charge(&r, plan, &charge);
                    self.free_slots(&r.subject, now);
                    let promise = self.promise_layer(lp, &r, now, 0);
                    let mut wait = promise.wait();
                    for later in &plan[i + 1..] {
                        wait = wait.max(self.peek_layer(later, &r, now).2);
                    }
                    // An upstream that asked for a longer pause than the bucket's wait sets the hint.
                    if let Some((_, left)) = self.longest_penalty(&r, now) {
                        wait = wait.max(left);
                    }
                    let booked = matches!(promise, Promise::Booked(_));
                    if booked {
                        wait = self.spread_booked(wait);
                    }
                    let upstream = lp.upstream.clone().or_else(|| r.upstream.clone());
                    let mut shed = self.make_shed(&r, upstream.as_deref(), lp.layer.scope(), wait);
                    if booked {
                        shed.message.push_str(refusal::LONG_WAIT);
                    }
                    if lp.layer == Layer::TenantUpstream && lp.multiplier < 1.0 {
                        shed.reason = format!(
                            "rate limit reached (the upstream answered 429, so its budget is cut to {:.0}%)",
                            lp.multiplier * 100.0
                        );
                    }
                    return self.refuse(r, plan, shed, now);
                }
            }
        }

        let expires = now
            .saturating_add(hold)
            .saturating_add(self.policy.cfg.server.lease_ttl.as_nanos() as u64);
        let held = (hold > 0).then(|| {
            Box::new(Charge {
                hold_until: now.saturating_add(hold),
                ..charge
            })
        });
        let lease = self.leases.insert(Lease::new(&r, true, held, now, expires));
        match hold {
            0 => self.expiries.push(expires, lease),
            _ => self.expiries.push_late(expires, lease),
        }
        self.next_expiry = self.next_expiry.min(expires);
        if let Some(sp) = r.spend.as_deref() {
            let units = &self.policy.cfg.spend.units;
            self.spend.reserve(
                lease,
                &r.subject,
                sp.run.as_deref(),
                &sp.estimates,
                day,
                now,
                units,
            );
        }
        Decision {
            verdict: Verdict::Admitted(Admitted {
                lease,
                hold_ns: hold,
                queued_ns,
                mode: self.policy.cfg.server.mode,
                would_shed: None,
                unchecked: false,
                spend: spend.map(Box::new),
            }),
            resolved: r,
            layers,
        }
    }
}

#[cfg(all(test, target_pointer_width = "64"))]
mod lease_size {
    /// Every admission writes a lease and every release or expiry reads it, most often out of cache:
    /// its size is a cost per call. 96 bytes with its slot's number, 32-byte aligned: two cache
    /// lines hold any slot of the slab (at 112 bytes, every other slot spanned three).
    #[test]
    fn a_lease_and_its_number_take_96_bytes() {
        assert_eq!(crate::engine::leases::slot_size::<super::Lease>(), 96);
    }
}

#[cfg(all(test, target_pointer_width = "64"))]
mod subject_state {
    use super::*;
    use crate::clock::Clock;
    use crate::engine::test_support::{call, harness};

    /// The first touch of an admission is usually its subject's state, out of cache: all a plain
    /// call reads of it lies in one line.
    #[test]
    fn a_subject_state_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<SubjectState>(), 64);
        assert_eq!(std::mem::align_of::<SubjectState>(), 64);
    }

    #[test]
    fn subjects_are_found_by_name_among_many_and_dropped_one_by_one() {
        let names: Vec<Arc<str>> = (0..1000)
            .map(|i| match i % 3 {
                0 => Arc::from(format!("s{i}")),
                1 => Arc::from(format!("a-subject-name-longer-than-twenty-four-bytes-{i}")),
                _ => Arc::from(format!("ünïcödé-{i}")),
            })
            .collect();
        let mut subjects = Subjects::default();
        for n in &names {
            subjects.get_or_insert_with(n, || SubjectState::new(n.clone(), false, 0));
        }
        assert_eq!(subjects.len(), names.len());
        for (i, n) in names.iter().enumerate() {
            let s = subjects.get_or_insert_with(n, || panic!("{n} is there"));
            s.inflight = i as u32;
        }
        for (i, n) in names.iter().enumerate() {
            assert_eq!(subjects.get(n).map(|s| s.inflight), Some(i as u32), "{n}");
            assert!(Arc::ptr_eq(&subjects.get_mut(n).unwrap().name, n));
        }
        assert!(subjects.get("s1").is_none() && subjects.get("").is_none());
        subjects.retain(|s| s.inflight % 2 == 0);
        assert_eq!(subjects.len(), names.len() / 2);
        for (i, n) in names.iter().enumerate() {
            assert_eq!(subjects.get(n).is_some(), i % 2 == 0, "{n}");
        }
        subjects.retain(|_| false);
        assert!(subjects.is_empty());
    }

    fn engine(toml: &str) -> (crate::clock::FakeClock, TenantEngine) {
        let (clock, cfg, shared) = harness(toml, 0);
        (clock, TenantEngine::new(Arc::from("acme"), cfg, shared, 1))
    }

    #[test]
    fn only_calls_that_need_more_than_a_bucket_and_a_slot_count_box_the_rest() {
        let (clock, mut e) = engine("");
        e.admit(&call("plain", "search"), clock.mono(), clock.wall_ms());
        assert!(e.subjects.get("plain").unwrap().extra.is_none());

        let (clock, mut e) = engine("[limits.subject]\ndaily_quota = 5\n");
        e.admit(&call("counted", "search"), clock.mono(), clock.wall_ms());
        let s = e.subjects.get("counted").unwrap();
        assert_eq!(s.quota_used_on(crate::clock::utc_day(clock.wall_ms())), 1.0);

        let (clock, mut e) = engine("[tools.search]\nrate = \"5/s\"\n");
        e.admit(&call("tooled", "search"), clock.mono(), clock.wall_ms());
        let s = e.subjects.get("tooled").unwrap();
        assert_eq!(s.tools().len(), 1);
        assert_eq!(&*s.tools()[0].0, "search");
    }
}

#[cfg(test)]
mod next_lease_expiry {
    use super::*;
    use crate::engine::test_support::{call, harness};
    use crate::engine::Outcome;

    const SEC: Nanos = NS_PER_SEC;

    fn lease(d: &AdmitResult) -> u64 {
        match d {
            AdmitResult::Decided(Decision {
                verdict: Verdict::Admitted(a),
                ..
            }) => a.lease,
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    #[test]
    fn is_the_earliest_lease_end_and_none_once_all_are_gone() {
        let (_clock, cfg, shared) = harness("[server]\nlease_ttl = \"10s\"\n", 0);
        let mut e = TenantEngine::new(Arc::from("t"), cfg, shared, 1);
        assert_eq!(e.next_lease_expiry(), None);
        let a = lease(&e.admit(&call("s", "x"), 5 * SEC, 0));
        let _b = lease(&e.admit(&call("s", "x"), 7 * SEC, 0));
        assert_eq!(e.next_lease_expiry(), Some(15 * SEC));
        // Released early, the first lease leaves a stale entry: expiring at its time finds nothing
        // to free and moves on to the second lease's end.
        let info = ReleaseInfo {
            outcome: Outcome::Ok,
            upstream_status: None,
            retry_after: None,
            duration_ms: None,
        };
        e.release(a, &info, 6 * SEC, 0).unwrap();
        assert_eq!(e.next_lease_expiry(), Some(15 * SEC));
        let (expired, _) = e.expire_leases(15 * SEC, 0);
        assert!(expired.is_empty());
        assert_eq!(e.next_lease_expiry(), Some(17 * SEC));
        let (expired, _) = e.expire_leases(17 * SEC, 0);
        assert_eq!(expired.len(), 1);
        assert_eq!(e.next_lease_expiry(), None);
    }

    #[test]
    fn a_call_without_a_slot_expires_due_leases_and_queued_calls_come_first() {
        let (_clock, cfg, shared) = harness(
            "[server]\nlease_ttl = \"10s\"\n[limits.tenant]\nconcurrency = 1\n",
            0,
        );
        let mut e = TenantEngine::new(Arc::from("t"), cfg, shared, 1);
        lease(&e.admit(&call("s", "x"), 0, 0));
        // No slot: one call queues, one is refused.
        let waiting = AdmitRequest {
            max_wait_ns: 20 * SEC,
            ..call("s", "x")
        };
        let AdmitResult::Queued { waiter, .. } = e.admit(&waiting, SEC, 0) else {
            panic!("expected to queue");
        };
        let refused = e.admit(&call("s", "x"), 2 * SEC, 0);
        assert!(matches!(refused, AdmitResult::Decided(ref d) if !d.is_admitted()));
        // At the TTL, with no tick: the next call expires the lease, whose slot goes to the queued
        // call; the new call is refused, and the expiry waits to be reported.
        let late = e.admit(&call("s", "x"), 10 * SEC, 0);
        assert!(matches!(late, AdmitResult::Decided(ref d) if !d.is_admitted()));
        let granted = e.drain_decisions();
        assert_eq!(granted.len(), 1);
        assert_eq!(granted[0].0, waiter);
        assert!(granted[0].1.is_admitted());
        assert_eq!(e.take_expired().len(), 1);
        assert!(e.take_expired().is_empty());
        // The queued call now holds the slot, on a lease of its own.
        assert_eq!(e.next_lease_expiry(), Some(20 * SEC));
    }
}
