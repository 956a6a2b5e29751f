//! Telemetry: decision events out of the hot path, into metrics, spans, the refusal log and alerts.
//!
//! The HTTP layer and the tenant actors describe what happened as events and hand them to
//! [`Telemetry`]. On the workers, events are collected in a thread-local batch and handed over every
//! 256 events or 10 ms, whichever comes first; elsewhere one at a time. A batch is offered to every
//! telemetry actor's bounded mailbox with `try_send`: a full mailbox drops it and counts the events
//! dropped (`admitd_telemetry_events_dropped_total`), so admission never waits for telemetry. The
//! actors ([`metrics::MetricsActor`], [`spans::SpanActor`], [`alerts::AlertActor`]) run on an arbiter of
//! their own, away from the workers. `[telemetry] enabled = false` starts none of this.
//!
//! Reads of what the actors hold (`GET /metrics`, `GET /v1/alerts`) first [`Telemetry::settle`]: every
//! worker hands over what it collected, and each actor answers once it has handled everything that
//! reached its mailbox before, so a read includes every decision answered before it began. The
//! reader waits for that, never an admission: a worker hands its batch over between two requests, as
//! it does every 10 ms anyway.

pub mod advice;
pub mod alerts;
pub mod histogram;
pub mod labels;
pub mod live;
pub mod metrics;
pub mod names;
mod rawindex;
pub mod spans;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix::ArbiterHandle;

use crate::clock::{Clock, Nanos};
use crate::config::{BucketSpec, Config};
use crate::engine::bucket::{Bucket, Gcra, Take};
use crate::engine::{Scope, TenantGauges};

/// Mailbox size of each telemetry actor: about a second of events at full load.
pub const MAILBOX: usize = 65_536;

/// A stable pseudonym for an identity in logs and spans, as 16 hex digits: [`identity_hash`].
pub fn hash_identity(s: &str) -> String {
    hex16(identity_hash(s))
}

/// The keyed hash of `[telemetry] hash_identities`: HMAC-SHA-256 under the operator's key, set
/// process-wide at start and on reload ([`set_identity_key`]), so every log line and span
/// attribute uses the same one.
static IDENTITY_KEY: arc_swap::ArcSwapOption<hmac::Hmac<sha2::Sha256>> =
    arc_swap::ArcSwapOption::const_empty();

/// Installs (or, with `None`, removes) the identity hash key.
pub fn set_identity_key(key: Option<&crate::config::IdentityKey>) {
    use hmac::Mac;
    let mac = key.and_then(|k| hmac::Hmac::<sha2::Sha256>::new_from_slice(&k.0).ok());
    IDENTITY_KEY.store(mac.map(Arc::new));
}

/// The number an identity is shown as. With a key (`hash_identities = true`): the first 64 bits
/// of HMAC-SHA-256(key, identity), which nobody without the key can compute from a guessed name.
/// Without one: FNV-1a 64, a pseudonym that keeps the names out of log pipelines but that anyone
/// can recompute for a name they guess.
pub fn identity_hash(s: &str) -> u64 {
    match &*IDENTITY_KEY.load() {
        Some(mac) => keyed_hash(mac, s),
        None => fnv1a(s),
    }
}

/// The first 64 bits of the HMAC of `s` under the key `mac` was made with.
fn keyed_hash(mac: &hmac::Hmac<sha2::Sha256>, s: &str) -> u64 {
    use hmac::Mac;
    let mut m = mac.clone();
    m.update(s.as_bytes());
    let out = m.finalize().into_bytes();
    let mut first = [0u8; 8];
    first.copy_from_slice(&out[..8]);
    u64::from_be_bytes(first)
}

/// FNV-1a 64 of a string: the number [`hash_identity`] spells.
pub fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A 64-bit number as 16 lower-case hex digits.
pub fn hex16(h: u64) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    (0..16)
        .rev()
        .map(|i| HEX[(h >> (i * 4)) as usize & 0xf] as char)
        .collect()
}

/// What became of an admission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionKind {
    Admitted,
    Shed,
    ShadowShed,
}

impl DecisionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionKind::Admitted => "admitted",
            DecisionKind::Shed => "shed",
            DecisionKind::ShadowShed => "shadow_shed",
        }
    }
}

