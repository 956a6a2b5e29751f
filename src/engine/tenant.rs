//! The admission engine for one tenant: every layer of DESIGN.md, as plain data driven by `now`.
//!
//! A [`TenantEngine`] owns one tenant's buckets (subject, subject×tool, tenant, tenant×upstream),
//! concurrency slots, daily quotas, upstream penalty boxes, leases and the FIFO queue of calls waiting for
//! a slot. The cross-tenant layers (global, shared upstreams) live in [`SharedBudgets`] and are taken
//! last. It never blocks, sleeps or spawns: every method takes the monotonic `now` (and the wall clock
//! where calendar days matter) and returns what happened. The tenant actor feeds it messages and timers;
//! tests feed it a fake clock.
//!
//! Order of checks for a call, each refusal giving back what earlier layers took:
//! oversized → upstream penalty → concurrency (subject, tenant; may queue) → daily quota (subject,
//! tenant) → buckets (subject, subject_tool, tenant, tenant_upstream, global).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::bucket::{Bucket, Gcra, Take};
use super::refusal::{self, RefusalContext};
use super::rng::Rng;
use super::shared::{SharedBudgets, SharedUpstream};
use super::types::*;
use crate::clock::{ceil_ms, ms_until_utc_midnight, utc_day, Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::{Config, Mode, TenantLimits};

/// Retry hint for a concurrency refusal before any lease was seen to finish.
const DEFAULT_HOLD_HINT_NS: u64 = NS_PER_SEC;

/// A call asking to be admitted.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmitRequest {
    pub subject: Arc<str>,
    pub tool: Arc<str>,
    pub upstream: Option<Arc<str>>,
    pub cost: Option<f64>,
    /// The longest the caller may be held, already capped by the server's `max_wait`.
    pub max_wait_ns: u64,
}

/// The engine's answer to an admission request.
#[derive(Debug, Clone, PartialEq)]
pub enum AdmitResult {
    Decided(Decision),
    /// No concurrency slot is free: the call waits in the tenant's queue. Its decision comes from a later
    /// `release`, `cancel_lease`, `expire` or `expire_waiters` call, by this id.
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

/// What a release did.
#[derive(Debug, Clone, PartialEq)]
pub struct Released {
    pub subject: Arc<str>,
    pub tool: Arc<str>,
    pub upstream: Option<Arc<str>>,
    /// The penalty the release started, if it reported a 429.
    pub penalty: Option<Duration>,
    /// Queued calls that got a slot because of this release.
    pub granted: Vec<(u64, Decision)>,
}

/// The lease does not exist here (never issued, released already, or expired).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownLease;

/// Tokens and quota a call took, kept until its hold is over so a caller that goes away gets them back.
#[derive(Debug, Clone, Default)]
struct Charge {
    cost: f64,
    /// Which bucket layers it took from, by `Layer` index. Refunds recompute the amount from the
    /// current rate and skip layers a reload removed, so a refund after a reload gives back exactly
    /// the tokens taken: never another layer's, never more.
    taken: [bool; 5],
    quota_day: i64,
    quota_subject: bool,
    quota_tenant: bool,
}

#[derive(Debug, Clone)]
struct Lease {
    subject: Arc<str>,
    tool: Arc<str>,
    upstream: Option<Arc<str>>,
    /// Holds one subject and one tenant concurrency slot (false for shadow-mode stand-in leases).
    slots: bool,
    charge: Option<Charge>,
    /// When the hold ends; a cancellation after that refunds nothing (the call ran).
    hold_until: Nanos,
    created: Nanos,
    expires: Nanos,
}

#[derive(Debug, Clone)]
struct Waiter {
    id: u64,
    resolved: Resolved,
    enqueued: Nanos,
    deadline: Nanos,
}

#[derive(Debug, Clone, Copy, Default)]
struct QuotaCounter {
    day: i64,
    used: f64,
}

impl QuotaCounter {
    fn used_on(&self, day: i64) -> f64 {
        if self.day == day {
            self.used
        } else {
            0.0
        }
    }
    fn add(&mut self, day: i64, cost: f64) {
        if self.day != day {
            *self = QuotaCounter { day, used: 0.0 };
        }
        self.used += cost;
    }
    fn refund(&mut self, day: i64, cost: f64) {
        if self.day == day {
            self.used = (self.used - cost).max(0.0);
        }
    }
    fn is_resting(&self, day: i64) -> bool {
        self.used_on(day) <= 0.0
    }
}

#[derive(Debug, Default)]
struct SubjectState {
    bucket: Bucket,
    /// Per-tool buckets (only tools that configure a rate); few per subject, so a vector beats a map.
    tools: Vec<(Arc<str>, Bucket)>,
    inflight: u32,
    quota: QuotaCounter,
}

impl SubjectState {
    fn tool_bucket(&mut self, tool: &Arc<str>) -> &mut Bucket {
        let i = match self.tools.iter().position(|(t, _)| t == tool) {
            Some(i) => i,
            None => {
                self.tools.push((tool.clone(), Bucket::default()));
                self.tools.len() - 1
            }
        };
        &mut self.tools[i].1
    }

