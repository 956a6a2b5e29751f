//! The metrics actor: decision events into Prometheus series, plus the refusal log.
//!
//! It runs on the telemetry arbiter, away from the workers, so recording (label capping, registry
//! lookups, formatting log lines) never adds to an admission's latency. Label values pass through
//! [`LabelCap`] first, so the number of series stays bounded; what a decision records into is then
//! remembered under its raw labels (the index in `rawindex.rs`), where a batch of decisions is looked up
//! in stages that prefetch for each other. The series recorded on every decision (the admissions
//! counter and the histograms) are admitd's own ([`super::histogram`]); the other counters and the
//! gauges go to the Prometheus exporter.
//!
//! The refusal log writes one JSON line per shed (target `admitd::refusal`: scope, tool, upstream,
//! tenant, hashed subject, cost, `retry_after_ms`, `call_id`), throttled by a token bucket of
//! `refusal_log_per_sec` so a looping agent cannot flood the log; lines it drops are counted in
//! `admitd_refusal_logs_suppressed_total` and summarised once a second.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{counter, gauge, Counter, Gauge};

use super::histogram::{Histogram, Histograms};
use super::labels::LabelCap;
use super::names::*;
use super::rawindex::{RawIndex, RawRef};
use super::{
    hash_identity, Batch, DecisionEvent, DecisionKind, Event, ExpiredLease, TenantEvent, Throttle,
};
use crate::clock::{Clock, NS_PER_SEC};
use crate::config::TelemetryConfig;
use crate::engine::Scope;
use crate::prefetch::prefetch;

/// The (capped) labels of an admission series.
type AdmissionKey = (
    Arc<str>,
    Arc<str>,
    Arc<str>,
    Arc<str>,
    DecisionKind,
    Option<Scope>,
);

/// Everything a decision with a given [`RawKey`] records into.
struct DecisionSeries {
    admissions: Arc<AtomicU64>,
    /// Admission wait, for admitted (and shadow-shed) calls.
    wait: Option<Arc<Histogram>>,
    /// Retry-After handed out, for sheds.
    retry: Option<Arc<Histogram>>,
}

/// The (capped) labels of a tool-duration series: tenant, tool, upstream.
type ToolKey = (Arc<str>, Arc<str>, Arc<str>);

/// The (capped) labels of a lease-expiry series: tenant, subject, tool, upstream.
type CallKey = (Arc<str>, Arc<str>, Arc<str>, Arc<str>);

impl DecisionSeries {
    /// Starts loading what [`DecisionSeries::record`] will touch.
    fn prefetch(&self) {
        prefetch(Arc::as_ptr(&self.admissions));
        if let Some(h) = &self.wait {
            prefetch(Arc::as_ptr(h));
        }
        if let Some(h) = &self.retry {
            prefetch(Arc::as_ptr(h));
        }
    }

    fn record(&self, d: &DecisionEvent) {
        self.admissions.fetch_add(1, Ordering::Relaxed);
        if let Some(h) = &self.wait {
            h.record(d.waited_ns as f64 / NS_PER_SEC as f64);
        }
        if let (Some(h), true) = (&self.retry, d.retryable) {
            h.record(d.retry_after_ms as f64 / 1000.0);
        }
    }
}

/// A call's label values after capping.
struct Labels {
    tenant: Arc<str>,
    subject: Arc<str>,
    tool: Arc<str>,
    upstream: Arc<str>,
}

/// Series handles by label values. Looking a handle up here costs one hash of the names; going through
/// the registry would cost label allocation and a registry lookup on every event. The caps bound the
/// number of series, and so these maps; past [`HANDLE_CACHE`] entries a map is cleared anyway.
type Handles<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
const HANDLE_CACHE: usize = 100_000;