/// One admission decision, as reported.
#[derive(Debug, Clone)]
pub struct DecisionEvent {
    pub tenant: Arc<str>,
    pub subject: Arc<str>,
    /// The subject's metric label, decided by the tenant actor (see [`labels::SubjectLabels`]).
    pub subject_label: Arc<str>,
    pub tool: Arc<str>,
    pub upstream: Option<Arc<str>>,
    pub cost: f64,
    pub kind: DecisionKind,
    /// The shed scope (also for shadow sheds); `None` when admitted.
    pub scope: Option<Scope>,
    pub retryable: bool,
    pub waited_ns: u64,
    pub retry_after_ms: u64,
    /// Time from request parsed to answer ready, excluding deliberate holds.
    pub decision_ns: u64,
    pub call_id: Option<String>,
    /// The lease number of an admitted call (also admitted in shadow mode); meaningless for a
    /// shed call. The advice recording pairs the release with its call by it.
    pub lease: u64,
    /// Admitted without any check (`on_error = "fail_open"` while the shared store was down).
    pub unchecked: bool,
    /// What only spans read; `None` unless spans are exported. Every admission's event is copied
    /// into a batch and read again on the telemetry thread, so fields most events leave empty stay
    /// out of line.
    pub span: Option<Box<SpanFields>>,
}

/// The parts of a decision only its span needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpanFields {
    /// The request's W3C `traceparent` header, as sent.
    pub traceparent: Option<String>,
    /// The lease number of an admitted call (spans of live leases are found by tenant and
    /// number).
    pub lease: Option<u64>,
    /// Wall-clock start of the request (Unix ns).
    pub start_unix_ns: u128,
}

/// A lease released, with what the upstream said.
#[derive(Debug, Clone)]
pub struct ReleaseEvent {
    pub tenant: Arc<str>,
    pub subject: Arc<str>,
    pub tool: Arc<str>,
    pub upstream: Option<Arc<str>>,
    pub outcome: &'static str,
    pub upstream_status: Option<u16>,
    pub retry_after: Option<String>,
    pub penalty_ms: Option<u64>,
    pub duration_ms: Option<u64>,
    /// The released lease's number (unique within its tenant).
    pub lease: u64,
    /// When the release was answered (Unix ns), to date its span; 0 when spans are not exported.
    pub released_unix_ns: u64,
}

/// An upstream answer reported outside a lease.
#[derive(Debug, Clone)]
pub struct FeedbackEvent {
    pub tenant: Arc<str>,
    pub upstream: Arc<str>,
    pub status: u16,
    pub retry_after: Option<String>,
    pub penalty_ms: Option<u64>,
}

/// Calls a tenant actor answered since its previous report: what the shed-ratio alerts count.
///
/// The tenant actor counts them as it decides (two additions to memory it is already using), so the
/// alert actor receives one report per tenant per second instead of one event per call. `admitted` is
/// signed because a held call that is refused when its hold ends (its upstream went into the penalty
/// box meanwhile), or whose caller went away during the hold, was counted as admitted, possibly in an
/// earlier report: it is taken back here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCounts {
    pub admitted: i64,
    pub shed: u64,
}

/// The labels of an expired lease's call: (subject label, tool, upstream).
pub use crate::engine::tenant::ExpiredLease;

/// State changes and samples from the actors.
#[derive(Debug, Clone)]
pub enum TenantEvent {
    /// The leases that expired at one tick of a tenant actor, as (subject label, tool, upstream): one
    /// event per tick rather than per lease, since a server that stops releasing expires every one.
    LeasesExpired {
        tenant: Arc<str>,
        leases: Vec<ExpiredLease>,
    },
    /// Sent by every tenant actor once a second (and when it stops).
    Gauges {
        tenant: Arc<str>,
        gauges: TenantGauges,
        /// Calls answered since the previous report, for the shed-ratio alerts.
        calls: CallCounts,
    },
    /// An MCP task started (`POST /v1/admit` with `"task": true`).
    TaskStarted { tenant: Arc<str> },
    /// A task's poll (`POST /v1/tasks/poll`): on time (admitted) or early (refused).
    TaskPolled { tenant: Arc<str>, admitted: bool },
    /// Calls a tenant actor answered since its previous report, reported on demand (a read of
    /// `GET /v1/alerts`, see [`Telemetry::refresh_alerts`]) between its reports once a second.
    Calls { tenant: Arc<str>, calls: CallCounts },
    Global {
        tenants: usize,
        global_utilization: f64,
        shared_penalties: Vec<(Arc<str>, f64)>,
        /// (upstream, effective rate per second, adaptive throttle probability) of shared upstreams.
        shared_rates: Vec<(Arc<str>, f64, f64)>,
    },
}

