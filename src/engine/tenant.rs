//! The admission engine for one tenant: every layer of DESIGN.md, as plain data driven by `now`.
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
//! quota (subject, tenant) → buckets (subject, subject_tool, tenant, tenant_upstream for every upstream
//! the call spends, global).
//!
//! Upstreams are more than a bucket: a 429 reported on release or feedback starts a penalty (until the
//! upstream's Retry-After), cuts that budget's effective rate (AIMD, see [`super::adaptive`]) and feeds the
//! adaptive throttle; successes recover it. A tool may spend several upstreams at once (amplification),
//! charged all or nothing.

use std::collections::VecDeque;
use std::hash::BuildHasher;

/// The engine's maps are keyed by caller-supplied names and lease numbers and looked up several times
/// per decision: a fast seeded hasher (foldhash) instead of SipHash. The seed is random per map, so
/// keys cannot be chosen to collide.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::Arc;
use std::time::Duration;

use compact_str::CompactString;
use serde::Serialize;
use smallvec::SmallVec;

use super::adaptive::{aimd_cut, aimd_recover, SreWindow};
use super::bucket::{stagger, stagger_atomic, AtomicBucket, Bucket, Gcra, Take, PROMISE_HORIZON};
use super::leases::{Expiries, Leases};
use super::refusal::{self, RefusalContext};
use super::rng::Rng;
use super::shared::{SharedBudgets, SharedUpstream};
use super::types::*;
use crate::clock::{ceil_ms, ms_until_utc_midnight, utc_day, Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::{BucketSpec, Config, Mode, TenantLimits, UpstreamConfig};
use crate::telemetry::labels::SubjectLabels;

/// How long a tenant counts its calls to a shared upstream before reporting its demand. A second is
/// long enough that a few calls bunched after a hold do not read as a loop.
const DEMAND_WINDOW: Nanos = NS_PER_SEC;

/// Retry hint for a concurrency refusal before any lease was seen to finish.
const DEFAULT_HOLD_HINT_NS: u64 = NS_PER_SEC;

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
}

/// The engine's answer to an admission request.
#[derive(Debug, Clone, PartialEq)]
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

/// Tokens and quota a call took, kept until its hold is over so a caller that goes away gets them back.
#[derive(Debug, Clone, Default)]
struct Charge {
    cost: f64,
    /// The bucket layers it took from (with the upstream, for upstream layers). Refunds recompute the
    /// amount from the current rate and skip layers a reload removed, so a refund after a reload gives
    /// back exactly the tokens taken: never another layer's, never more.
    /// Inline: a call takes from a handful of layers, and this is built on every admission.
    taken: SmallVec<[(Layer, Option<Arc<str>>); 5]>,
    quota_day: i64,
    quota_subject: bool,
    quota_tenant: bool,
    /// When the call's hold ends; a cancellation after that refunds nothing (the call ran).
    hold_until: Nanos,
}

/// A live lease. Kept small: in a slab per tenant, one per call in flight, and when calls are not
/// released (a crashed MCP server), one more per admission until they expire, so every byte of it
/// is written and later read once per call, most often out of cache.
#[derive(Debug, Clone)]
struct Lease {
    /// The call, without its primary upstream (derived again from `upstreams` when needed).
    subject: Arc<str>,
    tool: Arc<str>,
    upstreams: Box<[(Arc<str>, f64)]>,
    cost: f64,
    /// Holds one subject and one tenant concurrency slot (false for shadow-mode stand-in leases).
    slots: bool,
    /// The subject's metric label is `__other__` (past the label caps), not its name. A label is one
    /// of the two, so a flag stands for it, and a lease with its slot's number fits in 96 bytes (see
    /// the `lease_size` test).
    label_folded: bool,
    /// Boxed: only held calls keep their charge, and it would double the size of every lease.
    charge: Option<Box<Charge>>,
    created: Nanos,
    expires: Nanos,
}

impl Lease {
    fn new(
        r: &Resolved,
        slots: bool,
        charge: Option<Box<Charge>>,
        now: Nanos,
        expires: Nanos,
    ) -> Self {
        Lease {
            subject: r.subject.clone(),
            tool: r.tool.clone(),
            upstreams: r.upstreams.as_slice().into(),
            cost: r.cost,
            slots,
            label_folded: r.label_folded(),
            charge,
            created: now,
            expires,
        }
    }

    /// The subject's metric label when the call was admitted; `labels` are the engine's.
    fn subject_label(&self, labels: Option<&SubjectLabels>) -> Arc<str> {
        match (self.label_folded, labels) {
            (true, Some(l)) => l.other().clone(),
            _ => self.subject.clone(),
        }
    }

    /// The call as it was resolved when admitted; `labels` are the engine's.
    fn resolved(&self, labels: Option<&SubjectLabels>) -> Resolved {
        let upstreams = self.upstreams.to_vec();
        Resolved {
            subject: self.subject.clone(),
            subject_label: self.subject_label(labels),
            tool: self.tool.clone(),
            upstream: primary_upstream(&upstreams),
            upstreams,
            cost: self.cost,
        }
    }
}