pub struct MetricsActor {
    /// By raw labels: the fast path. Misses go through the label caps and the caches by capped
    /// labels below, so a flood of distinct names (all folded into `__other__`) still finds its
    /// series without a registry lookup.
    decisions: RawIndex<DecisionSeries>,
    /// Per-batch scratch: each decision's hash and raw labels, and where it was found.
    batch_keys: Vec<u64>,
    batch_found: Vec<Option<usize>>,
    admissions: Handles<AdmissionKey, Arc<AtomicU64>>,
    waits: Handles<(Arc<str>, Arc<str>), Arc<Histogram>>,
    retries: Handles<(Arc<str>, Scope), Arc<Histogram>>,
    tool_durations: Handles<ToolKey, Arc<Histogram>>,
    /// `admitd_upstream_responses_total` by (tenant, upstream, status) label.
    responses: Handles<(Arc<str>, Arc<str>, u16), Counter>,
    /// `admitd_lease_expiries_total` by (tenant, subject, tool, upstream) label.
    lease_expiries: Handles<CallKey, Counter>,
    /// The same counters by the labels as sent: the fast path, as for decisions.
    expiries_raw: RawIndex<Counter>,
    /// Scratch for [`MetricsActor::leases_expired`], kept to reuse its memory.
    expiry_keys: Vec<u64>,
    decision_hist: Arc<Histogram>,
    histograms: Arc<Histograms>,
    caps: LabelCap,
    /// The label of calls without an upstream.
    none: Arc<str>,
    clock: Arc<dyn Clock>,
    throttle: Throttle,
    suppressed_total: u64,
    suppressed_recent: u64,
    /// Each tenant label's gauges (set once a second per tenant: a handle is one store, a registry
    /// lookup builds, hashes and compares the labels).
    tenant_gauges: HashMap<Arc<str>, TenantGauges>,
    /// Upstreams with a penalty gauge set, per tenant label, to zero them when the penalty ends.
    penalties: HashMap<Arc<str>, Vec<Arc<str>>>,
    /// Per-tenant upstream rate series set, with their configured rates, to reset them when dropped.
    upstream_rates: HashMap<Arc<str>, Vec<(Arc<str>, f64)>>,
    /// The advice recording (`[advice] enabled`), fed from the same batches.
    advice: Option<Box<super::advice::Recorder>>,
}

/// The gauges a tenant actor's report sets.
struct TenantGauges {
    inflight: Gauge,
    waiting: Gauge,
    tenant_utilization: Gauge,
    subject_utilization: Gauge,
    upstream_utilization: Gauge,
    /// Used and limit; registered when the tenant first reports a daily quota.
    quota: Option<(Gauge, Gauge)>,
    /// Registered when the tenant first reports a task.
    tasks: Option<Gauge>,
    /// Per spend unit with a tenant daily budget: what is left and the budget.
    spend: Vec<(Arc<str>, Gauge, Gauge)>,
    /// Per spend unit this tenant settled spend in: its `admitd_spend_total` series.
    spend_total: Vec<(Arc<str>, crate::telemetry::histogram::Sum)>,
}

impl TenantGauges {
    fn of(t: &str) -> Self {
        let util = |layer: &'static str| gauge!(BUCKET_UTILIZATION, "tenant" => t.to_string(), "layer" => layer);
        TenantGauges {
            inflight: gauge!(INFLIGHT, "tenant" => t.to_string()),
            waiting: gauge!(WAITING, "tenant" => t.to_string()),
            tenant_utilization: util("tenant"),
            subject_utilization: util("subject"),
            upstream_utilization: util("tenant_upstream"),
            quota: None,
            tasks: None,
            spend: Vec::new(),
            spend_total: Vec::new(),
        }
    }
}

impl MetricsActor {
    pub fn new(cfg: &TelemetryConfig, clock: Arc<dyn Clock>, histograms: Arc<Histograms>) -> Self {
        gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        counter!(REFUSAL_LOGS_SUPPRESSED).absolute(0);
        MetricsActor {
            decisions: RawIndex::default(),
            batch_keys: Vec::new(),
            batch_found: Vec::new(),
            admissions: Handles::default(),
            waits: Handles::default(),
            retries: Handles::default(),
            tool_durations: Handles::default(),
            responses: Handles::default(),
            lease_expiries: Handles::default(),
            expiries_raw: RawIndex::default(),
            expiry_keys: Vec::new(),
            decision_hist: histograms.decision.series(&[]),
            histograms,
            caps: LabelCap::default(),
            none: Arc::from(NO_UPSTREAM),
            clock,
            throttle: Throttle::new(cfg.refusal_log_per_sec),
            suppressed_total: 0,
            suppressed_recent: 0,
            tenant_gauges: HashMap::new(),
            penalties: HashMap::new(),
            upstream_rates: HashMap::new(),
            advice: None,
        }
    }

    /// Keeps the advice recording too.
    pub fn with_advice(mut self, recorder: super::advice::Recorder) -> Self {
        self.advice = Some(Box::new(recorder));
        self
    }

    pub(super) fn advice(&mut self) -> Option<&mut super::advice::Recorder> {
        self.advice.as_deref_mut()
    }

    fn upstream_label(&mut self, upstream: Option<&Arc<str>>) -> Arc<str> {
        match upstream {
            Some(u) => self.caps.upstream(u),
            None => self.none.clone(),
        }
    }