/// Everything a telemetry sink may receive. Decisions, one per admission, travel by value inside
/// the shared batch (no allocation of their own); the rarer events are boxed behind an `Arc`.
#[derive(Debug, Clone)]
pub enum Event {
    Decision(DecisionEvent),
    Release(Arc<ReleaseEvent>),
    Feedback(Arc<FeedbackEvent>),
    Tenant(Arc<TenantEvent>),
}

/// Events delivered together: one mailbox message (and at most one cross-thread wake-up) for many
/// events.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct Batch(pub Arc<Vec<Event>>);

/// Events a worker thread collected and not yet handed to the sinks.
struct Pending {
    events: Vec<Event>,
    to: Telemetry,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.to.send(std::mem::take(&mut self.events));
    }
}

thread_local! {
    /// `Some` on threads that batch (the workers, which also flush it every [`FLUSH_EVERY`]).
    static PENDING: std::cell::RefCell<Option<Pending>> = const { std::cell::RefCell::new(None) };
}

/// Events a worker collects before it hands them over, at most.
const BATCH: usize = 256;
/// How often a worker hands over what it collected, at least.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// Answered by a telemetry actor once it has handled every batch that reached its mailbox before
/// this message did (a mailbox is one queue, in the order things were put in).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Settle;

/// How long a read waits for the workers and the telemetry actors to catch up, at most; past it
/// (a worker stuck for that long, a mailbox that full) it renders what there is.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);

struct Sink {
    recipient: Recipient<Batch>,
    /// For the sinks whose state the HTTP API reads (metrics, alerts).
    settle: Option<Recipient<Settle>>,
}

/// The handle the daemon reports through. Cheap to clone.
#[derive(Clone, Default)]
pub struct Telemetry {
    sinks: Arc<Vec<Sink>>,
    dropped: Arc<AtomicU64>,
    metrics: Option<Addr<metrics::MetricsActor>>,
    alerts: Option<Addr<alerts::AlertActor>>,
    /// The metrics actor keeps the recording `GET /v1/advice` reads (`[advice] enabled`).
    advice: bool,
    /// Decides subjects' metric labels; the tenant actors ask it (none when metrics are off).
    labels: Option<Arc<labels::SubjectLabels>>,
    traces: bool,
    /// The arbiters whose threads batch events ([`Telemetry::batch_this_thread`]), so that a read
    /// can make them hand over.
    batching: Arc<parking_lot::Mutex<Vec<ArbiterHandle>>>,
    /// When the latest alert refresh began; one runs at a time (see [`Telemetry::refresh_alerts`]).
    alerts_refreshed: Arc<tokio::sync::Mutex<Option<Instant>>>,
    /// Round trips to the shared store, timed (none when metrics are off).
    store_latency: Option<Arc<histogram::Histogram>>,
}

impl Telemetry {
    /// Records one round trip to the shared store.
    pub fn store_round_trip(&self, seconds: f64) {
        if let Some(h) = &self.store_latency {
            h.record(seconds);
        }
    }

    /// A handle that reports nowhere (tests, `check`).
    pub fn disabled() -> Self {
        Telemetry::default()
    }

    /// A handle that hands every event at once to `recipient` (tests).
    #[cfg(test)]
    pub(crate) fn to_recipient(recipient: Recipient<Batch>) -> Self {
        Telemetry {
            sinks: Arc::new(vec![Sink {
                recipient,
                settle: None,
            }]),
            ..Telemetry::default()
        }
    }