/// The upstream a call spends most of (the first of those it spends most of): it names the call in
/// metrics and texts.
fn primary_upstream(upstreams: &[(Arc<str>, f64)]) -> Option<Arc<str>> {
    upstreams
        .iter()
        .fold(None::<&(Arc<str>, f64)>, |best, u| match best {
            Some(b) if b.1 >= u.1 => Some(b),
            _ => Some(u),
        })
        .map(|u| u.0.clone())
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

/// What a subject's state keeps besides its bucket and slot count, needed only with per-tool
/// buckets, a daily quota or concurrency refusals: boxed, so the state every call reads fits in one
/// cache line.
#[derive(Debug, Default)]
struct SubjectExtra {
    /// Per-tool buckets (only tools that configure a rate); few per subject, so a vector beats a map.
    tools: Vec<(Arc<str>, Bucket)>,
    quota: QuotaCounter,
    /// The last retry slot handed to a call refused for want of this subject's concurrency slots.
    slot_stagger: Nanos,
}

/// One subject's state: one cache line (see the `subject_state` tests), found by its name.
#[derive(Debug)]
#[repr(align(64))]
struct SubjectState {
    /// The subject's name, shared with its calls (see [`TenantEngine::subject_names`]); also the
    /// key it is found by.
    name: Arc<str>,
    bucket: Bucket,
    inflight: u32,
    /// Kept until then (whole seconds of the monotonic clock) even once at rest: set to
    /// [`KEEP_SUBJECT_SECS`] after the subject's last call gave back its slot.
    keep_until_s: u32,
    /// The label caps' generation its metric label was decided under.
    label_gen: u64,
    /// Its metric label is `__other__` (past the label caps), not its name. A label is one of the
    /// two, so a flag stands for it, as in a lease.
    label_folded: bool,
    extra: Option<Box<SubjectExtra>>,
}

/// How long a subject's state outlives its last call once it is at rest. Without it, a subject that
/// calls every few seconds (an agent's loop, or any steady caller among many) had its state dropped
/// at every prune and built again at its next call: a new name copy, a label decided under the
/// labels' shared lock, a map insertion and later a removal, for state that was needed again
/// moments later. Memory still follows the subjects active in the last few seconds.
const KEEP_SUBJECT_SECS: u32 = 10;

fn whole_secs(t: Nanos) -> u32 {
    u32::try_from(t / 1_000_000_000).unwrap_or(u32::MAX)
}

impl SubjectState {
    fn new(name: Arc<str>, label_folded: bool, label_gen: u64) -> Self {
        SubjectState {
            name,
            bucket: Bucket::default(),
            inflight: 0,
            keep_until_s: 0,
            label_gen,
            label_folded,
            extra: None,
        }
    }

    /// Its metric label; `labels` are the engine's.
    fn label(&self, labels: Option<&SubjectLabels>) -> Arc<str> {
        match (self.label_folded, labels) {
            (true, Some(l)) => l.other().clone(),
            _ => self.name.clone(),
        }
    }

    fn extra_mut(&mut self) -> &mut SubjectExtra {
        self.extra.get_or_insert_with(Box::default)
    }

    fn tools(&self) -> &[(Arc<str>, Bucket)] {
        self.extra.as_ref().map_or(&[], |e| &e.tools)
    }

    fn quota_used_on(&self, day: i64) -> f64 {
        self.extra.as_ref().map_or(0.0, |e| e.quota.used_on(day))
    }

    fn tool_bucket(&mut self, tool: &Arc<str>) -> &mut Bucket {
        let tools = &mut self.extra_mut().tools;
        let i = match tools.iter().position(|(t, _)| t == tool) {
            Some(i) => i,
            None => {
                tools.push((tool.clone(), Bucket::default()));
                tools.len() - 1
            }
        };
        &mut tools[i].1
    }

    fn is_resting(&self, now: Nanos, day: i64) -> bool {
        self.inflight == 0
            && self.bucket.is_resting(now)
            && self.extra.as_ref().is_none_or(|e| {
                e.tools.iter().all(|(_, b)| b.is_resting(now)) && e.quota.is_resting(day)
            })
    }
}

/// A tenant's subjects' states, found by name. A state holds its name, so finding a subject reads
/// the table's control bytes, the state's one line and the name's allocation, which the call shares
/// anyway. (With a separate copy of the name as the key, an entry took 144 bytes over three lines.)
#[derive(Default)]
struct Subjects {
    table: hashbrown::HashTable<SubjectState>,
    hasher: foldhash::fast::RandomState,
}

impl Subjects {
    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    fn get(&self, name: &str) -> Option<&SubjectState> {
        self.table.find(self.hash(name), |s| *s.name == *name)
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut SubjectState> {
        let hash = self.hash(name);
        self.table.find_mut(hash, |s| *s.name == *name)
    }

    /// The state of `name`, made by `new` if it has none.
    fn get_or_insert_with(
        &mut self,
        name: &str,
        new: impl FnOnce() -> SubjectState,
    ) -> &mut SubjectState {
        let hash = self.hash(name);
        let hasher = &self.hasher;
        self.table
            .entry(hash, |s| *s.name == *name, |s| hasher.hash_one(&*s.name))
            .or_insert_with(new)
            .into_mut()
    }

    fn values(&self) -> impl Iterator<Item = &SubjectState> {
        self.table.iter()
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut SubjectState> {
        self.table.iter_mut()
    }

    fn retain(&mut self, keep: impl FnMut(&mut SubjectState) -> bool) {
        self.table.retain(keep);
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

/// This tenant's view of one upstream.
#[derive(Debug)]
struct UpstreamState {
    /// The per-tenant budget (upstreams that are not shared).
    bucket: Bucket,
    /// This tenant's fair-share sub-bucket of a contended shared upstream.
    fair: Bucket,
    /// Per-tenant penalty box (upstreams that are not shared).
    penalty_until: Nanos,
    /// The last retry slot handed to a call refused by the penalty box or the adaptive throttle
    /// (see [`stagger`]).
    retry_stagger: Nanos,
    /// AIMD multiplier of the configured rate (upstreams that are not shared).
    multiplier: f64,
    /// When the last 429 arrived; a cut is forgotten once no 429 came for the adaptive window.
    last_429: Nanos,
    /// Adaptive-throttle window (upstreams that are not shared).
    sre: SreWindow,
    /// Calls that named this (shared) upstream since `demand_since`, for fair-share demand reports.
    demand: u64,
    demand_since: Nanos,
    /// The last measured demand, calls (cost units) per second.
    demand_rate: f64,
    /// This tenant's promise cursor on the shared bucket (see [`super::bucket::AtomicBucket`]).
    shared_promised: Nanos,
}

impl Default for UpstreamState {
    fn default() -> Self {
        UpstreamState {
            bucket: Bucket::default(),
            fair: Bucket::default(),
            penalty_until: 0,
            retry_stagger: 0,
            multiplier: 1.0,
            last_429: 0,
            sre: SreWindow::default(),
            demand: 0,
            demand_since: 0,
            demand_rate: 0.0,
            shared_promised: 0,
        }
    }
}

impl UpstreamState {
    fn is_resting(&self, now: Nanos, sre_window: u64) -> bool {
        self.bucket.is_resting(now)
            && self.fair.is_resting(now)
            && self.shared_promised <= now
            && self.penalty_until <= now
            && (self.multiplier >= 1.0
                || now.saturating_sub(self.last_429) > forget_after(sre_window))
            && self.sre.is_idle(now, sre_window)
            && (self.demand == 0 || now.saturating_sub(self.demand_since) > 10 * NS_PER_SEC)
    }
}

/// One bucket layer as it applies to one call.
#[derive(Clone)]
struct LayerPlan {
    layer: Layer,
    g: Gcra,
    /// Tokens this call takes from the layer per unit of cost (upstream amplification; 1 elsewhere).
    units: f64,
    upstream: Option<Arc<str>>,
    shared: Option<Arc<SharedUpstream>>,
    /// This tenant's fair share of a contended shared upstream.
    fair: Option<Gcra>,
    /// The AIMD multiplier applied to the configured rate (upstream layers).
    multiplier: f64,
    /// Whether the call may be held on this layer. A tenant that wants more of a shared upstream than
    /// its fair share (or, uncontended, than the whole budget) is refused rather than held: its holds
    /// would reserve the shared budget ahead of the tenants that stay within their share.
    hold_ok: bool,
}

impl LayerPlan {
    fn simple(layer: Layer, g: Gcra) -> Self {
        LayerPlan {
            layer,
            g,
            units: 1.0,
            upstream: None,
            shared: None,
            fair: None,
            multiplier: 1.0,
            hold_ok: true,
        }
    }

    fn same_layer(&self, layer: Layer, upstream: &Option<Arc<str>>) -> bool {
        self.layer == layer && self.upstream == *upstream
    }
}

/// How long an AIMD cut is remembered without a new 429: the adaptive window (2 minutes by default).
fn forget_after(sre_window: u64) -> u64 {
    if sre_window == 0 {
        120 * NS_PER_SEC
    } else {
        sre_window
    }
}

/// An upstream's adaptive-throttle window in nanoseconds (0 when adaptive throttling is off).
fn adaptive_window(cfg: &UpstreamConfig) -> u64 {
    cfg.adaptive.map_or(0, |a| a.window.as_nanos() as u64)
}

/// A budget's shape at an AIMD multiplier.
fn scaled(spec: BucketSpec, m: f64) -> Gcra {
    Gcra::new(BucketSpec::new(spec.rate.per_sec * m, spec.burst))
}

/// Whether a plan spends more than one upstream (each upstream layer is then named after its upstream).
fn several_upstreams(plan: &[LayerPlan]) -> bool {
    plan.iter()
        .filter(|lp| lp.layer == Layer::TenantUpstream)
        .count()
        > 1
}

/// How a layer is reported, given its bucket's state.
fn layer_state(
    lp: &LayerPlan,
    several_upstreams: bool,
    remaining: u64,
    reset_ns: u64,
) -> LayerState {
    let name = match (&lp.upstream, several_upstreams) {
        (Some(up), true) => std::borrow::Cow::Owned(format!("tenant_upstream:{up}")),
        _ => std::borrow::Cow::Borrowed(lp.layer.as_str()),
    };
    LayerState {
        layer: lp.layer,
        name,
        burst: lp.g.burst,
        window_secs: lp.g.window_secs(),
        remaining,
        reset_ns,
    }
}

/// The tenant's policy, resolved from one config generation.
#[derive(Debug, Clone)]
struct Policy {
    cfg: Arc<Config>,
    limits: TenantLimits,
    weight: f64,
    subject_g: Gcra,
    tenant_g: Gcra,
    global_g: Gcra,
    /// The global bucket of the tenant's plan, when the plan overrides `[limits.global]`; else the
    /// tenant passes the shared one.
    plan_global: Option<Arc<AtomicBucket>>,
}

impl Policy {
    fn new(cfg: Arc<Config>, tenant: &str, shared: &SharedBudgets) -> Self {
        let limits = cfg.tenant_limits(tenant);
        let (plan, global) = cfg.tenant_global(tenant);
        Policy {
            subject_g: Gcra::new(limits.subject.bucket),
            tenant_g: Gcra::new(limits.tenant.bucket),
            global_g: Gcra::new(global),
            plan_global: plan.map(|p| shared.plan_global(p)),
            weight: cfg.tenant_weight(tenant),
            limits,
            cfg,
        }
    }

    /// The global bucket this tenant's calls pass.
    fn global<'a>(&'a self, shared: &'a SharedBudgets) -> &'a AtomicBucket {
        self.plan_global.as_deref().unwrap_or(&shared.global)
    }

    fn upstream(&self, name: &str) -> Option<&UpstreamConfig> {
        self.cfg.upstreams.get(name)
    }
}

/// The config of each upstream a call spends, in the order of [`Resolved::upstreams`] (`None` for a
/// name the config does not know). Looked up once per call: the decision's steps each need it.
type UpstreamConfigs<'a> = SmallVec<[Option<&'a UpstreamConfig>; 2]>;

fn upstream_configs<'a>(cfg: &'a Config, r: &Resolved) -> UpstreamConfigs<'a> {
    r.upstreams
        .iter()
        .map(|(up, _)| cfg.upstreams.get(&**up))
        .collect()
}

/// An expired lease as telemetry counts it: (subject label, tool, primary upstream).
pub type ExpiredLease = (Arc<str>, Arc<str>, Option<Arc<str>>);

/// Tool and upstream names a thread keeps shared copies of, at most ([`intern`]).
const NAMES: usize = 4096;

thread_local! {
    /// Shared copies of the tool and upstream names calls use, one set per thread for every tenant
    /// engine on it: a deployment has few such names, and a set per tenant put two or three cache
    /// misses on every admission (the tenant's table, then the name's count) where one small set
    /// that every call uses stays in cache.
    static NAME_SET: std::cell::RefCell<hashbrown::HashMap<CompactString, Arc<str>, foldhash::fast::RandomState>> =
        std::cell::RefCell::new(hashbrown::HashMap::default());
}

/// The shared copy of a tool or upstream name, so a call does not allocate its names (and free them
/// on the telemetry thread, the last to drop them). The set is bounded: past [`NAMES`] names it
/// starts over (names still in use stay alive where they are used).
fn intern(name: &str) -> Arc<str> {
    NAME_SET.with(|set| {
        let mut set = set.borrow_mut();
        if let Some(a) = set.get(name) {
            return a.clone();
        }
        if set.len() >= NAMES {
            set.clear();
        }
        let a: Arc<str> = Arc::from(name);
        set.insert(CompactString::from(name), a.clone());
        a
    })
}

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
    /// Moving average of how long leases are held, for concurrency retry hints.
    hold_avg_ns: Option<f64>,
    /// The last retry slot handed to a call refused for want of the tenant's concurrency slots.
    slot_stagger: Nanos,
    last_active: Nanos,
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
            hold_avg_ns: None,
            slot_stagger: 0,
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
        for (name, u) in self.upstreams.iter_mut() {
            let o = old.upstream(name).and_then(|u| u.bucket);
            let n = new.upstream(name).and_then(|u| u.bucket);
            match (o, n) {
                (Some(o), Some(n)) => {
                    u.bucket
                        .rescale(now, &scaled(o, u.multiplier), &scaled(n, u.multiplier))
                }
                _ => u.bucket = Bucket::default(),
            }
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id
    }

    /// Applies tool defaults: upstreams (the request's, else the tool's), then cost.
    pub fn resolve(&mut self, req: &AdmitRequest) -> Resolved {
        let cfg = Arc::clone(&self.policy.cfg);
        let tool = cfg.tools.get(&*req.tool);
        let upstreams: Vec<(Arc<str>, f64)> = match &req.upstream {
            Some(u) => {
                let units = tool
                    .and_then(|t| t.upstreams.iter().find(|(n, _)| **n == **u))
                    .map_or(1.0, |x| x.1);
                vec![(intern(u), units)]
            }
            None => tool.map_or_else(Vec::new, |t| {
                t.upstreams.iter().map(|(n, x)| (intern(n), *x)).collect()
            }),
        };
        let upstream = primary_upstream(&upstreams);
        let cost = req
            .cost
            .or_else(|| tool.and_then(|t| t.cost))
            .unwrap_or(1.0);
        let (subject, subject_label) = self.subject_names(&req.subject);
        Resolved {
            subject,
            subject_label,
            tool: intern(&req.tool),
            upstream,
            upstreams,
            cost,
        }
    }

    fn plan(&self, r: &Resolved) -> Vec<LayerPlan> {
        let configs = upstream_configs(&self.policy.cfg, r);
        self.plan_for(r, &configs)
    }

    /// [`TenantEngine::plan`] with the call's upstream configs already looked up.
    fn plan_for(&self, r: &Resolved, configs: &[Option<&UpstreamConfig>]) -> Vec<LayerPlan> {
        let p = &self.policy;
        let mut v = Vec::with_capacity(4 + r.upstreams.len());
        v.push(LayerPlan::simple(Layer::Subject, p.subject_g));
        if let Some(b) = p.cfg.tools.get(&*r.tool).and_then(|t| t.bucket) {
            v.push(LayerPlan::simple(Layer::SubjectTool, Gcra::new(b)));
        }
        v.push(LayerPlan::simple(Layer::Tenant, p.tenant_g));
        for ((up, units), cfg) in r.upstreams.iter().zip(configs) {
            let Some(cfg) = cfg else { continue };
            let Some(spec) = cfg.bucket else { continue };
            let (shared, multiplier) = if cfg.shared {
                match self.shared.upstream(up) {
                    Some(s) => {
                        let m = s.multiplier();
                        (Some(s), m)
                    }
                    None => continue,
                }
            } else {
                (None, self.upstreams.get(up).map_or(1.0, |u| u.multiplier))
            };
            let capacity = spec.rate.per_sec * multiplier;
            // Only a tenant that wants more than its fair share is held to it (and never held on the
            // shared budget); one within its share is limited by the shared budget alone. Before any
            // share is known, a tenant that alone wants twice the whole budget is not held either.
            let share = shared.as_ref().and_then(|s| s.share_of(&self.tenant));
            let demand = self.upstreams.get(up).map_or(0.0, |u| u.demand_rate);
            let hold_ok = match (&shared, share) {
                (None, _) => true,
                (Some(_), Some(share)) => !share.bottlenecked,
                (Some(_), None) => demand <= 2.0 * capacity,
            };
            let fair = share.filter(|s| s.bottlenecked).map(|share| {
                let share = share.rate.max(capacity * 1e-3);
                Gcra::new(BucketSpec::new(
                    share,
                    (spec.burst * share / capacity).clamp(1.0, spec.burst),
                ))
            });
            v.push(LayerPlan {
                layer: Layer::TenantUpstream,
                g: scaled(spec, multiplier),
                units: *units,
                upstream: Some(up.clone()),
                shared,
                fair,
                multiplier,
                hold_ok,
            });
        }
        v.push(LayerPlan::simple(Layer::Global, p.global_g));
        v
    }

    fn is_shared_upstream(&self, upstream: Option<&str>) -> bool {
        upstream
            .and_then(|u| self.policy.upstream(u))
            .is_some_and(|u| u.shared)
    }

    // ---- per-layer bucket access ----

    /// The fair-share sub-bucket applies when the tenant has a share and the call fits it.
    fn fair_of(lp: &LayerPlan, tokens: f64) -> Option<Gcra> {
        lp.fair.filter(|f| !f.oversized(tokens))
    }

    /// Takes the call's tokens from one layer. Also returns the layer's state as the answer reports it
    /// (whole tokens left, nanoseconds until full), read from the buckets just taken from: reading it
    /// afterwards would look every bucket up a second time.
    fn take_layer(
        &mut self,
        lp: &LayerPlan,
        r: &Resolved,
        now: Nanos,
        max_wait: u64,
    ) -> (Take, u64, u64) {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        let local = |b: &mut Bucket, g: &Gcra, max_wait: u64| {
            let t = b.take(g, now, inc, max_wait);
            (t, b.remaining(g, now), b.reset_ns(now))
        };
        match lp.layer {
            Layer::Subject => local(&mut self.subject_mut(r).bucket, &lp.g, max_wait),
            Layer::SubjectTool => local(self.subject_mut(r).tool_bucket(&r.tool), &lp.g, max_wait),
            Layer::Tenant => local(&mut self.tenant_bucket, &lp.g, max_wait),
            Layer::TenantUpstream => {
                let name = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                let Some(s) = &lp.shared else {
                    return local(&mut self.upstream_mut(&name).bucket, &lp.g, max_wait);
                };
                // Past its fair share a tenant is refused, never held: a hold would reserve shared
                // tokens ahead of time and make the tenants within their share wait behind it.
                let fair = Self::fair_of(lp, tokens);
                let mut fair_state = None;
                if let Some(f) = fair {
                    let u = self.upstream_mut(&name);
                    match u.fair.take(&f, now, f.increment(tokens), 0) {
                        short @ Take::Short { .. } => return (short, 0, 0),
                        Take::Ok { .. } => {
                            fair_state = Some((u.fair.remaining(&f, now), u.fair.reset_ns(now)))
                        }
                    }
                }
                let max_wait = if lp.hold_ok { max_wait } else { 0 };
                match s.bucket.take(&lp.g, now, inc, max_wait) {
                    ok @ Take::Ok { .. } => {
                        let (mut remaining, mut reset) =
                            (s.bucket.remaining(&lp.g, now), s.bucket.reset_ns(now));
                        if let Some((r2, t2)) = fair_state {
                            (remaining, reset) = (remaining.min(r2), reset.max(t2));
                        }
                        (ok, remaining, reset)
                    }
                    short => {
                        if let Some(f) = fair {
                            self.upstream_mut(&name).fair.refund(f.increment(tokens));
                        }
                        (short, 0, 0)
                    }
                }
            }
            Layer::Global => {
                let b = self.policy.global(&self.shared);
                let t = b.take(&lp.g, now, inc, max_wait);
                (t, b.remaining(&lp.g, now), b.reset_ns(now))
            }
        }
    }

    fn refund_layer(&mut self, lp: &LayerPlan, r: &Resolved) {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        match lp.layer {
            Layer::Subject => self.subject_mut(r).bucket.refund(inc),
            Layer::SubjectTool => self.subject_mut(r).tool_bucket(&r.tool).refund(inc),
            Layer::Tenant => self.tenant_bucket.refund(inc),
            Layer::TenantUpstream => {
                let name = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                match &lp.shared {
                    Some(s) => {
                        s.bucket.refund(inc);
                        if let Some(f) = Self::fair_of(lp, tokens) {
                            self.upstream_mut(&name).fair.refund(f.increment(tokens));
                        }
                    }
                    None => self.upstream_mut(&name).bucket.refund(inc),
                }
            }
            Layer::Global => self.policy.global(&self.shared).refund(inc),
        }
    }

    fn promise_layer(&mut self, lp: &LayerPlan, r: &Resolved, now: Nanos) -> u64 {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        match lp.layer {
            Layer::Subject => self.subject_mut(r).bucket.promise(&lp.g, now, inc),
            Layer::SubjectTool => self
                .subject_mut(r)
                .tool_bucket(&r.tool)
                .promise(&lp.g, now, inc),
            Layer::Tenant => self.tenant_bucket.promise(&lp.g, now, inc),
            Layer::TenantUpstream => {
                let name = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                match &lp.shared {
                    Some(s) => {
                        let fair = match Self::fair_of(lp, tokens) {
                            Some(f) => {
                                let u = self.upstream_mut(&name);
                                if u.fair.peek(&f, now, f.increment(tokens)) > 0 {
                                    u.fair.promise(&f, now, f.increment(tokens))
                                } else {
                                    0
                                }
                            }
                            None => 0,
                        };
                        let shared = if s.bucket.peek(&lp.g, now, inc) > 0 {
                            let mut cursor = self.upstream_mut(&name).shared_promised;
                            let wait = s.bucket.promise(&mut cursor, &lp.g, now, inc);
                            self.upstream_mut(&name).shared_promised = cursor;
                            wait
                        } else {
                            0
                        };
                        fair.max(shared)
                    }
                    None => self.upstream_mut(&name).bucket.promise(&lp.g, now, inc),
                }
            }
            Layer::Global => {
                self.policy
                    .global(&self.shared)
                    .promise(&mut self.global_promised, &lp.g, now, inc)
            }
        }
    }

    /// (remaining whole tokens, ns until full, shortfall of this call) without changing anything.
    fn peek_layer(&self, lp: &LayerPlan, r: &Resolved, now: Nanos) -> (u64, u64, u64) {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        let local = |g: &Gcra, inc: u64, b: Option<&Bucket>| {
            let b = b.copied().unwrap_or_default();
            (b.remaining(g, now), b.reset_ns(now), b.peek(g, now, inc))
        };
        match lp.layer {
            Layer::Subject => local(&lp.g, inc, self.subjects.get(&r.subject).map(|s| &s.bucket)),
            Layer::SubjectTool => local(
                &lp.g,
                inc,
                self.subjects
                    .get(&r.subject)
                    .and_then(|s| s.tools().iter().find(|(t, _)| *t == r.tool).map(|(_, b)| b)),
            ),
            Layer::Tenant => local(&lp.g, inc, Some(&self.tenant_bucket)),
            Layer::TenantUpstream => {
                let state = lp.upstream.as_ref().and_then(|u| self.upstreams.get(u));
                match &lp.shared {
                    Some(s) => {
                        let mut out = (
                            s.bucket.remaining(&lp.g, now),
                            s.bucket.reset_ns(now),
                            s.bucket.peek(&lp.g, now, inc),
                        );
                        if let Some(f) = Self::fair_of(lp, tokens) {
                            let (r2, t2, sh2) =
                                local(&f, f.increment(tokens), state.map(|u| &u.fair));
                            out = (out.0.min(r2), out.1.max(t2), out.2.max(sh2));
                        }
                        out
                    }
                    None => local(&lp.g, inc, state.map(|u| &u.bucket)),
                }
            }
            Layer::Global => {
                let b = self.policy.global(&self.shared);
                (
                    b.remaining(&lp.g, now),
                    b.reset_ns(now),
                    b.peek(&lp.g, now, inc),
                )
            }
        }
    }

    /// The bucket layers a call would pass and their state now, without deciding it or spending
    /// anything: for the rate-limit headers of a request refused before it was decided.
    pub fn layers_of(&mut self, req: &AdmitRequest, now: Nanos) -> Vec<LayerState> {
        let r = self.resolve(req);
        let plan = self.plan(&r);
        self.layer_states(&plan, &r, now)
    }

    fn layer_states(&self, plan: &[LayerPlan], r: &Resolved, now: Nanos) -> Vec<LayerState> {
        let several = several_upstreams(plan);
        plan.iter()
            .map(|lp| {
                let (remaining, reset_ns, _) = self.peek_layer(lp, r, now);
                layer_state(lp, several, remaining, reset_ns)
            })
            .collect()
    }

    fn subject_mut(&mut self, r: &Resolved) -> &mut SubjectState {
        // The owned key is made only when the subject is new.
        let labels = &self.labels;
        self.subjects.get_or_insert_with(&r.subject, || {
            let label_gen = labels.as_ref().map_or(0, |l| l.generation());
            SubjectState::new(r.subject.clone(), r.label_folded(), label_gen)
        })
    }

    /// The shared copy of a subject's name and its metric label, kept in its state: a subject's
    /// calls, leases and telemetry events share one copy instead of one per call. A subject without
    /// state gets a new copy and a label decided now, which become the state's if the call spends
    /// anything (a call refused before it spends leaves no state behind). Labels are decided in the
    /// order calls reach this tenant, so the first subjects to call are the ones named.
    fn subject_names(&mut self, subject: &str) -> (Arc<str>, Arc<str>) {
        if let Some(s) = self.subjects.get_mut(subject) {
            if let Some(l) = &self.labels {
                // Folded under caps that have changed since: there may be room now.
                if s.label_folded && s.label_gen != l.generation() {
                    s.label_gen = l.generation();
                    s.label_folded = l.is_other(&l.label(&self.tenant, &s.name));
                }
            }
            return (s.name.clone(), s.label(self.labels.as_deref()));
        }
        let name: Arc<str> = Arc::from(subject);
        let label = match &self.labels {
            Some(l) => l.label(&self.tenant, &name),
            None => name.clone(),
        };
        (name, label)
    }

    /// Starts loading the lease slot the next admission will write (see [`crate::prefetch`]).
    pub fn prefetch_lease_slot(&self) {
        self.leases.prefetch_next();
    }

    /// Where subjects get their metric labels (none: every subject is labelled by its name).
    pub fn set_subject_labels(&mut self, labels: Option<Arc<SubjectLabels>>) {
        self.labels = labels;
    }

    fn upstream_mut(&mut self, name: &Arc<str>) -> &mut UpstreamState {
        self.upstreams.entry(name.clone()).or_default()
    }

    // ---- admission ----

    /// Decides a call, or queues it for a concurrency slot.
    pub fn admit(&mut self, req: &AdmitRequest, now: Nanos, wall_ms: i64) -> AdmitResult {
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
        if let Some(shed) = self.penalty(&r, now) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if let Some(shed) = self.adaptive(&r, &configs, now) {
            return AdmitResult::Decided(self.refuse(r, &plan, shed, now));
        }
        if self.take_slots_if_free(&r) || self.take_expired_slots(&r, now, wall_ms) {
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

    /// Forgets AIMD cuts on the call's upstreams that saw no 429 for the adaptive window: with no recent
    /// evidence the upstream is overloaded, the configured rate applies again.
    fn settle_cuts(&mut self, r: &Resolved, configs: &[Option<&UpstreamConfig>], now: Nanos) {
        for ((up, _), cfg) in r.upstreams.iter().zip(configs) {
            let Some(cfg) = cfg else {
                continue;
            };
            let (forget, spec) = (forget_after(adaptive_window(cfg)), cfg.bucket);
            if cfg.shared {
                if let (Some(s), Some(spec)) = (self.shared.upstream(up), spec) {
                    if s.multiplier() < 1.0 && now.saturating_sub(s.last_429()) > forget {
                        let (old, new) = s.update_multiplier(|_| 1.0);
                        s.bucket
                            .rescale(now, &scaled(spec, old), &scaled(spec, new));
                    }
                }
            } else if let Some(u) = self.upstreams.get_mut(up) {
                if u.multiplier < 1.0 && now.saturating_sub(u.last_429) > forget {
                    if let Some(spec) = spec {
                        u.bucket
                            .rescale(now, &scaled(spec, u.multiplier), &scaled(spec, 1.0));
                    }
                    u.multiplier = 1.0;
                }
            }
        }
    }

    /// Counts calls per shared upstream and reports the rate for the fair share every 250 ms.
    fn note_demand(&mut self, r: &Resolved, configs: &[Option<&UpstreamConfig>], now: Nanos) {
        for ((up, units), cfg) in r.upstreams.iter().zip(configs) {
            let Some(spec) = cfg.filter(|c| c.shared).and_then(|c| c.bucket) else {
                continue;
            };
            let Some(s) = self.shared.upstream(up) else {
                continue;
            };
            let weight = self.policy.weight;
            let tokens = (r.cost * units).max(1e-9);
            let u = self.upstream_mut(up);
            if u.demand == 0 {
                u.demand_since = now;
            }
            u.demand += 1;
            let elapsed = now.saturating_sub(u.demand_since);
            if elapsed >= DEMAND_WINDOW {
                // The window opens at its first call, so n calls span n - 1 intervals.
                let rate = (u.demand - 1) as f64 * tokens / (elapsed as f64 / NS_PER_SEC as f64);
                u.demand = 0;
                // Smoothed, so one bunch of calls does not look like a loop.
                u.demand_rate = if u.demand_rate > 0.0 {
                    0.5 * u.demand_rate + 0.5 * rate
                } else {
                    rate
                };
                s.report_demand(
                    &self.tenant,
                    rate,
                    weight,
                    now,
                    spec.rate.per_sec * s.multiplier(),
                );
            }
        }
    }

    /// The refusal of a call whose cost is more than some layer or daily quota can ever hold. Its
    /// text names the largest cost that fits every one of them, not the first one the call
    /// overflows: a model told "the limit is 100" that retries with 99 must not be refused again by
    /// a burst of 30.
    fn oversized(&self, r: &Resolved, plan: &[LayerPlan]) -> Option<Shed> {
        let limit = self.oversized_limit(r, plan)?;
        let cx = self.refusal_cx(r, r.upstream.as_deref(), limit);
        Some(Shed {
            scope: Scope::Oversized,
            retry_after_ms: 0,
            retryable: false,
            reason: refusal::reason(Scope::Oversized).to_string(),
            message: refusal::message(Scope::Oversized, 0, &cx),
        })
    }

    /// When the call's cost is more than some layer or quota on its path can ever hold: the largest
    /// cost that fits them all, which its refusal names.
    fn oversized_limit(&self, r: &Resolved, plan: &[LayerPlan]) -> Option<f64> {
        let limits = &self.policy.limits;
        let quotas = [limits.subject.daily_quota, limits.tenant.daily_quota];
        let quotas = quotas.into_iter().flatten();
        let too_large = plan.iter().any(|lp| lp.g.oversized(r.cost * lp.units))
            || quotas.clone().any(|q| r.cost > q);
        too_large.then(|| {
            plan.iter()
                .map(|lp| lp.g.burst / lp.units)
                .chain(quotas)
                .fold(f64::INFINITY, f64::min)
        })
    }

    /// For a call that this tenant's config refuses as `oversized` whatever its state: its cost and
    /// the limit its refusal names (`admitd check`'s warning, see [`super::lint`]). Reads the
    /// config only; nothing is spent or recorded.
    pub fn never_fits(&mut self, req: &AdmitRequest) -> Option<(f64, f64)> {
        let r = self.resolve(req);
        let cfg = Arc::clone(&self.policy.cfg);
        let configs = upstream_configs(&cfg, &r);
        let plan = self.plan_for(&r, &configs);
        self.oversized_limit(&r, &plan).map(|limit| (r.cost, limit))
    }

    fn refusal_cx<'a>(
        &self,
        r: &'a Resolved,
        upstream: Option<&'a str>,
        limit: f64,
    ) -> RefusalContext<'a> {
        RefusalContext {
            tool: &r.tool,
            upstream,
            shared_upstream: self.is_shared_upstream(upstream),
            cost: r.cost,
            limit,
            account_wide: false,
        }
    }

    fn make_shed(
        &mut self,
        r: &Resolved,
        upstream: Option<&str>,
        scope: Scope,
        wait_ns: u64,
    ) -> Shed {
        self.shed_by(r, upstream, scope, wait_ns, false)
    }

    /// A refusal by a limit that is the whole account's (`account_wide`) or this agent's: the text
    /// says whose, so the model knows whether its own calls are the cause.
    fn shed_by(
        &mut self,
        r: &Resolved,
        upstream: Option<&str>,
        scope: Scope,
        wait_ns: u64,
        account_wide: bool,
    ) -> Shed {
        // A little jitter (up to 5% of the wait, at most 100 ms) keeps callers told the same moment from
        // arriving in the same millisecond; it only ever adds, so nobody is told to come back early.
        // A daily quota resets at one fixed instant for everyone: no jitter there.
        // It never crosses into the next whole second, so the wait in the text and the Retry-After
        // header stays what the limiter (or the upstream) said.
        let jitter = if scope == Scope::DailyQuota {
            0
        } else {
            let to_next_second = wait_ns.div_ceil(NS_PER_SEC) * NS_PER_SEC - wait_ns;
            self.rng.below_or_eq(
                (wait_ns / 20)
                    .min(100 * NS_PER_MS)
                    .min(to_next_second.saturating_sub(NS_PER_MS)),
            )
        };
        let retry_after_ms = ceil_ms(wait_ns.saturating_add(jitter)).max(1);
        let cx = RefusalContext {
            account_wide,
            ..self.refusal_cx(r, upstream, 0.0)
        };
        Shed {
            scope,
            retry_after_ms,
            retryable: true,
            reason: refusal::reason(scope).to_string(),
            message: refusal::message(scope, retry_after_ms, &cx),
        }
    }

    fn penalty_until(&self, upstream: &str) -> Nanos {
        if self.is_shared_upstream(Some(upstream)) {
            if let Some(s) = self.shared.upstream(upstream) {
                return s.penalty_until();
            }
        }
        self.upstreams.get(upstream).map_or(0, |u| u.penalty_until)
    }

    /// The longest penalty among the call's upstreams, as (upstream, nanoseconds left).
    fn longest_penalty(&self, r: &Resolved, now: Nanos) -> Option<(Arc<str>, u64)> {
        r.upstreams
            .iter()
            .map(|(u, _)| (u, self.penalty_until(u).saturating_sub(now)))
            .filter(|(_, left)| *left > 0)
            .max_by_key(|(_, left)| *left)
            .map(|(u, left)| (u.clone(), left))
    }

    /// Refuses a call to an upstream in the penalty box. The first call refused is told the penalty's
    /// end; each next one later, along the upstream's refill (see [`TenantEngine::upstream_slot`]).
    fn penalty(&mut self, r: &Resolved, now: Nanos) -> Option<Shed> {
        let (up, left) = self.longest_penalty(r, now)?;
        let shared = self
            .shared
            .upstream(&up)
            .filter(|_| self.is_shared_upstream(Some(&up)));
        let slot = self.upstream_slot(r, &up, shared.as_deref(), now, left);
        Some(self.make_shed(r, Some(&up), Scope::UpstreamPenalty, slot - now))
    }

    /// The retry slot of a call refused on account of upstream `up` (its penalty box or its adaptive
    /// throttle) that must wait `wait` ns at least: the first call refused is told `now + wait`, each
    /// next one a refill step of the upstream's budget later (of the tenant's, when the upstream has
    /// none), so the calls that wait as told reach the recovering upstream one by one instead of all
    /// at once. The spread covers at most `wait` itself (at least a second) and then starts over.
    fn upstream_slot(
        &mut self,
        r: &Resolved,
        up: &Arc<str>,
        shared: Option<&SharedUpstream>,
        now: Nanos,
        wait: u64,
    ) -> Nanos {
        let base = now.saturating_add(wait);
        let step = self.retry_step(r, up, shared);
        let window = wait.clamp(NS_PER_SEC, PROMISE_HORIZON);
        match shared {
            Some(s) => stagger_atomic(&s.retry_stagger, base, step, window),
            None => stagger(&mut self.upstream_mut(up).retry_stagger, base, step, window),
        }
    }

    /// The time the budget a call refused on account of `up` will spend there takes to refill that
    /// call's tokens:
    /// the upstream's own (at its AIMD-cut rate; `shared` when the upstream is), else the tenant's;
    /// at least 1 ms.
    fn retry_step(&self, r: &Resolved, up: &Arc<str>, shared: Option<&SharedUpstream>) -> u64 {
        let units = r
            .upstreams
            .iter()
            .find(|(u, _)| u == up)
            .map_or(1.0, |(_, x)| *x);
        let bucket = self.policy.upstream(up).and_then(|c| c.bucket);
        let rate = match bucket {
            Some(b) => {
                let m = match shared {
                    Some(s) => s.multiplier(),
                    None => self.upstreams.get(up).map_or(1.0, |u| u.multiplier),
                };
                b.rate.per_sec * m
            }
            None => self.policy.limits.tenant.bucket.rate.per_sec,
        };
        let secs = r.cost * units / rate;
        if secs.is_finite() {
            ((secs * NS_PER_SEC as f64) as u64).clamp(NS_PER_MS, PROMISE_HORIZON)
        } else {
            PROMISE_HORIZON
        }
    }

    /// Google SRE client-side throttling, per upstream the call spends.
    fn adaptive(
        &mut self,
        r: &Resolved,
        configs: &[Option<&UpstreamConfig>],
        now: Nanos,
    ) -> Option<Shed> {
        for ((up, _), cfg) in r.upstreams.iter().zip(configs) {
            let Some(cfg) = cfg else {
                continue;
            };
            let Some(a) = cfg.adaptive else { continue };
            let window = a.window.as_nanos() as u64;
            let shared = if cfg.shared {
                self.shared.upstream(up)
            } else {
                None
            };
            let p = match &shared {
                Some(s) => s.sre_probability(now, window, a.k, a.min_requests),
                None => match self.upstreams.get_mut(up) {
                    Some(u) => u.sre.reject_probability(now, window, a.k, a.min_requests),
                    None => 0.0,
                },
            };
            if p > 0.0 && self.rng.unit() < p {
                match &shared {
                    Some(s) => s.sre_local_reject(now, window),
                    None => self.upstream_mut(up).sre.record_local_reject(now, window),
                }
                // The more the upstream rejects, the longer it takes to recover: wait 2 s per
                // accepted-to-rejected ratio, between 1 and 30 seconds.
                let wait = (2.0 * p / (1.0 - p).max(0.05)).clamp(1.0, 30.0);
                let wait = (wait * NS_PER_SEC as f64) as u64;
                let slot = self.upstream_slot(r, up, shared.as_deref(), now, wait);
                let mut shed = self.make_shed(r, Some(up), Scope::Adaptive, slot - now);
                shed.reason = format!(
                    "upstream is rejecting requests (throttling {:.0}% of calls)",
                    p * 100.0
                );
                return Some(shed);
            }
        }
        None
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

    /// [`Self::slots_free`] and [`Self::take_slots`] with one lookup of the subject.
    fn take_slots_if_free(&mut self, r: &Resolved) -> bool {
        if !self.tenant_slot_free() {
            return false;
        }
        let cap = self.policy.limits.subject.concurrency;
        let s = self.subject_mut(r);
        if cap.is_some_and(|c| s.inflight >= c) {
            return false;
        }
        s.inflight += 1;
        self.inflight += 1;
        true
    }

    /// For a call that found no free slot: expires the leases past their TTL, if any is, and takes a
    /// slot if that freed one. The tick expires leases once a second; this frees a slot at its
    /// lease's TTL, not up to a second later, and costs nothing while slots are free. Queued calls
    /// come first: the slots freed go to them (their decisions wait in `pending`), and this call gets
    /// one only if any is left.
    fn take_expired_slots(&mut self, r: &Resolved, now: Nanos, wall_ms: i64) -> bool {
        if self.next_expiry > now {
            return false;
        }
        let mut expired = std::mem::take(&mut self.expired);
        let granted = self.expire_leases_into(now, wall_ms, &mut expired);
        self.expired = expired;
        self.pending.extend(granted);
        self.take_slots_if_free(r)
    }

    /// Leases expired by admissions since the last call (see [`TenantEngine::take_expired_slots`]).
    pub fn take_expired(&mut self) -> Vec<ExpiredLease> {
        std::mem::take(&mut self.expired)
    }

    fn take_slots(&mut self, r: &Resolved) {
        self.subject_mut(r).inflight += 1;
        self.inflight += 1;
    }

    fn free_slots(&mut self, subject: &Arc<str>, now: Nanos) {
        if let Some(s) = self.subjects.get_mut(subject) {
            s.inflight = s.inflight.saturating_sub(1);
            s.keep_until_s = whole_secs(now).saturating_add(KEEP_SUBJECT_SECS);
        }
        self.inflight = self.inflight.saturating_sub(1);
    }

    /// Refuses a call for want of a concurrency slot. The first call refused is told the average time
    /// a call holds its slot; each next one, refused before that time, is told one slot's worth later
    /// (the average hold over the number of slots), so the callers who wait as told take the slots
    /// one by one as they free instead of coming back together (over at most four average holds,
    /// then starting over).
    fn concurrency_shed(&mut self, r: &Resolved, now: Nanos) -> Shed {
        let hold = self
            .hold_avg_ns
            .map_or(DEFAULT_HOLD_HINT_NS, |h| h as u64)
            .clamp(100 * NS_PER_MS, 60 * NS_PER_SEC);
        let limits = &self.policy.limits;
        let subject_limit = limits.subject.concurrency.filter(|&c| {
            self.subjects
                .get(&r.subject)
                .is_some_and(|s| s.inflight >= c)
        });
        let tenant_limit = limits.tenant.concurrency;
        let cursor = match (subject_limit, self.subjects.get_mut(&r.subject)) {
            (Some(_), Some(s)) => &mut s.extra_mut().slot_stagger,
            _ => &mut self.slot_stagger,
        };
        let slots = subject_limit.or(tenant_limit).unwrap_or(1).max(1);
        // Spread over at most four average holds (at least a second).
        let window = (4 * hold).clamp(NS_PER_SEC, PROMISE_HORIZON);
        let slot = stagger(
            cursor,
            now.saturating_add(hold),
            hold / slots as u64,
            window,
        );
        let upstream = r.upstream.clone();
        self.shed_by(
            r,
            upstream.as_deref(),
            Scope::Concurrency,
            slot - now,
            subject_limit.is_none(),
        )
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
                    let mut wait = self.promise_layer(lp, &r, now);
                    for later in &plan[i + 1..] {
                        wait = wait.max(self.peek_layer(later, &r, now).2);
                    }
                    // An upstream that asked for a longer pause than the bucket's wait sets the hint.
                    if let Some((_, left)) = self.longest_penalty(&r, now) {
                        wait = wait.max(left);
                    }
                    let upstream = lp.upstream.clone().or_else(|| r.upstream.clone());
                    let mut shed = self.make_shed(&r, upstream.as_deref(), lp.layer.scope(), wait);
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
        let r = Resolved {
            cost: charge.cost,
            ..r.clone()
        };
        for lp in plan {
            if charge.taken.iter().any(|(l, u)| lp.same_layer(*l, u)) {
                self.refund_layer(lp, &r);
            }
        }
        if charge.quota_subject {
            self.subject_mut(&r)
                .extra_mut()
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
                let expires =
                    now.saturating_add(self.policy.cfg.server.lease_ttl.as_nanos() as u64);
                let lease = self
                    .leases
                    .insert(Lease::new(&r, false, None, now, expires));
                self.expiries.push(expires, lease);
                self.next_expiry = self.next_expiry.min(expires);
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

    /// Ends a lease: frees its slot, records how long it was held, and feeds what the upstream said into
    /// the penalty box, the AIMD rate and the adaptive throttle.
    pub fn release(
        &mut self,
        lease: u64,
        info: &ReleaseInfo,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Released, UnknownLease> {
        self.last_active = now;
        let l = self.leases.remove(lease).ok_or(UnknownLease)?;
        if l.slots {
            self.free_slots(&l.subject, now);
            let held = now.saturating_sub(l.created) as f64;
            self.hold_avg_ns = Some(match self.hold_avg_ns {
                Some(avg) => avg * 0.8 + held * 0.2,
                None => held,
            });
        }
        let rate_limited =
            info.outcome == Outcome::UpstreamRateLimited || info.upstream_status == Some(429);
        let mut penalty = None;
        if rate_limited && !l.upstreams.is_empty() {
            let d = info.retry_after.unwrap_or(Duration::from_secs(1));
            for (up, _) in l.upstreams.iter() {
                self.upstream_rate_limited(up, d, now);
            }
            penalty = Some(d);
        } else if info.outcome != Outcome::Cancelled {
            // 503 is the other "overloaded" answer: not an accept, but no penalty either.
            let accepted = info.upstream_status != Some(503);
            let healthy =
                info.outcome == Outcome::Ok && info.upstream_status.is_none_or(|s| s < 500);
            for (up, _) in l.upstreams.iter() {
                self.upstream_answered(up, accepted, healthy, now);
            }
        }
        let mut granted = std::mem::take(&mut self.pending);
        granted.extend(self.grant_waiting(now, wall_ms));
        Ok(Released {
            upstream: primary_upstream(&l.upstreams),
            subject: l.subject,
            tool: l.tool,
            penalty,
            granted,
        })
    }

    fn end_lease(
        &mut self,
        lease: u64,
        refund: bool,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Vec<(u64, Decision)>, UnknownLease> {
        let l = self.leases.remove(lease).ok_or(UnknownLease)?;
        if let Some(charge) = l.charge.as_ref().filter(|_| refund) {
            let r = l.resolved(self.labels.as_deref());
            let plan = self.plan(&r);
            self.undo_charge(&r, &plan, charge);
        }
        if l.slots {
            self.free_slots(&l.subject, now);
        }
        Ok(self.grant_waiting(now, wall_ms))
    }

    /// Gives back everything a held call took, because its caller went away before the hold ended.
    /// Returns the decisions of queued calls that got the freed slot.
    pub fn cancel_lease(
        &mut self,
        lease: u64,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Vec<(u64, Decision)>, UnknownLease> {
        let refund = self
            .leases
            .get(lease)
            .and_then(|l| l.charge.as_ref())
            .is_some_and(|c| now < c.hold_until);
        self.end_lease(lease, refund, now, wall_ms)
    }

    /// Checks a held call once its hold is over: if one of its upstreams went into the penalty box
    /// meanwhile, the call is shed with the upstream's wait (and everything it took is given back)
    /// instead of being sent to discover the 429 itself. `Ok(None)`: go ahead.
    pub fn confirm_hold(
        &mut self,
        lease: u64,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Option<Decision>, UnknownLease> {
        let l = self.leases.get(lease).ok_or(UnknownLease)?;
        let r = l.resolved(self.labels.as_deref());
        let Some(shed) = self.penalty(&r, now) else {
            return Ok(None);
        };
        let granted = self.end_lease(lease, true, now, wall_ms)?;
        self.pending.extend(granted);
        let plan = self.plan(&r);
        Ok(Some(self.refuse(r, &plan, shed, now)))
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
            self.upstream_rate_limited(upstream, d, now);
            Some(d)
        } else {
            self.upstream_answered(upstream, status != 503, status < 500, now);
            None
        }
    }

    /// Decisions made outside the usual return paths (calls queued for an upstream that a feedback or
    /// a hold check put in the penalty box). The actor collects them after every message.
    pub fn drain_decisions(&mut self) -> Vec<(u64, Decision)> {
        std::mem::take(&mut self.pending)
    }

    /// A 429 from `upstream`: penalty until its Retry-After, a multiplicative cut of its budget, a
    /// rejected request for the adaptive throttle, and an immediate refusal of the calls queued for it.
    fn upstream_rate_limited(&mut self, upstream: &Arc<str>, d: Duration, now: Nanos) {
        let until = now.saturating_add(d.as_nanos() as u64);
        let cfg = self.policy.upstream(upstream).cloned();
        let shared = cfg
            .as_ref()
            .filter(|c| c.shared)
            .and_then(|_| self.shared.upstream(upstream));
        match &shared {
            Some(s) => s.penalise(until),
            None => {
                let u = self.upstream_mut(upstream);
                u.penalty_until = u.penalty_until.max(until);
            }
        }
        if let Some(cfg) = &cfg {
            if let Some(spec) = cfg.bucket {
                match &shared {
                    Some(s) => {
                        s.note_429(now);
                        let (old, new) = s.update_multiplier(|m| aimd_cut(m, &cfg.aimd));
                        s.bucket
                            .rescale(now, &scaled(spec, old), &scaled(spec, new));
                    }
                    None => {
                        let u = self.upstream_mut(upstream);
                        u.last_429 = now;
                        let old = u.multiplier;
                        u.multiplier = aimd_cut(old, &cfg.aimd);
                        let new = u.multiplier;
                        u.bucket
                            .rescale(now, &scaled(spec, old), &scaled(spec, new));
                    }
                }
            }
            if let Some(a) = cfg.adaptive {
                let window = a.window.as_nanos() as u64;
                match &shared {
                    Some(s) => s.sre_record(now, window, false),
                    None => self.upstream_mut(upstream).sre.record(now, window, false),
                }
            }
        }
        // Calls queued for this upstream would only be granted into the penalty: refuse them now,
        // cheaply, with the time left on the penalty (which may be longer than this 429's own delay,
        // if another tenant's 429 started it). A zero Retry-After starts no penalty and sheds nothing.
        let left = self.penalty_until(upstream).saturating_sub(now);
        if left > 0 {
            let mut i = 0;
            while i < self.waiters.len() {
                if self.waiters[i]
                    .resolved
                    .upstreams
                    .iter()
                    .any(|(u, _)| u == upstream)
                {
                    if let Some(w) = self.waiters.remove(i) {
                        let plan = self.plan(&w.resolved);
                        let shed = self.make_shed(
                            &w.resolved,
                            Some(upstream),
                            Scope::UpstreamPenalty,
                            left,
                        );
                        let decision = self.refuse(w.resolved, &plan, shed, now);
                        self.pending.push((w.id, decision));
                    }
                } else {
                    i += 1;
                }
            }
        }
    }

    /// A non-429 answer from `upstream`: an accept for the adaptive throttle (unless overloaded) and,
    /// when healthy, an additive step back towards the configured rate.
    fn upstream_answered(
        &mut self,
        upstream: &Arc<str>,
        accepted: bool,
        healthy: bool,
        now: Nanos,
    ) {
        let Some(cfg) = self.policy.upstream(upstream).cloned() else {
            return;
        };
        let shared = if cfg.shared {
            self.shared.upstream(upstream)
        } else {
            None
        };
        if let Some(a) = cfg.adaptive {
            let window = a.window.as_nanos() as u64;
            match &shared {
                Some(s) => s.sre_record(now, window, accepted),
                None => self
                    .upstream_mut(upstream)
                    .sre
                    .record(now, window, accepted),
            }
        }
        let Some(spec) = cfg.bucket.filter(|_| healthy) else {
            return;
        };
        match &shared {
            Some(s) => {
                if s.multiplier() < 1.0 {
                    let (old, new) = s.update_multiplier(|m| aimd_recover(m, &cfg.aimd));
                    s.bucket
                        .rescale(now, &scaled(spec, old), &scaled(spec, new));
                }
            }
            None => {
                if let Some(u) = self
                    .upstreams
                    .get_mut(upstream)
                    .filter(|u| u.multiplier < 1.0)
                {
                    let old = u.multiplier;
                    u.multiplier = aimd_recover(old, &cfg.aimd);
                    let new = u.multiplier;
                    u.bucket
                        .rescale(now, &scaled(spec, old), &scaled(spec, new));
                }
            }
        }
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
            let plan = self.plan(&w.resolved);
            // The release that freed this slot may have started a penalty on the waiter's upstream.
            if let Some(shed) = self.penalty(&w.resolved, now) {
                let d = self.refuse(w.resolved, &plan, shed, now);
                out.push((w.id, d));
                continue;
            }
            self.take_slots(&w.resolved);
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
        let shed = self.concurrency_shed(&r, now);
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

    /// Whether `lease` is held and past its TTL (expired, though not yet reaped).
    pub fn lease_past_ttl(&self, lease: u64, now: Nanos) -> bool {
        self.leases.get(lease).is_some_and(|l| l.expires <= now)
    }

    /// When the next lease may expire (`None` when no lease is held): [`TenantEngine::expire_leases`]
    /// has nothing to do before then.
    pub fn next_lease_expiry(&self) -> Option<Nanos> {
        (self.next_expiry != Nanos::MAX).then_some(self.next_expiry)
    }

    /// Expires leases past their TTL, freeing their slots. Returns the expired leases' (subject, tool,
    /// upstream) and the decisions of queued calls that got a slot.
    pub fn expire_leases(
        &mut self,
        now: Nanos,
        wall_ms: i64,
    ) -> (Vec<ExpiredLease>, Vec<(u64, Decision)>) {
        let mut expired = Vec::new();
        let granted = self.expire_leases_into(now, wall_ms, &mut expired);
        (expired, granted)
    }

    /// [`TenantEngine::expire_leases`], appending the expired leases to `expired`.
    fn expire_leases_into(
        &mut self,
        now: Nanos,
        wall_ms: i64,
        expired: &mut Vec<ExpiredLease>,
    ) -> Vec<(u64, Decision)> {
        let before = expired.len();
        while let Some((at, id)) = self.expiries.peek() {
            if at > now {
                break;
            }
            self.expiries.pop();
            if self.leases.get(id).is_some_and(|l| l.expires == at) {
                if let Some(l) = self.leases.remove(id) {
                    if l.slots {
                        self.free_slots(&l.subject, now);
                        let label = l.subject_label(self.labels.as_deref());
                        expired.push((label, l.tool, primary_upstream(&l.upstreams)));
                    }
                }
            }
        }
        // Leases released early leave stale heap entries behind; rebuild when they dominate.
        if self.expiries.len() > 64 && self.expiries.len() > 4 * self.leases.len() {
            self.expiries
                .rebuild(self.leases.iter().map(|(id, l)| (l.expires, id)));
        }
        self.next_expiry = self.expiries.peek().map_or(Nanos::MAX, |(at, _)| at);
        if expired.len() == before {
            Vec::new()
        } else {
            self.grant_waiting(now, wall_ms)
        }
    }

    fn sre_window(&self, upstream: &str) -> u64 {
        self.policy.upstream(upstream).map_or(0, adaptive_window)
    }

    /// Drops per-subject and per-upstream state that is back at its resting value.
    pub fn prune(&mut self, now: Nanos, wall_ms: i64) {
        let day = utc_day(wall_ms);
        let now_s = whole_secs(now);
        self.subjects
            .retain(|s| now_s < s.keep_until_s || !s.is_resting(now, day));
        let windows: HashMap<Arc<str>, u64> = self
            .upstreams
            .keys()
            .map(|k| (k.clone(), self.sre_window(k)))
            .collect();
        self.upstreams
            .retain(|k, u| !u.is_resting(now, windows.get(k).copied().unwrap_or(0)));
        if self.quota.is_resting(day) {
            self.quota = QuotaCounter::default();
        }
    }

    /// True when nothing would be lost by dropping this engine.
    pub fn is_at_rest(&self, now: Nanos, wall_ms: i64) -> bool {
        let day = utc_day(wall_ms);
        self.leases.is_empty()
            && self.waiters.is_empty()
            && self.pending.is_empty()
            && self.inflight == 0
            && self.tenant_bucket.is_resting(now)
            && self.global_promised <= now
            && self.quota.is_resting(day)
            && self.subjects.values().all(|s| s.is_resting(now, day))
            && self
                .upstreams
                .iter()
                .all(|(k, u)| u.is_resting(now, self.sre_window(k)))
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

    /// How this tenant sees `upstream` now: configured and effective rate, throttle, fair share.
    fn upstream_view(&self, name: &Arc<str>, now: Nanos) -> Option<UpstreamSnapshot> {
        let cfg = self.policy.upstream(name)?;
        let window = adaptive_window(cfg);
        let k = cfg.adaptive.map_or(0.0, |a| a.k);
        let (multiplier, (requests, accepts), share) = if cfg.shared {
            let s = self.shared.upstream(name)?;
            let totals = if window > 0 {
                s.sre_totals(now, window)
            } else {
                (0, 0)
            };
            (s.multiplier(), totals, s.share_of(&self.tenant))
        } else {
            let u = self.upstreams.get(name);
            let totals = match u {
                Some(u) if window > 0 => u.sre.clone().totals(now, window),
                _ => (0, 0),
            };
            (u.map_or(1.0, |u| u.multiplier), totals, None)
        };
        let configured = cfg.bucket.map(|b| b.rate.per_sec);
        Some(UpstreamSnapshot {
            upstream: name.to_string(),
            shared: cfg.shared,
            published_limit: cfg.published_limit.map(|r| r.per_sec),
            reserved_for_batch: cfg.reserved_for_batch.map(|r| r.per_sec),
            configured_rate: configured,
            effective_rate: configured.map(|c| c * multiplier),
            multiplier,
            // What the throttle applies now: nothing below its minimum number of requests.
            throttle_probability: if k > 0.0
                && requests >= cfg.adaptive.map_or(0, |a| a.min_requests)
            {
                super::adaptive::throttle_probability(requests, accepts, k)
            } else {
                0.0
            },
            requests,
            accepts,
            fair_share: share.map(|s| s.rate),
        })
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
        let mut subjects: Vec<_> = self.subjects.values().collect();
        subjects.sort_by(|a, b| a.name.cmp(&b.name));
        let mut subject_snaps = Vec::new();
        for s in &subjects {
            let name = &s.name;
            buckets.push(bucket(
                Layer::Subject,
                name.to_string(),
                &p.subject_g,
                &s.bucket,
            ));
            for (tool, b) in s.tools() {
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
                quota_used: s.quota_used_on(day),
            });
        }
        let mut penalties = Vec::new();
        let mut upstreams = Vec::new();
        let mut ups: Vec<_> = self.upstreams.iter().collect();
        ups.sort_by(|a, b| a.0.cmp(b.0));
        for (name, u) in ups {
            let shared = self.is_shared_upstream(Some(name));
            if let Some(spec) = p.upstream(name).and_then(|x| x.bucket) {
                if !shared {
                    buckets.push(bucket(
                        Layer::TenantUpstream,
                        name.to_string(),
                        &scaled(spec, u.multiplier),
                        &u.bucket,
                    ));
                }
            }
            if u.penalty_until > now && !shared {
                penalties.push(PenaltySnapshot {
                    upstream: name.to_string(),
                    shared: false,
                    retry_after_ms: ceil_ms(u.penalty_until - now),
                });
            }
            if !shared {
                upstreams.extend(self.upstream_view(name, now));
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
            upstreams.extend(self.upstream_view(&name, now));
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
            upstreams,
        }
    }

    /// Gauges for telemetry: in-flight calls, how full each bucket layer is, penalties, quota and the
    /// effective rate and throttle of each per-tenant upstream.
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
        let mut rates = Vec::new();
        for (name, u) in &self.upstreams {
            if self.is_shared_upstream(Some(name)) {
                continue;
            }
            if let Some(spec) = p.upstream(name).and_then(|c| c.bucket) {
                upstream = upstream.max(used(&scaled(spec, u.multiplier), &u.bucket));
            }
            if u.penalty_until > now {
                penalties.push((
                    name.clone(),
                    (u.penalty_until - now) as f64 / NS_PER_SEC as f64,
                ));
            }
            if let Some(v) = self.upstream_view(name, now) {
                if let (Some(effective_rate), Some(configured_rate)) =
                    (v.effective_rate, v.configured_rate)
                {
                    rates.push(UpstreamGauge {
                        upstream: name.clone(),
                        effective_rate,
                        configured_rate,
                        throttle_probability: v.throttle_probability,
                    });
                }
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
            upstream_rates: rates,
            quota_used: p.limits.tenant.daily_quota.map(|_| self.quota.used_on(day)),
            quota_limit: p.limits.tenant.daily_quota,
        }
    }

    pub fn has_state(&self, now: Nanos, wall_ms: i64) -> bool {
        !self.is_at_rest(now, wall_ms) || !self.subjects.is_empty()
    }
}

/// The rate gauges of one per-tenant upstream budget.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamGauge {
    pub upstream: Arc<str>,
    pub effective_rate: f64,
    pub configured_rate: f64,
    pub throttle_probability: f64,
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
    /// (upstream, effective rate per second, adaptive throttle probability), per-tenant upstreams.
    pub upstream_rates: Vec<UpstreamGauge>,
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

/// An upstream's adaptive state as this tenant sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct UpstreamSnapshot {
    pub upstream: String,
    pub shared: bool,
    pub published_limit: Option<f64>,
    pub reserved_for_batch: Option<f64>,
    /// The budget's configured (or derived) rate per second.
    pub configured_rate: Option<f64>,
    /// The rate after AIMD cuts.
    pub effective_rate: Option<f64>,
    pub multiplier: f64,
    /// The adaptive throttle's current local refusal probability.
    pub throttle_probability: f64,
    /// Requests and accepts in the adaptive throttle's window.
    pub requests: u64,
    pub accepts: u64,
    /// This tenant's fair share (per second) of a contended shared upstream.
    pub fair_share: Option<f64>,
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
    /// Effective rates, adaptive throttling and fair shares per upstream.
    pub upstreams: Vec<UpstreamSnapshot>,
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
mod name_set {
    use super::*;
    use crate::engine::test_support::{call, harness};

    fn set_len() -> usize {
        NAME_SET.with(|s| s.borrow().len())
    }

    #[test]
    fn tenants_on_one_thread_share_the_names_of_tools_and_upstreams() {
        let (_clock, cfg, shared) = harness("", 0);
        let mut a = TenantEngine::new(Arc::from("a"), cfg.clone(), shared.clone(), 1);
        let mut b = TenantEngine::new(Arc::from("b"), cfg, shared, 2);
        let mut req = call("s", "search");
        req.upstream = Some("warehouse".into());
        let (ra, rb) = (a.resolve(&req), b.resolve(&req));
        assert!(Arc::ptr_eq(&ra.tool, &rb.tool));
        assert!(Arc::ptr_eq(&ra.upstreams[0].0, &rb.upstreams[0].0));
        assert_eq!((&*ra.tool, &*ra.upstreams[0].0), ("search", "warehouse"));
        // Another thread keeps a set of its own.
        let there = std::thread::spawn(|| intern("search")).join().unwrap();
        assert!(!Arc::ptr_eq(&there, &ra.tool));
        assert_eq!(&*there, "search");
    }

    #[test]
    fn the_set_is_bounded_and_names_in_use_outlive_it() {
        let kept = intern("kept-name");
        assert!(Arc::ptr_eq(&kept, &intern("kept-name")));
        for i in 0..NAMES {
            intern(&format!("name-{i}"));
            assert!(set_len() <= NAMES);
        }
        // The set started over on the way: the name in use is still whole, and a new copy is made.
        assert_eq!(&*kept, "kept-name");
        assert!(!Arc::ptr_eq(&kept, &intern("kept-name")));
        assert!(set_len() <= NAMES);
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