    fn set_penalties(&mut self, tenant: Arc<str>, now_set: Vec<(Arc<str>, f64)>) {
        let before = self.penalties.remove(&tenant).unwrap_or_default();
        for up in before
            .iter()
            .filter(|u| !now_set.iter().any(|(n, _)| n == *u))
        {
            gauge!(UPSTREAM_PENALTY, "tenant" => tenant.to_string(), "upstream" => up.to_string())
                .set(0.0);
        }
        for (up, secs) in &now_set {
            gauge!(UPSTREAM_PENALTY, "tenant" => tenant.to_string(), "upstream" => up.to_string())
                .set(*secs);
        }
        if !now_set.is_empty() {
            self.penalties
                .insert(tenant, now_set.into_iter().map(|(u, _)| u).collect());
        }
    }

    /// The series handle for a decision's labels, from the cache or (first time) the registry.
    fn admission_counter(&mut self, d: &DecisionEvent, labels: &Labels) -> Arc<AtomicU64> {
        let key: AdmissionKey = (
            labels.tenant.clone(),
            labels.subject.clone(),
            labels.tool.clone(),
            labels.upstream.clone(),
            d.kind,
            d.scope,
        );
        if let Some(c) = self.admissions.get(&key) {
            return c.clone();
        }
        let c = self.histograms.admissions.series(&[
            &labels.tenant,
            &labels.subject,
            &labels.tool,
            &labels.upstream,
            d.kind.as_str(),
            d.scope.map_or("none", |s| s.as_str()),
        ]);
        if self.admissions.len() >= HANDLE_CACHE {
            self.admissions.clear();
        }
        self.admissions.insert(key, c.clone());
        c
    }

    fn wait_hist(&mut self, labels: &Labels) -> Arc<Histogram> {
        let key = (labels.tenant.clone(), labels.tool.clone());
        if let Some(h) = self.waits.get(&key) {
            return h.clone();
        }
        let h = self.histograms.wait.series(&[&labels.tenant, &labels.tool]);
        if self.waits.len() >= HANDLE_CACHE {
            self.waits.clear();
        }
        self.waits.insert(key, h.clone());
        h
    }

    fn retry_hist(&mut self, labels: &Labels, scope: Scope) -> Arc<Histogram> {
        let key = (labels.tenant.clone(), scope);
        if let Some(h) = self.retries.get(&key) {
            return h.clone();
        }
        let h = self
            .histograms
            .retry
            .series(&[&labels.tenant, scope.as_str()]);
        if self.retries.len() >= HANDLE_CACHE {
            self.retries.clear();
        }
        self.retries.insert(key, h.clone());
        h
    }

    /// The series a decision records into, through the label caps (the slow path: callers look in
    /// `decisions` first), remembered under the decision's raw labels: its entry in `decisions`.
    fn decision_series(&mut self, d: &DecisionEvent, hash: u64, raw: &RawRef<'_>) -> usize {
        let (tenant, subject, tool) = self.caps.call(&d.tenant, &d.subject_label, &d.tool);
        let labels = Labels {
            tenant,
            subject,
            tool,
            upstream: self.upstream_label(d.upstream.as_ref()),
        };
        let series = DecisionSeries {
            admissions: self.admission_counter(d, &labels),
            wait: (d.kind != DecisionKind::Shed).then(|| self.wait_hist(&labels)),
            retry: match (d.kind, d.scope) {
                (DecisionKind::Shed, Some(s)) => Some(self.retry_hist(&labels, s)),
                _ => None,
            },
        };
        self.decisions.insert(hash, raw.to_key(), series)
    }

    fn tool_hist(
        &mut self,
        tenant: Arc<str>,
        tool: Arc<str>,
        upstream: Arc<str>,
    ) -> Arc<Histogram> {
        let key = (tenant, tool, upstream);
        if let Some(h) = self.tool_durations.get(&key) {
            return h.clone();
        }
        let h = self.histograms.tool.series(&[&key.0, &key.1, &key.2]);
        if self.tool_durations.len() >= HANDLE_CACHE {
            self.tool_durations.clear();
        }
        self.tool_durations.insert(key, h.clone());
        h
    }