    /// Makes the current thread collect events and hand them over in batches (of up to 256, or
    /// whatever it has when [`Telemetry::flush_this_thread`] runs): a worker answering thousands of
    /// admissions a second then wakes the telemetry thread about a hundred times a second, not once
    /// per admission and sink. Threads that never call this send each event at once. On an
    /// arbiter's thread, [`Telemetry::settle`] makes it hand over on demand too.
    pub fn batch_this_thread(&self) {
        if self.sinks.is_empty() {
            return;
        }
        if let Some(arbiter) = Arbiter::try_current() {
            self.batching.lock().push(arbiter);
        }
        PENDING.with(|p| {
            *p.borrow_mut() = Some(Pending {
                events: Vec::with_capacity(BATCH),
                to: self.clone(),
            });
        });
    }

    /// Hands over what the current thread collected.
    pub fn flush_this_thread() {
        PENDING.with(|p| {
            if let Some(p) = p.borrow_mut().as_mut().filter(|p| !p.events.is_empty()) {
                // Room for as many as this flush carries, so the next batch grows little if at all;
                // sending reaches the sinks' mailboxes only, never this thread's batch.
                let room = p.events.len().next_power_of_two().min(BATCH);
                let events = std::mem::replace(&mut p.events, Vec::with_capacity(room));
                p.to.send(events);
            }
        });
    }

    /// Makes every batching worker hand over what it collected, then waits until the metrics and
    /// alert actors have handled everything sent to them before: what they show afterwards includes
    /// every event reported before this was called (except those a full mailbox dropped, which are
    /// counted). Gives up after [`SETTLE_TIMEOUT`].
    pub async fn settle(&self) {
        if self.sinks.is_empty() {
            return;
        }
        let _ = tokio::time::timeout(SETTLE_TIMEOUT, self.settle_now()).await;
    }

    async fn settle_now(&self) {
        let threads = self.batching.lock().clone();
        let mut handed_over = Vec::with_capacity(threads.len());
        for thread in &threads {
            let (done, handed) = tokio::sync::oneshot::channel();
            // Runs between two of that worker's requests, like its periodic flush; an arbiter
            // that stopped takes nothing.
            let spawned = thread.spawn(async move {
                Telemetry::flush_this_thread();
                let _ = done.send(());
            });
            if spawned {
                handed_over.push(handed);
            }
        }
        for handed in handed_over {
            let _ = handed.await;
        }
        // Each worker put its batch into the mailboxes before it answered above, so these arrive
        // after them.
        for settle in self.sinks.iter().filter_map(|s| s.settle.as_ref()) {
            let _ = settle.send(Settle).await;
        }
    }

    /// Brings `GET /v1/alerts` up to date with every call answered before this was called:
    /// `report_calls` makes the tenant actors report the calls they answered since their last report
    /// (which they otherwise do once a second), then [`Telemetry::settle`] brings those reports to
    /// the alert actor, which evaluates its rules again. One refresh runs at a time, and callers
    /// that waited for a refresh which began after they did take its result: however often the
    /// route is read, the tenant actors are asked at most once per refresh.
    pub async fn refresh_alerts(&self, report_calls: impl std::future::Future<Output = ()>) {
        let Some(alerts) = &self.alerts else {
            return;
        };
        let asked = Instant::now();
        let mut last = self.alerts_refreshed.lock().await;
        if last.is_some_and(|began| began >= asked) {
            return;
        }
        *last = Some(Instant::now());
        let _ = tokio::time::timeout(SETTLE_TIMEOUT, async {
            report_calls.await;
            self.settle_now().await;
            let _ = alerts.send(alerts::Evaluate).await;
        })
        .await;
    }