    fn is_resting(&self, now: Nanos, day: i64) -> bool {
        self.inflight == 0
            && self.bucket.is_resting(now)
            && self.tools.iter().all(|(_, b)| b.is_resting(now))
            && self.quota.is_resting(day)
    }
}

#[derive(Debug, Default)]
struct UpstreamState {
    bucket: Bucket,
    penalty_until: Nanos,
}

/// One bucket layer as it applies to one call.
#[derive(Clone)]
struct LayerPlan {
    layer: Layer,
    g: Gcra,
    shared: Option<Arc<SharedUpstream>>,
}

/// The tenant's policy, resolved from one config generation.
#[derive(Debug, Clone)]
struct Policy {
    cfg: Arc<Config>,
    limits: TenantLimits,
    subject_g: Gcra,
    tenant_g: Gcra,
    global_g: Gcra,
}

impl Policy {
    fn new(cfg: Arc<Config>, tenant: &str) -> Self {
        let limits = cfg.tenant_limits(tenant);
        Policy {
            subject_g: Gcra::new(limits.subject.bucket),
            tenant_g: Gcra::new(limits.tenant.bucket),
            global_g: Gcra::new(cfg.limits.global.bucket),
            limits,
            cfg,
        }
    }
}

/// The admission state of one tenant.
pub struct TenantEngine {
    tenant: Arc<str>,
    policy: Policy,
    shared: Arc<SharedBudgets>,
    subjects: HashMap<Arc<str>, SubjectState>,
    tenant_bucket: Bucket,
    upstreams: HashMap<Arc<str>, UpstreamState>,
    inflight: u32,
    quota: QuotaCounter,
    leases: HashMap<u64, Lease>,
    expiries: BinaryHeap<Reverse<(Nanos, u64)>>,
    waiters: VecDeque<Waiter>,
    next_id: u64,
    rng: Rng,
    /// Moving average of how long leases are held, for concurrency retry hints.
    hold_avg_ns: Option<f64>,
    last_active: Nanos,
}

impl TenantEngine {
    pub fn new(tenant: Arc<str>, cfg: Arc<Config>, shared: Arc<SharedBudgets>, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let next_id = rng.next_u64() >> 12;
        TenantEngine {
            policy: Policy::new(cfg, &tenant),
            tenant,
            shared,
            subjects: HashMap::new(),
            tenant_bucket: Bucket::default(),
            upstreams: HashMap::new(),
            inflight: 0,
            quota: QuotaCounter::default(),
            leases: HashMap::new(),
            expiries: BinaryHeap::new(),
            waiters: VecDeque::new(),
            next_id,
            rng,
            hold_avg_ns: None,
            last_active: 0,
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
        let old = std::mem::replace(&mut self.policy, Policy::new(cfg, &self.tenant));
        let new = &self.policy;
        self.tenant_bucket
            .rescale(now, &old.tenant_g, &new.tenant_g);
        for s in self.subjects.values_mut() {
            s.bucket.rescale(now, &old.subject_g, &new.subject_g);
            s.tools.retain_mut(|(tool, b)| {
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
        for (name, u) in self.upstreams.iter_mut() {
            let o = old.cfg.upstreams.get(&**name).and_then(|u| u.bucket);
            let n = new.cfg.upstreams.get(&**name).and_then(|u| u.bucket);
            match (o, n) {
                (Some(o), Some(n)) => u.bucket.rescale(now, &Gcra::new(o), &Gcra::new(n)),
                _ => u.bucket = Bucket::default(),
            }
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id
    }

    /// Applies tool defaults: upstream, then cost.
    pub fn resolve(&self, req: &AdmitRequest) -> Resolved {
        let tool = self.policy.cfg.tools.get(&*req.tool);
        let upstream = req
            .upstream
            .clone()
            .or_else(|| tool.and_then(|t| t.upstream.as_deref()).map(Arc::from));
        let cost = req
            .cost
            .or_else(|| tool.and_then(|t| t.cost))
            .unwrap_or(1.0);
        Resolved {
            subject: req.subject.clone(),
            tool: req.tool.clone(),
            upstream,
            cost,
        }
    }

    fn plan(&self, r: &Resolved) -> Vec<LayerPlan> {
        let p = &self.policy;
        let mut v = Vec::with_capacity(5);
        v.push(LayerPlan {
            layer: Layer::Subject,
            g: p.subject_g,
            shared: None,
        });
        if let Some(b) = p.cfg.tools.get(&*r.tool).and_then(|t| t.bucket) {
            v.push(LayerPlan {
                layer: Layer::SubjectTool,
                g: Gcra::new(b),
                shared: None,
            });
        }
        v.push(LayerPlan {
            layer: Layer::Tenant,
            g: p.tenant_g,
            shared: None,
        });
        if let Some(up) = &r.upstream {
            if let Some(u) = p.cfg.upstreams.get(&**up) {
                if let Some(b) = u.bucket {
                    let shared = if u.shared {
                        self.shared.upstream(up)
                    } else {
                        None
                    };
                    v.push(LayerPlan {
                        layer: Layer::TenantUpstream,
                        g: Gcra::new(b),
                        shared,
                    });
                }
            }
        }
        v.push(LayerPlan {
            layer: Layer::Global,
            g: p.global_g,
            shared: None,
        });
        v
    }

    fn is_shared_upstream(&self, upstream: Option<&str>) -> bool {
        upstream
            .and_then(|u| self.policy.cfg.upstreams.get(u))
            .is_some_and(|u| u.shared)
    }

    // ---- per-layer bucket access ----

    fn take_layer(
        &mut self,
        lp: &LayerPlan,
        r: &Resolved,
        now: Nanos,
        inc: u64,
        max_wait: u64,
    ) -> Take {
        match lp.layer {
            Layer::Subject => self
                .subject_mut(&r.subject)
                .bucket
                .take(&lp.g, now, inc, max_wait),
            Layer::SubjectTool => self
                .subject_mut(&r.subject)
                .tool_bucket(&r.tool)
                .take(&lp.g, now, inc, max_wait),
            Layer::Tenant => self.tenant_bucket.take(&lp.g, now, inc, max_wait),
            Layer::TenantUpstream => match &lp.shared {
                Some(s) => s.bucket.take(&lp.g, now, inc, max_wait),
                None => self.upstream_mut(r).bucket.take(&lp.g, now, inc, max_wait),
            },
            Layer::Global => self.shared.global.take(&lp.g, now, inc, max_wait),
        }
    }

    fn refund_layer(&mut self, lp: &LayerPlan, r: &Resolved, inc: u64) {
        match lp.layer {
            Layer::Subject => self.subject_mut(&r.subject).bucket.refund(inc),
            Layer::SubjectTool => self
                .subject_mut(&r.subject)
                .tool_bucket(&r.tool)
                .refund(inc),
            Layer::Tenant => self.tenant_bucket.refund(inc),
            Layer::TenantUpstream => match &lp.shared {
                Some(s) => s.bucket.refund(inc),
                None => self.upstream_mut(r).bucket.refund(inc),
            },
            Layer::Global => self.shared.global.refund(inc),
        }
    }

    fn promise_layer(&mut self, lp: &LayerPlan, r: &Resolved, now: Nanos, inc: u64) -> u64 {
        match lp.layer {
            Layer::Subject => self.subject_mut(&r.subject).bucket.promise(&lp.g, now, inc),
            Layer::SubjectTool => self
                .subject_mut(&r.subject)
                .tool_bucket(&r.tool)
                .promise(&lp.g, now, inc),
            Layer::Tenant => self.tenant_bucket.promise(&lp.g, now, inc),
            Layer::TenantUpstream => match &lp.shared {
                Some(s) => s.bucket.promise(&lp.g, now, inc),
                None => self.upstream_mut(r).bucket.promise(&lp.g, now, inc),
            },
            Layer::Global => self.shared.global.promise(&lp.g, now, inc),
        }
    }

    /// (remaining whole tokens, ns until full, shortfall of `inc`) without changing anything.
    fn peek_layer(&self, lp: &LayerPlan, r: &Resolved, now: Nanos, inc: u64) -> (u64, u64, u64) {
        let local = |b: Option<&Bucket>| {
            let b = b.copied().unwrap_or_default();
            (
                b.remaining(&lp.g, now),
                b.reset_ns(now),
                b.peek(&lp.g, now, inc),
            )
        };
        match lp.layer {
            Layer::Subject => local(self.subjects.get(&r.subject).map(|s| &s.bucket)),
            Layer::SubjectTool => local(
                self.subjects
                    .get(&r.subject)
                    .and_then(|s| s.tools.iter().find(|(t, _)| *t == r.tool).map(|(_, b)| b)),
            ),
            Layer::Tenant => local(Some(&self.tenant_bucket)),
            Layer::TenantUpstream => match &lp.shared {
                Some(s) => (
                    s.bucket.remaining(&lp.g, now),
                    s.bucket.reset_ns(now),
                    s.bucket.peek(&lp.g, now, inc),
                ),
                None => local(
                    r.upstream
                        .as_ref()
                        .and_then(|u| self.upstreams.get(u))
                        .map(|u| &u.bucket),
                ),
            },
            Layer::Global => {
                let b = &self.shared.global;
                (
                    b.remaining(&lp.g, now),
                    b.reset_ns(now),
                    b.peek(&lp.g, now, inc),
                )
            }
        }
    }

    fn layer_states(&self, plan: &[LayerPlan], r: &Resolved, now: Nanos) -> Vec<LayerState> {
        plan.iter()
            .map(|lp| {
                let (remaining, reset_ns, _) = self.peek_layer(lp, r, now, 0);
                LayerState {
                    layer: lp.layer,
                    burst: lp.g.burst,
                    window_secs: lp.g.window_secs(),
                    remaining,
                    reset_ns,
                }
            })
            .collect()
    }

    fn subject_mut(&mut self, subject: &Arc<str>) -> &mut SubjectState {
        // `entry` would need an owned key on every lookup; most lookups hit.
        if !self.subjects.contains_key(subject) {
            self.subjects
                .insert(subject.clone(), SubjectState::default());
        }
        self.subjects.get_mut(subject).expect("inserted above")
    }

    fn upstream_mut(&mut self, r: &Resolved) -> &mut UpstreamState {
        let name = r.upstream.clone().unwrap_or_else(|| Arc::from(""));
        self.upstreams.entry(name).or_default()
    }

    // ---- admission ----

    /// Decides a call, or queues it for a concurrency slot.
    pub fn admit(&mut self, req: &AdmitRequest, now: Nanos, wall_ms: i64) -> AdmitResult {
        self.last_active = now;
        let r = self.resolve(req);
        let plan = self.plan(&r);

        if let Some(shed) = self.oversized(&r, &plan) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if let Some(shed) = self.penalty(&r, now) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if self.slots_free(&r.subject) {
            self.take_slots(&r.subject);
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
        let shed = self.concurrency_shed(&r);
        AdmitResult::Decided(self.refuse(r, &plan, shed, now))
    }

    fn oversized(&self, r: &Resolved, plan: &[LayerPlan]) -> Option<Shed> {
        let limits = &self.policy.limits;
        let mut limit = plan
            .iter()
            .find(|lp| lp.g.oversized(r.cost))
            .map(|lp| lp.g.burst);
        for q in [limits.subject.daily_quota, limits.tenant.daily_quota]
            .into_iter()
            .flatten()
        {
            if r.cost > q && limit.is_none() {
                limit = Some(q);
            }
        }
        let limit = limit?;
        let cx = self.refusal_cx(r, limit);
        Some(Shed {
            scope: Scope::Oversized,
            retry_after_ms: 0,
            retryable: false,
            reason: refusal::reason(Scope::Oversized).to_string(),
            message: refusal::message(Scope::Oversized, 0, &cx),
        })
    }

    fn refusal_cx<'a>(&self, r: &'a Resolved, limit: f64) -> RefusalContext<'a> {
        RefusalContext {
            tool: &r.tool,
            upstream: r.upstream.as_deref(),
            shared_upstream: self.is_shared_upstream(r.upstream.as_deref()),
            cost: r.cost,
            limit,
        }
    }

    fn make_shed(&mut self, r: &Resolved, scope: Scope, wait_ns: u64) -> Shed {
        // A little jitter (up to 5% of the wait, at most 100 ms) keeps callers told the same moment from
        // arriving in the same millisecond; it only ever adds, so nobody is told to come back early.
        // A daily quota resets at one fixed instant for everyone: no jitter there.
        let jitter = if scope == Scope::DailyQuota {
            0
        } else {
            self.rng.below_or_eq((wait_ns / 20).min(100 * NS_PER_MS))
        };
        let retry_after_ms = ceil_ms(wait_ns.saturating_add(jitter)).max(1);
        let cx = self.refusal_cx(r, 0.0);
        Shed {
            scope,
            retry_after_ms,
            retryable: true,
            reason: refusal::reason(scope).to_string(),
            message: refusal::message(scope, retry_after_ms, &cx),
        }
    }

    fn penalty(&mut self, r: &Resolved, now: Nanos) -> Option<Shed> {
        let up = r.upstream.as_ref()?;
        let until = match self.shared.upstream(up) {
            Some(s) if self.is_shared_upstream(Some(up)) => s.penalty_until(),
            _ => self.upstreams.get(up).map_or(0, |u| u.penalty_until),
        };
        (until > now).then(|| self.make_shed(r, Scope::UpstreamPenalty, until - now))
    }

    fn slots_free(&self, subject: &Arc<str>) -> bool {
        let l = &self.policy.limits;
        let subj = self.subjects.get(subject).map_or(0, |s| s.inflight);
        l.subject.concurrency.is_none_or(|c| subj < c)
            && l.tenant.concurrency.is_none_or(|c| self.inflight < c)
    }

    fn tenant_slot_free(&self) -> bool {
        self.policy
            .limits
            .tenant
            .concurrency
            .is_none_or(|c| self.inflight < c)
    }

    fn take_slots(&mut self, subject: &Arc<str>) {
        self.subject_mut(subject).inflight += 1;
        self.inflight += 1;
    }

    fn free_slots(&mut self, subject: &Arc<str>) {
        if let Some(s) = self.subjects.get_mut(subject) {
            s.inflight = s.inflight.saturating_sub(1);
        }
        self.inflight = self.inflight.saturating_sub(1);
    }

    fn concurrency_shed(&mut self, r: &Resolved) -> Shed {
        let hint = self
            .hold_avg_ns
            .map_or(DEFAULT_HOLD_HINT_NS, |h| h as u64)
            .clamp(100 * NS_PER_MS, 60 * NS_PER_SEC);
        self.make_shed(r, Scope::Concurrency, hint)
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
        let limits = self.policy.limits.clone();
        let subj_used = self
            .subjects
            .get(&r.subject)
            .map_or(0.0, |s| s.quota.used_on(day));
        let over_subject = limits
            .subject
            .daily_quota
            .is_some_and(|q| subj_used + r.cost > q + 1e-9);
        let over_tenant = limits
            .tenant
            .daily_quota
            .is_some_and(|q| self.quota.used_on(day) + r.cost > q + 1e-9);
        if over_subject || over_tenant {
            self.free_slots(&r.subject);
            let wait = ms_until_utc_midnight(wall_ms) * NS_PER_MS;
            let shed = self.make_shed(&r, Scope::DailyQuota, wait);
            return self.refuse(r, plan, shed, now);
        }
        let mut charge = Charge {
            cost: r.cost,
            quota_day: day,
            ..Charge::default()
        };
        if limits.subject.daily_quota.is_some() {
            self.subject_mut(&r.subject).quota.add(day, r.cost);
            charge.quota_subject = true;
        }
        if limits.tenant.daily_quota.is_some() {
            self.quota.add(day, r.cost);
            charge.quota_tenant = true;
        }

        let mut hold = 0u64;
        for (i, lp) in plan.iter().enumerate() {
            let inc = lp.g.increment(r.cost);
            match self.take_layer(lp, &r, now, inc, max_wait) {
                Take::Ok { wait } => {
                    charge.taken[lp.layer as usize] = true;
                    hold = hold.max(wait);
                }
                Take::Short { .. } => {
                    // Give back everything, then promise this caller a slot behind earlier refusals.
                    self.undo_charge(&r, plan, &charge);
                    self.free_slots(&r.subject);
                    let mut wait = self.promise_layer(lp, &r, now, inc);
                    for later in &plan[i + 1..] {
                        wait =
                            wait.max(self.peek_layer(later, &r, now, later.g.increment(r.cost)).2);
                    }
                    let shed = self.make_shed(&r, lp.layer.scope(), wait);
                    return self.refuse(r, plan, shed, now);
                }
            }
        }

        let lease = self.next_id();
        let expires = now
            .saturating_add(hold)
            .saturating_add(self.policy.cfg.server.lease_ttl.as_nanos() as u64);
        self.leases.insert(
            lease,
            Lease {
                subject: r.subject.clone(),
                tool: r.tool.clone(),
                upstream: r.upstream.clone(),
                slots: true,
                charge: (hold > 0).then_some(charge),
                hold_until: now.saturating_add(hold),
                created: now,
                expires,
            },
        );
        self.expiries.push(Reverse((expires, lease)));
        let layers = self.layer_states(plan, &r, now);
        Decision {
            verdict: Verdict::Admitted(Admitted {
                lease,
                hold_ns: hold,
                queued_ns,
                mode: self.policy.cfg.server.mode,
                would_shed: None,
            }),
            resolved: r,
            layers,
        }
    }

    fn undo_charge(&mut self, r: &Resolved, plan: &[LayerPlan], charge: &Charge) {
        for lp in plan {
            if charge.taken[lp.layer as usize] {
                self.refund_layer(lp, r, lp.g.increment(charge.cost));
            }
        }
        if charge.quota_subject {
            self.subject_mut(&r.subject)
                .quota
                .refund(charge.quota_day, charge.cost);
        }
        if charge.quota_tenant {
            self.quota.refund(charge.quota_day, charge.cost);
        }
    }

    /// Turns a refusal into the decision: a shed in enforce mode; in shadow mode an admission that spends
    /// nothing and carries the refusal enforce mode would have given.
    fn refuse(&mut self, r: Resolved, plan: &[LayerPlan], shed: Shed, now: Nanos) -> Decision {
        let layers = self.layer_states(plan, &r, now);
        let verdict = match self.policy.cfg.server.mode {
            Mode::Enforce => Verdict::Shed(shed),
            Mode::Shadow => {
                let lease = self.next_id();
                let expires =
                    now.saturating_add(self.policy.cfg.server.lease_ttl.as_nanos() as u64);
                self.leases.insert(
                    lease,
                    Lease {
                        subject: r.subject.clone(),
                        tool: r.tool.clone(),
                        upstream: r.upstream.clone(),
                        slots: false,
                        charge: None,
                        hold_until: now,
                        created: now,
                        expires,
                    },
                );
                self.expiries.push(Reverse((expires, lease)));
                Verdict::Admitted(Admitted {
                    lease,
                    hold_ns: 0,
                    queued_ns: 0,
                    mode: Mode::Shadow,
                    would_shed: Some(shed),
                })
            }
        };
        Decision {
            verdict,
            resolved: r,
            layers,
        }
    }

    // ---- after admission ----

    /// Ends a lease: frees its slot, records how long it was held and starts a penalty on a 429.
    pub fn release(
        &mut self,
        lease: u64,
        info: &ReleaseInfo,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Released, UnknownLease> {
        self.last_active = now;
        let l = self.leases.remove(&lease).ok_or(UnknownLease)?;
        if l.slots {
            self.free_slots(&l.subject);
            let held = now.saturating_sub(l.created) as f64;
            self.hold_avg_ns = Some(match self.hold_avg_ns {
                Some(avg) => avg * 0.8 + held * 0.2,
                None => held,
            });
        }
        let rate_limited =
            info.outcome == Outcome::UpstreamRateLimited || info.upstream_status == Some(429);
        let penalty = match (&l.upstream, rate_limited) {
            (Some(up), true) => {
                let d = info.retry_after.unwrap_or(Duration::from_secs(1));
                self.penalise(up, d, now);
                Some(d)
            }
            _ => None,
        };
        let granted = self.grant_waiting(now, wall_ms);
        Ok(Released {
            subject: l.subject,
            tool: l.tool,
            upstream: l.upstream,
            penalty,
            granted,
        })
    }

    /// Gives back everything a held call took, because its caller went away before the hold ended.
    /// Returns the decisions of queued calls that got the freed slot.
    pub fn cancel_lease(
        &mut self,
        lease: u64,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Vec<(u64, Decision)>, UnknownLease> {
        let l = self.leases.remove(&lease).ok_or(UnknownLease)?;
        if let Some(charge) = l.charge.as_ref().filter(|_| now < l.hold_until) {
            let r = Resolved {
                subject: l.subject.clone(),
                tool: l.tool.clone(),
                upstream: l.upstream.clone(),
                cost: charge.cost,
            };
            let plan = self.plan(&r);
            self.undo_charge(&r, &plan, charge);
        }
        if l.slots {
            self.free_slots(&l.subject);
        }
        Ok(self.grant_waiting(now, wall_ms))
    }

    /// Removes a queued call whose caller went away. Returns false when it was not queued (any more).
    pub fn cancel_waiter(&mut self, waiter: u64) -> bool {
        match self.waiters.iter().position(|w| w.id == waiter) {
            Some(i) => {
                self.waiters.remove(i);
                true
            }
            None => false,
        }
    }

    /// An upstream answer seen outside a lease. Returns the penalty started, if any.
    pub fn feedback(
        &mut self,
        upstream: &Arc<str>,
        status: u16,
        retry_after: Option<Duration>,
        now: Nanos,
    ) -> Option<Duration> {
        self.last_active = now;
        if status == 429 {
            let d = retry_after.unwrap_or(Duration::from_secs(1));
            self.penalise(upstream, d, now);
            Some(d)
        } else {
            None
        }
    }

    fn penalise(&mut self, upstream: &Arc<str>, d: Duration, now: Nanos) {
        let until = now.saturating_add(d.as_nanos() as u64);
        if self.is_shared_upstream(Some(upstream)) {
            if let Some(s) = self.shared.upstream(upstream) {
                s.penalise(until);
                return;
            }
        }
        let u = self.upstreams.entry(upstream.clone()).or_default();
        u.penalty_until = u.penalty_until.max(until);
    }

    /// Hands free slots to queued calls, oldest first, deciding each; drops the ones past their deadline.
    /// Called after every release, and by the actor after a reload that may have raised a limit.
    pub fn grant_waiting(&mut self, now: Nanos, wall_ms: i64) -> Vec<(u64, Decision)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.waiters.len() && self.tenant_slot_free() {
            if self.waiters[i].deadline <= now {
                if let Some(w) = self.waiters.remove(i) {
                    let d = self.waiter_timed_out(w.resolved, now);
                    out.push((w.id, d));
                }
                continue;
            }
            if !self.slots_free(&self.waiters[i].resolved.subject) {
                i += 1;
                continue;
            }
            let Some(w) = self.waiters.remove(i) else {
                break;
            };
            // The release that freed this slot may have started a penalty on the waiter's upstream.
            if let Some(shed) = self.penalty(&w.resolved, now) {
                let plan = self.plan(&w.resolved);
                let d = self.refuse(w.resolved, &plan, shed, now);
                out.push((w.id, d));
                continue;
            }
            self.take_slots(&w.resolved.subject);
            let plan = self.plan(&w.resolved);
            let d = self.after_slots(
                w.resolved,
                &plan,
                now,
                wall_ms,
                w.deadline - now,
                now - w.enqueued,
            );
            out.push((w.id, d));
        }
        out
    }

    fn waiter_timed_out(&mut self, r: Resolved, now: Nanos) -> Decision {
        let plan = self.plan(&r);
        let shed = self.concurrency_shed(&r);
        self.refuse(r, &plan, shed, now)
    }

    /// Refuses every queued call whose deadline has passed.
    pub fn expire_waiters(&mut self, now: Nanos) -> Vec<(u64, Decision)> {
        let mut out = Vec::new();
        while let Some(i) = self.waiters.iter().position(|w| w.deadline <= now) {
            if let Some(w) = self.waiters.remove(i) {
                let d = self.waiter_timed_out(w.resolved, now);
                out.push((w.id, d));
            }
        }
        out
    }

    /// The earliest deadline among queued calls.
    pub fn next_waiter_deadline(&self) -> Option<Nanos> {
        self.waiters.iter().map(|w| w.deadline).min()
    }

    /// Expires leases past their TTL, freeing their slots. Returns the expired leases' (subject, tool,
    /// upstream) and the decisions of queued calls that got a slot.
    #[allow(clippy::type_complexity)]
    pub fn expire_leases(
        &mut self,
        now: Nanos,
        wall_ms: i64,
    ) -> (
        Vec<(Arc<str>, Arc<str>, Option<Arc<str>>)>,
        Vec<(u64, Decision)>,
    ) {
        let mut expired = Vec::new();
        while let Some(Reverse((at, id))) = self.expiries.peek().copied() {
            if at > now {
                break;
            }
            self.expiries.pop();
            if self.leases.get(&id).is_some_and(|l| l.expires == at) {
                if let Some(l) = self.leases.remove(&id) {
                    if l.slots {
                        self.free_slots(&l.subject);
                        expired.push((l.subject, l.tool, l.upstream));
                    }
                }
            }
        }
        // Leases released early leave stale heap entries behind; rebuild when they dominate.
        if self.expiries.len() > 64 && self.expiries.len() > 4 * self.leases.len() {
            self.expiries = self
                .leases
                .iter()
                .map(|(id, l)| Reverse((l.expires, *id)))
                .collect();
        }
        let granted = if expired.is_empty() {
            Vec::new()
        } else {
            self.grant_waiting(now, wall_ms)
        };
        (expired, granted)
    }

    /// Drops per-subject and per-upstream state that is back at its resting value.
    pub fn prune(&mut self, now: Nanos, wall_ms: i64) {
        let day = utc_day(wall_ms);
        self.subjects.retain(|_, s| !s.is_resting(now, day));
        self.upstreams
            .retain(|_, u| !(u.bucket.is_resting(now) && u.penalty_until <= now));
        if self.quota.is_resting(day) {
            self.quota = QuotaCounter::default();
        }
    }

    /// True when nothing would be lost by dropping this engine.
    pub fn is_at_rest(&self, now: Nanos, wall_ms: i64) -> bool {
        let day = utc_day(wall_ms);
        self.leases.is_empty()
            && self.waiters.is_empty()
            && self.inflight == 0
            && self.tenant_bucket.is_resting(now)
            && self.quota.is_resting(day)
            && self.subjects.values().all(|s| s.is_resting(now, day))
            && self
                .upstreams
                .values()
                .all(|u| u.bucket.is_resting(now) && u.penalty_until <= now)
    }

    pub fn last_active(&self) -> Nanos {
        self.last_active
    }

    pub fn inflight(&self) -> u32 {
        self.inflight
    }

    pub fn subject_count(&self) -> usize {
        self.subjects.len()
    }

    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// A JSON-ready picture of the tenant's state.
    pub fn snapshot(&self, now: Nanos, wall_ms: i64) -> TenantSnapshot {
        let p = &self.policy;
        let day = utc_day(wall_ms);
        let bucket = |layer: Layer, key: String, g: &Gcra, b: &Bucket| BucketSnapshot {
            layer: layer.as_str(),
            key,
            tokens: b.remaining(g, now),
            burst: g.burst,
            rate_per_sec: NS_PER_SEC as f64 / g.t,
            reset_ms: ceil_ms(b.reset_ns(now)),
        };
        let mut buckets = vec![bucket(
            Layer::Tenant,
            self.tenant.to_string(),
            &p.tenant_g,
            &self.tenant_bucket,
        )];
        let mut subjects: Vec<_> = self.subjects.iter().collect();
        subjects.sort_by(|a, b| a.0.cmp(b.0));
        let mut subject_snaps = Vec::new();
        for (name, s) in &subjects {
            buckets.push(bucket(
                Layer::Subject,
                name.to_string(),
                &p.subject_g,
                &s.bucket,
            ));
            for (tool, b) in &s.tools {
                if let Some(spec) = p.cfg.tools.get(&**tool).and_then(|t| t.bucket) {
                    buckets.push(bucket(
                        Layer::SubjectTool,
                        format!("{name}/{tool}"),
                        &Gcra::new(spec),
                        b,
                    ));
                }
            }
            subject_snaps.push(SubjectSnapshot {
                subject: name.to_string(),
                inflight: s.inflight,
                quota_used: s.quota.used_on(day),
            });
        }
        let mut penalties = Vec::new();
        let mut ups: Vec<_> = self.upstreams.iter().collect();
        ups.sort_by(|a, b| a.0.cmp(b.0));
        for (name, u) in ups {
            if let Some(spec) = p.cfg.upstreams.get(&**name).and_then(|x| x.bucket) {
                if !self.is_shared_upstream(Some(name)) {
                    buckets.push(bucket(
                        Layer::TenantUpstream,
                        name.to_string(),
                        &Gcra::new(spec),
                        &u.bucket,
                    ));
                }
            }
            if u.penalty_until > now {
                penalties.push(PenaltySnapshot {
                    upstream: name.to_string(),
                    shared: false,
                    retry_after_ms: ceil_ms(u.penalty_until - now),
                });
            }
        }
        for (name, s) in self.shared.upstream_names() {
            if s.penalty_until() > now {
                penalties.push(PenaltySnapshot {
                    upstream: name.to_string(),
                    shared: true,
                    retry_after_ms: ceil_ms(s.penalty_until() - now),
                });
            }
        }
        TenantSnapshot {
            tenant: self.tenant.to_string(),
            plan: p
                .cfg
                .tenants
                .get(&*self.tenant)
                .and_then(|t| t.plan.clone()),
            mode: p.cfg.server.mode.as_str(),
            inflight: self.inflight,
            waiting: self.waiters.len(),
            leases: self.leases.len(),
            quota: QuotaSnapshot {
                day_used: self.quota.used_on(day),
                daily_quota: p.limits.tenant.daily_quota,
                subject_daily_quota: p.limits.subject.daily_quota,
                resets_in_ms: ms_until_utc_midnight(wall_ms),
            },
            buckets,
            subjects: subject_snaps,
            penalties,
        }
    }

    /// Gauges for telemetry: in-flight calls, how full each bucket layer is, penalties and quota.
    pub fn gauges(&self, now: Nanos, wall_ms: i64) -> TenantGauges {
        let p = &self.policy;
        let used = |g: &Gcra, b: &Bucket| {
            let missing = b.reset_ns(now) as f64 / g.t;
            (missing / g.burst).clamp(0.0, 1.0)
        };
        let subject = self
            .subjects
            .values()
            .map(|s| used(&p.subject_g, &s.bucket))
            .fold(0.0, f64::max);
        let mut upstream = 0.0f64;
        let mut penalties = Vec::new();
        for (name, u) in &self.upstreams {
            if let Some(spec) = p
                .cfg
                .upstreams
                .get(&**name)
                .filter(|c| !c.shared)
                .and_then(|c| c.bucket)
            {
                upstream = upstream.max(used(&Gcra::new(spec), &u.bucket));
            }
            if u.penalty_until > now {
                penalties.push((
                    name.clone(),
                    (u.penalty_until - now) as f64 / NS_PER_SEC as f64,
                ));
            }
        }
        let day = utc_day(wall_ms);
        TenantGauges {
            inflight: self.inflight,
            waiting: self.waiters.len(),
            tenant_utilization: used(&p.tenant_g, &self.tenant_bucket),
            subject_utilization: subject,
            upstream_utilization: upstream,
            penalties,
            quota_used: p.limits.tenant.daily_quota.map(|_| self.quota.used_on(day)),
            quota_limit: p.limits.tenant.daily_quota,
        }
    }

    pub fn has_state(&self, now: Nanos, wall_ms: i64) -> bool {
        !self.is_at_rest(now, wall_ms) || !self.subjects.is_empty()
    }
}

/// Per-tenant gauge values, sampled by the tenant actor.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TenantGauges {
    pub inflight: u32,
    pub waiting: usize,
    /// Tokens used / burst of the tenant bucket.
    pub tenant_utilization: f64,
    /// The most-used subject bucket of the tenant.
    pub subject_utilization: f64,
    /// The most-used per-tenant upstream bucket.
    pub upstream_utilization: f64,
    /// Seconds of penalty left per upstream (per-tenant penalties only).
    pub penalties: Vec<(Arc<str>, f64)>,
    pub quota_used: Option<f64>,
    pub quota_limit: Option<f64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BucketSnapshot {
    pub layer: &'static str,
    pub key: String,
    /// Whole tokens left now.
    pub tokens: u64,
    pub burst: f64,
    pub rate_per_sec: f64,
    pub reset_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SubjectSnapshot {
    pub subject: String,
    pub inflight: u32,
    pub quota_used: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PenaltySnapshot {
    pub upstream: String,
    pub shared: bool,
    pub retry_after_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct QuotaSnapshot {
    /// Cost units the tenant spent today (UTC), when a tenant daily quota is set.
    pub day_used: f64,
    pub daily_quota: Option<f64>,
    pub subject_daily_quota: Option<f64>,
    pub resets_in_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantSnapshot {
    pub tenant: String,
    pub plan: Option<String>,
    pub mode: &'static str,
    pub inflight: u32,
    pub waiting: usize,
    pub leases: usize,
    pub quota: QuotaSnapshot,
    pub buckets: Vec<BucketSnapshot>,
    pub subjects: Vec<SubjectSnapshot>,
    pub penalties: Vec<PenaltySnapshot>,
}