    /// Counts the expiries of one tenant's leases. A server that stops releasing expires every lease
    /// it holds, so this runs once per admission: each lease is looked up by its labels as sent,
    /// in stages like a batch of decisions, and only the first expiry with given labels goes
    /// through the label caps.
    fn leases_expired(&mut self, tenant: &Arc<str>, leases: &[ExpiredLease]) {
        if self.expiries_raw.len() + leases.len() > HANDLE_CACHE {
            self.expiries_raw.clear();
        }
        let mut keys = std::mem::take(&mut self.expiry_keys);
        keys.clear();
        fn raw<'a>(tenant: &'a str, (subject, tool, upstream): &'a ExpiredLease) -> RawRef<'a> {
            RawRef::call(tenant, subject, tool, upstream.as_deref())
        }
        for lease in leases {
            let hash = self.expiries_raw.hash(&raw(tenant, lease));
            self.expiries_raw.prefetch_slot(hash);
            keys.push(hash);
        }
        for hash in &keys {
            self.expiries_raw.prefetch_entry(*hash);
        }
        for (hash, lease) in keys.iter().zip(leases) {
            let raw = raw(tenant, lease);
            let entry = if let Some(e) = self.expiries_raw.find(*hash, &raw) {
                e
            } else {
                let c = self.lease_expiry_counter(tenant, lease);
                self.expiries_raw.insert(*hash, raw.to_key(), c)
            };
            self.expiries_raw.get(entry).increment(1);
        }
        self.expiry_keys = keys;
    }

    /// The `admitd_lease_expiries_total` counter of an expired lease's call, by its capped labels
    /// (the slow path of [`MetricsActor::leases_expired`]). The handles are kept by capped labels,
    /// which the caps bound: building the labels and looking each one up in the registry held the
    /// telemetry thread (and so the core it shares) for hundreds of microseconds at every tick.
    fn lease_expiry_counter(&mut self, tenant: &Arc<str>, lease: &ExpiredLease) -> Counter {
        let (t, s, tool) = self.caps.call(tenant, &lease.0, &lease.1);
        let key = (t, s, tool, self.upstream_label(lease.2.as_ref()));
        if let Some(c) = self.lease_expiries.get(&key) {
            return c.clone();
        }
        let c = counter!(
            LEASE_EXPIRIES,
            "tenant" => key.0.to_string(),
            "subject" => key.1.to_string(),
            "tool" => key.2.to_string(),
            "upstream" => key.3.to_string(),
        );
        if self.lease_expiries.len() >= HANDLE_CACHE {
            self.lease_expiries.clear();
        }
        self.lease_expiries.insert(key, c.clone());
        c
    }

    /// Counts an upstream response reported on release or feedback.
    fn upstream_response(&mut self, tenant: Arc<str>, upstream: Arc<str>, status: u16) {
        let key = (tenant, upstream, status);
        if let Some(c) = self.responses.get(&key) {
            c.increment(1);
            return;
        }
        let c = counter!(UPSTREAM_RESPONSES, "tenant" => key.0.to_string(), "upstream" => key.1.to_string(), "status" => status.to_string());
        c.increment(1);
        if self.responses.len() >= HANDLE_CACHE {
            self.responses.clear();
        }
        self.responses.insert(key, c);
    }

    /// Records a decision whose raw labels `raw` (hashing to `hash`) were looked up as `found`.
    fn record_decision(
        &mut self,
        d: &DecisionEvent,
        hash: u64,
        raw: &RawRef<'_>,
        found: Option<usize>,
    ) {
        // Not found may be stale: the same labels may have come earlier in this batch.
        let entry = match found.or_else(|| self.decisions.find(hash, raw)) {
            Some(e) => e,
            None => self.decision_series(d, hash, raw),
        };
        self.decisions.get(entry).record(d);
        if d.unchecked {
            // Only while the store is down and `fail_open` admits: rare, so the registry's lookup
            // is fine here.
            metrics::counter!(super::names::UNCHECKED_ADMISSIONS, "tenant" => d.tenant.to_string())
                .increment(1);
        }
        let scope = d.scope.map_or("none", |s| s.as_str());
        self.decision_hist
            .record(d.decision_ns as f64 / NS_PER_SEC as f64);
        if d.kind != DecisionKind::Admitted {
            if self.throttle.allow(self.clock.mono()) {
                tracing::info!(
                    target: "admitd::refusal",
                    decision = d.kind.as_str(),
                    scope,
                    tenant = %d.tenant,
                    subject_hash = %hash_identity(&d.subject),
                    tool = %d.tool,
                    upstream = d.upstream.as_deref().unwrap_or(NO_UPSTREAM),
                    cost = d.cost,
                    retry_after_ms = d.retry_after_ms,
                    retryable = d.retryable,
                    call_id = d.call_id.as_deref().unwrap_or(""),
                    "call refused"
                );
            } else {
                self.suppressed_total += 1;
                self.suppressed_recent += 1;
            }
        } else {
            // One line per admitted call, for operators who follow calls by their `call_id`: off
            // unless asked for (`ADMITD_LOG=info,admitd::admission=debug`); nothing here is
            // evaluated when it is off.
            tracing::debug!(
                target: "admitd::admission",
                tenant = %d.tenant,
                subject_hash = %hash_identity(&d.subject),
                tool = %d.tool,
                upstream = d.upstream.as_deref().unwrap_or(NO_UPSTREAM),
                cost = d.cost,
                waited_ms = crate::clock::ceil_ms(d.waited_ns),
                call_id = d.call_id.as_deref().unwrap_or(""),
                "call admitted"
            );
        }
    }