    fn send(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        let n = events.len() as u64;
        let batch = Batch(Arc::new(events));
        for sink in self.sinks.iter() {
            if sink.recipient.try_send(batch.clone()).is_err() {
                self.dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    fn offer(&self, ev: Event) {
        let full = PENDING.with(|p| match p.borrow_mut().as_mut() {
            Some(p) => {
                p.events.push(ev);
                (p.events.len() >= BATCH)
                    .then(|| std::mem::replace(&mut p.events, Vec::with_capacity(BATCH)))
            }
            None => Some(vec![ev]),
        });
        if let Some(events) = full {
            self.send(events);
        }
    }

    pub fn decision(&self, ev: DecisionEvent) {
        if !self.sinks.is_empty() {
            self.offer(Event::Decision(ev));
        }
    }

    /// Whether a release is worth an event: a release has a span, and metrics count an upstream
    /// status or a tool duration (`counted`); a bare release is neither.
    pub fn wants_release(&self, counted: bool) -> bool {
        !self.sinks.is_empty() && (self.traces || counted || self.advice)
    }

    /// Whether calls are recorded for `GET /v1/advice`.
    pub fn records_advice(&self) -> bool {
        self.advice
    }

    /// The calls of the last `over_ms` milliseconds, every decision answered before this call
    /// included (see [`Telemetry::settle`]); `None` when nothing is recorded.
    pub async fn advice_period(&self, over_ms: u64) -> Option<crate::advice::Period> {
        let metrics = self.metrics.as_ref().filter(|_| self.advice)?;
        self.settle().await;
        tokio::time::timeout(SETTLE_TIMEOUT, metrics.send(advice::TakePeriod { over_ms }))
            .await
            .ok()?
            .ok()
            .flatten()
    }

    pub fn release(&self, ev: ReleaseEvent) {
        if !self.sinks.is_empty() {
            self.offer(Event::Release(Arc::new(ev)));
        }
    }

    pub fn feedback(&self, ev: FeedbackEvent) {
        if !self.sinks.is_empty() {
            self.offer(Event::Feedback(Arc::new(ev)));
        }
    }

    pub fn tenant_event(&self, ev: TenantEvent) {
        if !self.sinks.is_empty() {
            self.offer(Event::Tenant(Arc::new(ev)));
        }
    }

    /// One page of the live view (`GET /v1/tenants`, the status page), from the alert actor's
    /// per-tenant windows as of the tenants' latest reports; `None` when telemetry is off.
    pub async fn tenants(&self, q: live::TenantsQuery) -> Option<live::TenantsPage> {
        let alerts = self.alerts.as_ref()?;
        tokio::time::timeout(SETTLE_TIMEOUT, alerts.send(q))
            .await
            .ok()?
            .ok()
    }

    /// Whether spans are exported (decision events then carry their lease id, for the release's
    /// span).
    pub fn traces(&self) -> bool {
        self.traces
    }

    /// Events dropped because a telemetry mailbox was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Where the tenant actors get their subjects' metric labels.
    pub fn subject_labels(&self) -> Option<Arc<labels::SubjectLabels>> {
        self.labels.clone()
    }

    /// Applies the reloadable telemetry and alert settings.
    pub fn reconfigure(&self, cfg: &Config) {
        if let Some(l) = &self.labels {
            l.set_caps(
                cfg.telemetry.max_subjects_per_tenant,
                cfg.telemetry.max_subjects_total,
            );
        }
        if let Some(m) = &self.metrics {
            m.do_send(metrics::SetTelemetry(cfg.telemetry.clone()));
        }
        if let Some(a) = &self.alerts {
            a.do_send(alerts::SetAlerts(cfg.alerts.clone()));
        }
        if let (Some(m), true) = (&self.metrics, self.advice) {
            m.do_send(advice::SetBudget(cfg.advice.clone()));
        }
    }
}

/// The running telemetry: the handle plus what the HTTP layer and shutdown need.
pub struct Started {
    pub telemetry: Telemetry,
    /// Renders `GET /metrics`.
    pub render_metrics: Arc<dyn Fn() -> String + Send + Sync>,
    /// Renders `GET /v1/alerts`.
    pub render_alerts: Arc<dyn Fn() -> serde_json::Value + Send + Sync>,
    /// The OTLP export thread, when spans are exported.
    pub span_exporter: Option<spans::Exporter>,
    pub arbiter: Arbiter,
}

/// At most `per_sec` events a second, with a burst of one second's worth (a GCRA bucket, as the
/// engine's): refusal log lines, spans.
#[derive(Debug)]
pub struct Throttle {
    g: Gcra,
    bucket: Bucket,
}

impl Throttle {
    pub fn new(per_sec: f64) -> Self {
        let per_sec = per_sec.max(0.001);
        Throttle {
            g: Gcra::new(BucketSpec::new(per_sec, per_sec.max(1.0))),
            bucket: Bucket::default(),
        }
    }

    /// Whether one more event may go at monotonic time `now`.
    pub fn allow(&mut self, now: Nanos) -> bool {
        let inc = self.g.increment(1.0);
        matches!(self.bucket.take(&self.g, now, inc, 0), Take::Ok { .. })
    }
}

/// Installs the Prometheus recorder and starts the telemetry actors on their own arbiter. Must run
/// inside the actix system.
pub fn start(cfg: &Config, clock: Arc<dyn Clock>) -> Result<Started, String> {
    use metrics_exporter_prometheus::PrometheusBuilder;
    // Counters and gauges go through the exporter; histograms are admitd's own fixed-bucket ones
    // (see `histogram`), rendered after the exporter's output.
    let recorder = PrometheusBuilder::new().build_recorder();
    let histograms = Arc::new(histogram::Histograms::default());
    let handle = recorder.handle();
    ::metrics::set_global_recorder(recorder)
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    names::describe_metrics();

    let span_exporter = match &cfg.telemetry.otlp {
        Some(otlp) => Some(spans::start(otlp, clock.clone())?),
        None => None,
    };

    let arbiter =
        Arbiter::try_new().map_err(|e| format!("cannot start the telemetry thread: {e}"))?;
    let h = arbiter.handle();
    let (tcfg, mclock, mhist) = (cfg.telemetry.clone(), clock.clone(), histograms.clone());
    let recorder = cfg
        .advice
        .enabled
        .then(|| advice::Recorder::new(&cfg.advice, clock.clone()));
    let metrics_addr = metrics::MetricsActor::start_in_arbiter(&h, move |_| {
        let m = metrics::MetricsActor::new(&tcfg, mclock, mhist);
        match recorder {
            Some(r) => m.with_advice(r),
            None => m,
        }
    });
    let firing: alerts::FiringList = Arc::default();
    let (acfg, aclock, afiring) = (cfg.alerts.clone(), clock.clone(), firing.clone());
    let alerts_addr = alerts::AlertActor::start_in_arbiter(&h, move |_| {
        alerts::AlertActor::new(acfg, aclock, afiring)
    });
    let mut sinks = vec![
        Sink {
            recipient: metrics_addr.clone().recipient(),
            settle: Some(metrics_addr.clone().recipient()),
        },
        Sink {
            recipient: alerts_addr.clone().recipient(),
            settle: Some(alerts_addr.clone().recipient()),
        },
    ];
    if let (Some(exporter), Some(otlp)) = (&span_exporter, &cfg.telemetry.otlp) {
        let actor = spans::SpanActor::new(exporter, otlp, clock.clone(), cfg.server.lease_ttl);
        let spans_addr = spans::SpanActor::start_in_arbiter(&h, move |_| actor);
        sinks.push(Sink {
            recipient: spans_addr.recipient(),
            settle: None,
        });
    }
    let telemetry = Telemetry {
        sinks: Arc::new(sinks),
        dropped: Arc::new(AtomicU64::new(0)),
        metrics: Some(metrics_addr),
        alerts: Some(alerts_addr),
        advice: cfg.advice.enabled,
        labels: Some(Arc::new(labels::SubjectLabels::new(
            cfg.telemetry.max_subjects_per_tenant,
            cfg.telemetry.max_subjects_total,
        ))),
        traces: span_exporter.is_some(),
        batching: Arc::default(),
        alerts_refreshed: Arc::default(),
        store_latency: Some(histograms.store.series(&[])),
    };
    let dropped = telemetry.dropped.clone();
    let render_metrics = Arc::new(move || {
        ::metrics::counter!(names::EVENTS_DROPPED).absolute(dropped.load(Ordering::Relaxed));
        render(&handle, &histograms)
    });
    let render_alerts = Arc::new(move || serde_json::json!({ "alerts": *firing.read() }));
    Ok(Started {
        telemetry,
        render_metrics,
        render_alerts,
        span_exporter,
        arbiter,
    })
}

/// The text exposition of `GET /metrics`: the exporter's counters and gauges, then admitd's own
/// metrics.
fn render(
    handle: &metrics_exporter_prometheus::PrometheusHandle,
    histograms: &histogram::Histograms,
) -> String {
    handle.run_upkeep();
    let mut out = handle.render();
    if !out.is_empty() && !out.ends_with("\n\n") {
        out.push('\n');
    }
    histograms.render(&mut out);
    out
}

/// The value of one line of the Prometheus text format, by its exact series name (for tests).
#[cfg(test)]
pub(crate) fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::names::{self, MetricKind, METRIC_HELP};
    use super::{fnv1a, hash_identity, hex16, histogram, keyed_hash, render, Throttle};
    use crate::clock::NS_PER_SEC;

    /// Every metric name constant in names.rs (its `admitd_` strings), read from the source, so a
    /// name added there without a help text fails the test below.
    fn name_constants() -> Vec<String> {
        include_str!("names.rs")
            .lines()
            .filter_map(|l| {
                l.strip_prefix("pub const ")?
                    .split_once(": &str = \"admitd_")
            })
            .map(|(_, rest)| format!("admitd_{}", rest.trim_end_matches("\";")))
            .collect()
    }

    #[test]
    fn every_metric_renders_one_help_line_before_its_type_line() {
        let names = name_constants();
        assert!(
            names.contains(&"admitd_admissions_total".to_string()),
            "{names:?}"
        );
        assert_eq!(
            names.len(),
            METRIC_HELP.len(),
            "one help text per name: {names:?}"
        );
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // admitd's own metrics, one series each, as the metrics actor creates them.
        let histograms = histogram::Histograms::default();
        histograms
            .admissions
            .series(&["acme", "alice", "search", "none", "admitted", "none"]);
        histograms.wait.series(&["acme", "search"]);
        histograms.retry.series(&["acme", "subject"]);
        histograms.tool.series(&["acme", "search", "none"]);
        let mut own = String::new();
        histograms.render(&mut own);
        metrics::with_local_recorder(&recorder, || {
            names::describe_metrics();
            // Every other metric through the exporter, as the actors record them.
            for m in METRIC_HELP {
                if own.contains(&format!("# TYPE {} ", m.name)) {
                    continue;
                }
                match m.kind {
                    MetricKind::Counter => metrics::counter!(m.name).increment(1),
                    MetricKind::Gauge => metrics::gauge!(m.name).set(1.0),
                    MetricKind::Histogram => panic!("{} is not one of admitd's histograms", m.name),
                }
            }
        });
        let text = render(&handle, &histograms);
        assert!(
            text.lines()
                .any(|l| l.starts_with("# HELP admitd_admissions_total ")),
            "{text}"
        );
        let lines: Vec<&str> = text.lines().collect();
        for name in &names {
            let m = METRIC_HELP
                .iter()
                .find(|m| m.name == name)
                .unwrap_or_else(|| panic!("{name} has no help text in METRIC_HELP"));
            let help = format!("# HELP {} {}", m.name, m.help);
            let kind = match m.kind {
                MetricKind::Counter => "counter",
                MetricKind::Gauge => "gauge",
                MetricKind::Histogram => "histogram",
            };
            let at: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].starts_with(&format!("# HELP {} ", m.name)))
                .collect();
            assert_eq!(at.len(), 1, "one help line for {}:\n{text}", m.name);
            assert_eq!(lines[at[0]], help, "{text}");
            assert_eq!(
                lines.get(at[0] + 1).copied(),
                Some(format!("# TYPE {} {kind}", m.name).as_str()),
                "{text}"
            );
        }
    }

    #[test]
    fn help_texts_are_one_short_plain_line() {
        for m in METRIC_HELP {
            assert!(m.name.starts_with("admitd_"), "{}", m.name);
            assert!(
                !m.help.is_empty() && m.help.len() <= 100 && m.help.ends_with('.'),
                "{}: {:?}",
                m.name,
                m.help
            );
            assert!(!m.help.contains(['\\', '\n']), "{}", m.name);
        }
    }

    #[test]
    fn a_throttle_allows_a_second_of_its_rate_at_once_then_its_rate() {
        let mut t = Throttle::new(20.0);
        let allowed = (0..100).filter(|_| t.allow(NS_PER_SEC)).count();
        assert_eq!(allowed, 20, "a burst of one second's worth");
        // one more every 50 ms
        assert!(!t.allow(NS_PER_SEC + 49_000_000));
        assert!(t.allow(NS_PER_SEC + 50_000_000));
        assert!(!t.allow(NS_PER_SEC + 50_000_000));
        // a long quiet spell gives one second's worth again, not more
        assert_eq!((0..100).filter(|_| t.allow(60 * NS_PER_SEC)).count(), 20);
    }

    /// Every admission's event is written into a batch on the worker and read on the telemetry
    /// thread: what only spans read stays out of it unless spans are exported.
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn a_decision_event_carries_span_fields_behind_one_pointer() {
        assert!(std::mem::size_of::<super::DecisionEvent>() <= 160);
        assert!(std::mem::size_of::<super::Event>() <= 160);
    }