    /// Records an event other than a decision.
    fn record_other(&mut self, ev: &Event) {
        match ev {
            Event::Decision(_) => {}
            Event::Release(r) => {
                // A call without an upstream counts under the upstream label `none`.
                let status = r
                    .upstream_status
                    .or((r.outcome == "upstream_rate_limited").then_some(429));
                if status.is_none() && r.duration_ms.is_none() {
                    // Nothing to count (and no label to look up).
                    return;
                }
                let (tenant, _, tool) = self.caps.call(&r.tenant, &r.subject, &r.tool);
                let upstream = self.upstream_label(r.upstream.as_ref());
                if let Some(status) = status {
                    self.upstream_response(tenant.clone(), upstream.clone(), status);
                }
                if let Some(ms) = r.duration_ms {
                    self.tool_hist(tenant, tool, upstream)
                        .record(ms as f64 / 1000.0);
                }
            }
            Event::Feedback(f) => {
                let tenant = self.caps.tenant(&f.tenant);
                let upstream = self.caps.upstream(&f.upstream);
                self.upstream_response(tenant, upstream, f.status);
            }
            Event::Tenant(t) => match &**t {
                TenantEvent::LeasesExpired { tenant, leases } => {
                    self.leases_expired(tenant, leases);
                }
                TenantEvent::Gauges { tenant, gauges, .. } => {
                    let tenant = self.caps.tenant(tenant);
                    let g = self
                        .tenant_gauges
                        .entry(tenant.clone())
                        .or_insert_with(|| TenantGauges::of(&tenant));
                    g.inflight.set(f64::from(gauges.inflight));
                    g.waiting.set(gauges.waiting as f64);
                    g.tenant_utilization.set(gauges.tenant_utilization);
                    g.subject_utilization.set(gauges.subject_utilization);
                    g.upstream_utilization.set(gauges.upstream_utilization);
                    if let (Some(used), Some(limit)) = (gauges.quota_used, gauges.quota_limit) {
                        let (u, l) = g.quota.get_or_insert_with(|| {
                            (
                                gauge!(DAILY_QUOTA_USED, "tenant" => tenant.to_string()),
                                gauge!(DAILY_QUOTA_LIMIT, "tenant" => tenant.to_string()),
                            )
                        });
                        u.set(used);
                        l.set(limit);
                    }
                    // A tenant that never ran a task has no series (most tenants never do).
                    if gauges.tasks > 0 || g.tasks.is_some() {
                        g.tasks
                            .get_or_insert_with(
                                || gauge!(TASKS_INFLIGHT, "tenant" => tenant.to_string()),
                            )
                            .set(gauges.tasks as f64);
                    }
                    for (unit, left, budget) in gauges.spend_daily_left() {
                        let i = match g.spend.iter().position(|(u, _, _)| u == unit) {
                            Some(i) => i,
                            None => {
                                let labels =
                                    [("tenant", tenant.to_string()), ("unit", unit.to_string())];
                                g.spend.push((
                                    unit.clone(),
                                    gauge!(SPEND_DAILY_REMAINING, &labels),
                                    gauge!(SPEND_DAILY_BUDGET, &labels),
                                ));
                                g.spend.len() - 1
                            }
                        };
                        g.spend[i].1.set(left);
                        g.spend[i].2.set(budget);
                    }
                    for (unit, x) in &gauges.spend_settled {
                        let i = match g.spend_total.iter().position(|(u, _)| u == unit) {
                            Some(i) => i,
                            None => {
                                let sum = self.histograms.spend.series(&[&tenant, unit]);
                                g.spend_total.push((unit.clone(), sum));
                                g.spend_total.len() - 1
                            }
                        };
                        g.spend_total[i].1.add(*x);
                    }
                    // A budget whose state was dropped (or whose tenant stopped) is back at its
                    // configured rate with no throttle: say so rather than freeze the last value.
                    let before = self.upstream_rates.remove(&tenant).unwrap_or_default();
                    let mut now_set = Vec::new();
                    for g in &gauges.upstream_rates {
                        let up = self.caps.upstream(&g.upstream);
                        gauge!(UPSTREAM_EFFECTIVE_RATE, "tenant" => tenant.to_string(), "upstream" => up.to_string()).set(g.effective_rate);
                        gauge!(UPSTREAM_THROTTLE, "tenant" => tenant.to_string(), "upstream" => up.to_string()).set(g.throttle_probability);
                        now_set.push((up, g.configured_rate));
                    }
                    for (up, configured) in before
                        .iter()
                        .filter(|(u, _)| !now_set.iter().any(|(n, _)| n == u))
                    {
                        gauge!(UPSTREAM_EFFECTIVE_RATE, "tenant" => tenant.to_string(), "upstream" => up.to_string()).set(*configured);
                        gauge!(UPSTREAM_THROTTLE, "tenant" => tenant.to_string(), "upstream" => up.to_string()).set(0.0);
                    }
                    if !now_set.is_empty() {
                        self.upstream_rates.insert(tenant.clone(), now_set);
                    }
                    let penalties = gauges
                        .penalties
                        .iter()
                        .map(|(u, s)| (self.caps.upstream(u), *s))
                        .collect();
                    self.set_penalties(tenant, penalties);
                }
                TenantEvent::Global {
                    tenants,
                    global_utilization,
                    shared_penalties,
                    shared_rates,
                } => {
                    gauge!(TENANT_ACTORS).set(*tenants as f64);
                    gauge!(GLOBAL_UTILIZATION).set(*global_utilization);
                    for (up, rate, p) in shared_rates {
                        gauge!(UPSTREAM_EFFECTIVE_RATE, "tenant" => SHARED_TENANT, "upstream" => up.to_string()).set(*rate);
                        gauge!(UPSTREAM_THROTTLE, "tenant" => SHARED_TENANT, "upstream" => up.to_string()).set(*p);
                    }
                    self.set_penalties(Arc::from(SHARED_TENANT), shared_penalties.clone());
                }
                TenantEvent::TaskStarted { tenant } => {
                    let tenant = self.caps.tenant(tenant);
                    counter!(TASKS_STARTED, "tenant" => tenant.to_string()).increment(1);
                }
                TenantEvent::TaskPolled { tenant, admitted } => {
                    let tenant = self.caps.tenant(tenant);
                    let decision = if *admitted { "admitted" } else { "refused" };
                    counter!(TASK_POLLS, "tenant" => tenant.to_string(), "decision" => decision)
                        .increment(1);
                }
                // For the alerts only.
                TenantEvent::Calls { .. } => {}
            },
        }
    }

    fn reconfigure(&mut self, cfg: &TelemetryConfig) {
        // The subject label caps are the tenant actors' (`SubjectLabels`): events come with their
        // subject's label decided, and the indexes are keyed by it.
        self.throttle = Throttle::new(cfg.refusal_log_per_sec);
    }

    fn tick(&mut self) {
        counter!(REFUSAL_LOGS_SUPPRESSED).absolute(self.suppressed_total);
        if self.suppressed_recent > 0 {
            tracing::info!(target: "admitd::refusal", suppressed = self.suppressed_recent, "refusal log lines suppressed in the last second (rate limited)");
            self.suppressed_recent = 0;
        }
    }
}

impl Actor for MetricsActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(super::MAILBOX);
        ctx.run_interval(Duration::from_secs(1), |act, _| act.tick());
    }
}

impl Handler<Batch> for MetricsActor {
    type Result = ();

    fn handle(&mut self, batch: Batch, _: &mut Context<Self>) {
        self.record_batch(&batch.0);
        if let Some(a) = &mut self.advice {
            a.record_batch(&batch.0);
        }
    }
}

/// How many events ahead of the one being hashed [`MetricsActor::record_batch`] prefetches names.
const NAMES_AHEAD: usize = 8;

fn prefetch_names(d: &DecisionEvent) {
    prefetch(d.tenant.as_ptr());
    prefetch(d.subject_label.as_ptr());
    prefetch(d.tool.as_ptr());
    if let Some(u) = &d.upstream {
        prefetch(u.as_ptr());
    }
}