    #[test]
    fn keyed_identity_hashes_are_the_hmac_sha256_of_the_identity() {
        use hmac::Mac;
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"Jefe").unwrap();
        assert_eq!(
            hex16(keyed_hash(&mac, "what do ya want for nothing?")),
            "5bdcc146bf60754e"
        );
        let other = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"Jeff").unwrap();
        assert_ne!(keyed_hash(&mac, "agent-7"), keyed_hash(&other, "agent-7"));
        assert_ne!(keyed_hash(&mac, "agent-7"), fnv1a("agent-7"));
    }

    #[test]
    fn identities_hash_to_sixteen_hex_digits_of_fnv1a() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(hash_identity(""), "cbf29ce484222325");
        assert_eq!(hash_identity("a"), "af63dc4c8601ec8c");
        assert_eq!(hash_identity("foobar"), "85944171f73967e8");
    }

    /// Counts the events it receives.
    struct Collector(std::sync::Arc<AtomicU64>);

    impl actix::Actor for Collector {
        type Context = actix::Context<Self>;
    }

    impl actix::Handler<super::Batch> for Collector {
        type Result = ();
        fn handle(&mut self, b: super::Batch, _: &mut actix::Context<Self>) {
            self.0.fetch_add(b.0.len() as u64, Ordering::SeqCst);
        }
    }

    impl actix::Handler<super::Settle> for Collector {
        type Result = ();
        fn handle(&mut self, _: super::Settle, _: &mut actix::Context<Self>) {}
    }

    fn feedback() -> super::FeedbackEvent {
        super::FeedbackEvent {
            tenant: "acme".into(),
            upstream: "crm".into(),
            status: 429,
            retry_after: None,
            penalty_ms: None,
        }
    }

    #[test]
    fn settling_brings_what_a_worker_batched_to_the_sinks() {
        use actix::Actor;
        actix::System::new().block_on(async {
            let seen = Arc::new(AtomicU64::new(0));
            let collector = Collector(seen.clone()).start();
            let t = super::Telemetry {
                sinks: Arc::new(vec![super::Sink {
                    recipient: collector.clone().recipient(),
                    settle: Some(collector.recipient()),
                }]),
                ..super::Telemetry::default()
            };
            // A worker that batches and never flushes by itself (no periodic flush here).
            let worker = actix::Arbiter::new();
            let (batched, reported) = tokio::sync::oneshot::channel();
            let w = t.clone();
            worker.spawn(async move {
                w.batch_this_thread();
                w.feedback(feedback());
                w.feedback(feedback());
                let _ = batched.send(());
            });
            reported.await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(
                seen.load(Ordering::SeqCst),
                0,
                "still in the worker's batch"
            );
            t.settle().await;
            assert_eq!(seen.load(Ordering::SeqCst), 2);
            worker.stop();
        });
    }

    #[test]
    fn concurrent_alert_reads_share_refreshes() {
        use actix::Actor;
        actix::System::new().block_on(async {
            let clock: Arc<dyn crate::clock::Clock> = Arc::new(crate::clock::FakeClock::new(0));
            let cfg = crate::config::Config::default().alerts;
            let alerts = super::alerts::AlertActor::new(cfg, clock, Arc::default()).start();
            let t = super::Telemetry {
                alerts: Some(alerts),
                ..super::Telemetry::default()
            };
            let asked = Arc::new(AtomicU64::new(0));
            let report = || {
                let asked = asked.clone();
                async move {
                    asked.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            let reads: Vec<_> = (0..8).map(|_| t.refresh_alerts(report())).collect();
            futures_util::future::join_all(reads).await;
            // The first read refreshes; the seven that asked meanwhile share the one refresh that
            // began after they asked (or, asked in the same instant, the first).
            let n = asked.load(Ordering::SeqCst);
            assert!((1..=2).contains(&n), "{n} refreshes for 8 concurrent reads");
            // A read that comes later refreshes again.
            t.refresh_alerts(report()).await;
            assert_eq!(asked.load(Ordering::SeqCst), n + 1);
        });
    }
}