impl MetricsActor {
    fn record_batch(&mut self, events: &[Event]) {
        // Entry numbers stay valid until the index is cleared, so it is cleared only between batches.
        if self.decisions.len() >= HANDLE_CACHE {
            self.decisions.clear();
        }
        // Look the batch's decisions up in stages, each asking for the memory the next one reads
        // (slot, entry, then the counter and histogram), so that their cache misses overlap.
        let mut keys = std::mem::take(&mut self.batch_keys);
        let mut found = std::mem::take(&mut self.batch_found);
        keys.clear();
        found.clear();
        let decisions = || {
            events.iter().filter_map(|ev| match ev {
                Event::Decision(d) => Some(d),
                _ => None,
            })
        };
        // Hashing reads each event's names, which live apart from the event (the tenant's, the
        // subject's and the tool's shared strings), so they are asked for a few events ahead.
        let mut ahead = decisions();
        ahead.by_ref().take(NAMES_AHEAD).for_each(prefetch_names);
        for d in decisions() {
            if let Some(a) = ahead.next() {
                prefetch_names(a);
            }
            let hash = self.decisions.hash(&RawRef::of(d));
            self.decisions.prefetch_slot(hash);
            keys.push(hash);
        }
        for hash in &keys {
            self.decisions.prefetch_entry(*hash);
        }
        for (hash, d) in keys.iter().zip(decisions()) {
            let f = self.decisions.find(*hash, &RawRef::of(d));
            if let Some(e) = f {
                self.decisions.get(e).prefetch();
            }
            found.push(f);
        }
        let mut next = 0;
        for ev in events {
            match ev {
                Event::Decision(d) => {
                    self.record_decision(d, keys[next], &RawRef::of(d), found[next]);
                    next += 1;
                }
                other => self.record_other(other),
            }
        }
        self.batch_keys = keys;
        self.batch_found = found;
    }
}

/// Reconfigure label caps and the refusal log rate (reload).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetTelemetry(pub TelemetryConfig);

impl Handler<super::Settle> for MetricsActor {
    type Result = ();

    /// Everything sent before is recorded by now: a scrape may render.
    fn handle(&mut self, _: super::Settle, _: &mut Context<Self>) {}
}

impl Handler<SetTelemetry> for MetricsActor {
    type Result = ();
    fn handle(&mut self, msg: SetTelemetry, _: &mut Context<Self>) {
        self.reconfigure(&msg.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use crate::config::Config;
    use crate::telemetry::series_value as value;
    use crate::telemetry::ReleaseEvent;

    fn decision(tenant: &str, subject: &str, kind: DecisionKind) -> Event {
        labelled(tenant, subject, subject, kind)
    }

    /// A decision whose subject the tenant actor labelled `label`.
    fn labelled(tenant: &str, subject: &str, label: &str, kind: DecisionKind) -> Event {
        Event::Decision(DecisionEvent {
            tenant: Arc::from(tenant),
            subject: Arc::from(subject),
            subject_label: Arc::from(label),
            tool: Arc::from("search"),
            upstream: None,
            cost: 1.0,
            kind,
            scope: (kind == DecisionKind::Shed).then_some(Scope::Subject),
            retryable: kind == DecisionKind::Shed,
            waited_ns: 2_000_000,
            retry_after_ms: 1500,
            decision_ns: 30_000,
            call_id: None,
            lease: 0,
            unchecked: false,
            span: None,
        })
    }

    #[test]
    fn decisions_count_into_the_series_of_their_labels() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let histograms = Arc::new(Histograms::default());
        let cfg = Config::default().telemetry;
        metrics::with_local_recorder(&recorder, || {
            let clock = Arc::new(FakeClock::new(0));
            let mut m = MetricsActor::new(&cfg, clock, histograms.clone());
            // One batch, with labels new to the index coming twice in it; bob came past a cap of
            // one subject.
            m.record_batch(&[
                decision("acme", "alice", DecisionKind::Admitted),
                decision("acme", "alice", DecisionKind::Admitted),
                labelled("acme", "bob", "__other__", DecisionKind::Admitted),
                decision("acme", "alice", DecisionKind::Shed),
            ]);
            assert_eq!(m.decisions.len(), 3, "one entry per distinct raw labels");
            m.record_batch(&[decision("acme", "alice", DecisionKind::Admitted)]);
            assert_eq!(m.decisions.len(), 3);
            // ... and got his name when a reload raised the cap.
            m.record_batch(&[decision("acme", "bob", DecisionKind::Admitted)]);
        });
        let mut text = handle.render();
        histograms.render(&mut text);
        let series = |subject: &str, decision: &str, scope: &str| {
            format!(
                "admitd_admissions_total{{tenant=\"acme\",subject=\"{subject}\",tool=\"search\",upstream=\"none\",decision=\"{decision}\",scope=\"{scope}\"}}"
            )
        };
        assert_eq!(
            value(&text, &series("alice", "admitted", "none")),
            Some(3.0),
            "{text}"
        );
        assert_eq!(
            value(&text, &series("alice", "shed", "subject")),
            Some(1.0),
            "{text}"
        );
        // bob came past the cap of one subject, then got his name when the cap was raised
        assert_eq!(
            value(&text, &series("__other__", "admitted", "none")),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            value(&text, &series("bob", "admitted", "none")),
            Some(1.0),
            "{text}"
        );
        let wait =
            "admitd_admission_wait_seconds_bucket{tenant=\"acme\",tool=\"search\",le=\"0.005\"}";
        assert_eq!(value(&text, wait), Some(5.0), "{text}");
        let retry = "admitd_retry_after_seconds_count{tenant=\"acme\",scope=\"subject\"}";
        assert_eq!(value(&text, retry), Some(1.0), "{text}");
        assert_eq!(
            value(&text, "admitd_decision_duration_seconds_count"),
            Some(6.0),
            "{text}"
        );
    }

    #[test]
    fn upstream_responses_of_calls_without_an_upstream_count_under_none() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let cfg = Config::default().telemetry;
        let release = |upstream: Option<&str>, outcome: &'static str, status: Option<u16>| {
            Event::Release(Arc::new(ReleaseEvent {
                released_unix_ns: 0,
                tenant: Arc::from("acme"),
                subject: Arc::from("alice"),
                tool: Arc::from("search"),
                upstream: upstream.map(Arc::from),
                outcome,
                upstream_status: status,
                retry_after: None,
                penalty_ms: None,
                duration_ms: None,
                lease: 1,
            }))
        };
        metrics::with_local_recorder(&recorder, || {
            let clock = Arc::new(FakeClock::new(0));
            let mut m = MetricsActor::new(&cfg, clock, Arc::new(Histograms::default()));
            m.record_batch(&[
                release(None, "ok", Some(200)),
                release(None, "error", Some(500)),
                release(None, "upstream_rate_limited", None),
                release(Some("crm"), "ok", Some(200)),
                // No status and no duration: nothing to count.
                release(None, "ok", None),
            ]);
        });
        let text = handle.render();
        let series = |upstream: &str, status: u16| {
            format!(
                "admitd_upstream_responses_total{{tenant=\"acme\",upstream=\"{upstream}\",status=\"{status}\"}}"
            )
        };
        assert_eq!(value(&text, &series("none", 200)), Some(1.0), "{text}");
        assert_eq!(value(&text, &series("none", 500)), Some(1.0), "{text}");
        assert_eq!(value(&text, &series("none", 429)), Some(1.0), "{text}");
        assert_eq!(value(&text, &series("crm", 200)), Some(1.0), "{text}");
    }

    #[test]
    fn expired_leases_count_by_their_labels_however_many_come_in_one_event() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let cfg = Config::default().telemetry;
        // Leases carry their subject's label as the tenant actor decided it.
        let expired = |leases: &[(&str, Option<&str>)]| {
            Event::Tenant(Arc::new(TenantEvent::LeasesExpired {
                tenant: Arc::from("acme"),
                leases: leases
                    .iter()
                    .map(|(s, u)| (Arc::from(*s), Arc::from("search"), u.map(Arc::from)))
                    .collect(),
            }))
        };
        metrics::with_local_recorder(&recorder, || {
            let clock = Arc::new(FakeClock::new(0));
            let mut m = MetricsActor::new(&cfg, clock, Arc::new(Histograms::default()));
            m.record_batch(&[
                expired(&[("alice", None), ("alice", None), ("__other__", Some("crm"))]),
                expired(&[("alice", None)]),
            ]);
            m.record_batch(&[expired(&[("bob", Some("crm"))])]);
        });
        let text = handle.render();
        let series = |subject: &str, upstream: &str| {
            format!(
                "admitd_lease_expiries_total{{tenant=\"acme\",subject=\"{subject}\",tool=\"search\",upstream=\"{upstream}\"}}"
            )
        };
        assert_eq!(value(&text, &series("alice", "none")), Some(3.0), "{text}");
        assert_eq!(
            value(&text, &series("__other__", "crm")),
            Some(1.0),
            "{text}"
        );
        assert_eq!(value(&text, &series("bob", "crm")), Some(1.0), "{text}");
    }
}
