//! OpenTelemetry spans for admissions, exported over OTLP (HTTP with protobuf or JSON bodies, or gRPC).
//!
//! One span per admission decision, following the GenAI and MCP semantic conventions
//! (`gen_ai.operation.name = "execute_tool"`, `gen_ai.tool.name`, `mcp.method.name = "tools/call"`),
//! parented on the caller's W3C `traceparent` when it sent one, plus `admitd.*` attributes (tenant,
//! hashed subject, upstream, cost, decision, scope, wait, retry hint). A shed call's span ends at the
//! decision. An admitted call's span stays open for the life of its lease and ends at release with an
//! `admitd.release` event (outcome, upstream status, Retry-After), so the span covers the tool execution
//! the way `execute_tool` spans do; a lease never released ends its span with `admitd.lease_expired`.
//!
//! # Sampling
//! Parent-based, as OpenTelemetry's default `parentbased_traceidratio` sampler: a call whose caller
//! sent a `traceparent` gets a span exactly when the caller's trace is sampled, and other calls by
//! `[telemetry.otlp] sample_ratio` of their trace id (1.0, every call, by default). Sampled calls then
//! spend a place in the span budget (`max_spans_per_second`, default 1000, a burst of one second's
//! worth); calls past it get no span and are counted as dropped (`rate_limited`), so a flood of calls
//! costs a bounded amount of CPU and collector traffic.
//!
//! # Cost
//! Spans are the most expensive telemetry admitd has (an OTLP span with its attributes is a few
//! hundred bytes built from about thirty small allocations), so the actor does not go through the
//! SDK's tracer. It keeps a compact record per span (ids, times, shared names, numbers) and hands
//! finished records to an export thread in batches of [`EXPORT_BATCH`]. The export thread turns them
//! into the SDK's `SpanData` and gives them to the `opentelemetry-otlp` exporter (the blocking HTTP
//! client, or tonic on a single-threaded runtime of the thread's own for gRPC). The queue between
//! the two is bounded: a slow collector costs dropped spans, never admission time. After an export
//! fails, the export thread drops spans without building them for a back-off (1 s, doubling to 30 s),
//! so a collector that is down costs almost nothing. Dropped spans are counted in
//! `admitd_spans_dropped_total`.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix::prelude::*;
use opentelemetry::trace::{
    Event as SpanEvent, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter, SpanLinks};
use opentelemetry_sdk::Resource;

use super::{
    hex16, names, DecisionEvent, DecisionKind, Event, FeedbackEvent, ReleaseEvent, Throttle,
};
use crate::clock::{Clock, Nanos, NS_PER_SEC};
use crate::config::{OtlpConfig, OtlpProtocol};
use crate::engine::Scope;

/// Open spans kept at most (one per live lease); past this, admitted spans end at the decision.
const MAX_OPEN: usize = 100_000;
/// Spans handed to the export thread at once, and exported in one request.
pub const EXPORT_BATCH: usize = 512;
/// Batches waiting for the export thread, at most (8192 spans); further spans are dropped.
const EXPORT_QUEUE: usize = 16;
/// Finished spans wait at most this long before they are handed to the export thread.
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Spans are dropped unbuilt for this long after a failed export, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Nanos = NS_PER_SEC;
/// Spans are not recorded for this long after the export queue was found full.
const QUEUE_FULL_PAUSE: Nanos = NS_PER_SEC;
const MAX_BACKOFF: Nanos = 30 * NS_PER_SEC;

/// The caller's span, from a W3C `traceparent` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

/// Parses a `traceparent` header (W3C Trace Context level 1): `00-<32 hex>-<16 hex>-<2 hex>`, lower
/// case, with non-zero ids. Versions above 00 are read by the 00 layout, as the recommendation asks;
/// version `ff` and anything malformed is no parent at all (the call starts a new trace).
pub fn parse_traceparent(header: &str) -> Option<Parent> {
    let b = header.trim().as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let version = hex(&b[0..2])?;
    match version {
        0xff => return None,
        0 if b.len() != 55 => return None,
        _ if b.len() > 55 && b[55] != b'-' => return None,
        _ => {}
    }
    let trace_id = hex(&b[3..35])?;
    let span_id = hex(&b[36..52])? as u64;
    let flags = hex(&b[53..55])?;
    if trace_id == 0 || span_id == 0 {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// Lower-case hex digits (at most 32) as a number.
fn hex(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |n, &c| {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        Some(n << 4 | u128::from(d))
    })
}

/// Which calls get a span: the parent's decision when there is a parent, else a share of trace ids
/// (OpenTelemetry's `TraceIdRatioBased` rule on the low 64 bits of the trace id).
#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    /// Root traces whose low 64 trace-id bits, shifted right by one, are below this are sampled
    /// (2^63 at ratio 1: every trace).
    bound: u64,
}

impl Sampler {
    pub fn new(ratio: f64) -> Self {
        let ratio = if ratio.is_finite() {
            ratio.clamp(0.0, 1.0)
        } else {
            0.0
        };
        Sampler {
            bound: (ratio * (1u64 << 63) as f64) as u64,
        }
    }

    pub fn sampled(&self, parent: Option<Parent>, trace_id: u128) -> bool {
        match parent {
            Some(p) => p.sampled,
            None => ((trace_id as u64) >> 1) < self.bound,
        }
    }
}

/// Span and trace ids: splitmix64, seeded per process. Ids need to be unique, not secret.
struct Ids(u64);

impl Ids {
    fn seeded() -> Self {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Ids(t ^ u64::from(std::process::id()).rotate_left(32))
    }

    fn next(&mut self) -> u64 {
        loop {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z != 0 {
                return z;
            }
        }
    }
}

fn unix_ns_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn system_time(unix_ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(unix_ns)
}

/// How an admission span ended.
#[derive(Debug)]
enum Ending {
    /// At the decision: a shed call, or an admitted one whose span could not stay open.
    Decided,
    Released(Arc<ReleaseEvent>),
    LeaseExpired,
    /// The daemon stopped while the lease was live.
    Stopped,
}

/// An admission span as the actor keeps it: what `SpanData` is built from, without building it.
#[derive(Debug)]
struct AdmissionSpan {
    trace_id: u128,
    span_id: u64,
    /// 0 when the call started a new trace.
    parent_span_id: u64,
    start_ns: u64,
    decided_ns: u64,
    end_ns: u64,
    tenant: Arc<str>,
    tool: Arc<str>,
    upstream: Option<Arc<str>>,
    subject_hash: u64,
    cost: f64,
    kind: DecisionKind,
    scope: Option<Scope>,
    waited_ns: u64,
    retry_after_ms: u64,
    decision_ns: u64,
    call_id: Option<String>,
    /// Admitted spans that stayed open carry an `admitd.admitted` event.
    opened: bool,
    ending: Ending,
}

/// A finished span on its way to the export thread.
#[derive(Debug)]
pub struct Finished(FinishedKind);

#[derive(Debug)]
enum FinishedKind {
    Admission(Box<AdmissionSpan>),
    Feedback {
        trace_id: u128,
        span_id: u64,
        at_ns: u64,
        event: Arc<FeedbackEvent>,
    },
}

fn shared(s: Arc<str>) -> Value {
    Value::String(StringValue::from(s))
}

fn attr(key: &'static str, value: impl Into<Value>) -> KeyValue {
    KeyValue::new(key, value)
}

fn context(trace_id: u128, span_id: u64) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(trace_id.to_be_bytes()),
        SpanId::from_bytes(span_id.to_be_bytes()),
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    )
}

fn release_attributes(r: &ReleaseEvent) -> Vec<KeyValue> {
    let mut attrs = Vec::with_capacity(5);
    attrs.push(attr("admitd.outcome", r.outcome));
    if let Some(s) = r.upstream_status {
        attrs.push(attr("http.response.status_code", i64::from(s)));
    }
    if let Some(ra) = &r.retry_after {
        attrs.push(attr("admitd.retry_after", ra.clone()));
    }
    if let Some(p) = r.penalty_ms {
        attrs.push(attr("admitd.penalty_ms", p as i64));
    }
    if let Some(d) = r.duration_ms {
        attrs.push(attr("admitd.tool_duration_ms", d as i64));
    }
    attrs
}

impl Finished {
    /// The span as OpenTelemetry's SDK describes it, for the OTLP exporter.
    fn into_span_data(self, scope: &InstrumentationScope) -> SpanData {
        match self.0 {
            FinishedKind::Admission(s) => (*s).into_span_data(scope),
            FinishedKind::Feedback {
                trace_id,
                span_id,
                at_ns,
                event: f,
            } => {
                let mut attrs = vec![
                    attr("admitd.tenant", shared(f.tenant.clone())),
                    attr("admitd.upstream", shared(f.upstream.clone())),
                    attr("http.response.status_code", i64::from(f.status)),
                ];
                if let Some(ra) = &f.retry_after {
                    attrs.push(attr("admitd.retry_after", ra.clone()));
                }
                if let Some(p) = f.penalty_ms {
                    attrs.push(attr("admitd.penalty_ms", p as i64));
                }
                let at = system_time(at_ns);
                span_data(
                    context(trace_id, span_id),
                    SpanId::INVALID,
                    Cow::Borrowed("admitd upstream_feedback"),
                    (at, at),
                    Vec::new(),
                    vec![SpanEvent::new("admitd.feedback", at, attrs, 0)],
                    Status::Unset,
                    scope,
                )
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn span_data(
    span_context: SpanContext,
    parent_span_id: SpanId,
    name: Cow<'static, str>,
    (start_time, end_time): (SystemTime, SystemTime),
    attributes: Vec<KeyValue>,
    events: Vec<SpanEvent>,
    status: Status,
    scope: &InstrumentationScope,
) -> SpanData {
    let mut span_events = SpanEvents::default();
    span_events.events = events;
    SpanData {
        span_context,
        parent_span_is_remote: parent_span_id != SpanId::INVALID,
        parent_span_id,
        span_kind: SpanKind::Internal,
        name,
        start_time,
        end_time,
        attributes,
        dropped_attributes_count: 0,
        events: span_events,
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    }
}

impl AdmissionSpan {
    fn into_span_data(self, scope: &InstrumentationScope) -> SpanData {
        let s = self;
        let scope_name = s.scope.map_or("none", |sc| sc.as_str());
        let mut attrs = Vec::with_capacity(14);
        attrs.push(attr("gen_ai.operation.name", "execute_tool"));
        attrs.push(attr("gen_ai.tool.name", shared(s.tool.clone())));
        attrs.push(attr("mcp.method.name", "tools/call"));
        attrs.push(attr("admitd.tenant", shared(s.tenant)));
        attrs.push(attr("admitd.subject_hash", hex16(s.subject_hash)));
        attrs.push(attr(
            "admitd.upstream",
            s.upstream.map_or(Value::from("none"), shared),
        ));
        attrs.push(attr("admitd.cost", s.cost));
        attrs.push(attr("admitd.decision", s.kind.as_str()));
        attrs.push(attr("admitd.scope", scope_name));
        attrs.push(attr("admitd.waited_ms", (s.waited_ns / 1_000_000) as i64));
        attrs.push(attr("admitd.retry_after_ms", s.retry_after_ms as i64));
        attrs.push(attr("admitd.decision_us", (s.decision_ns / 1_000) as i64));
        if let Some(id) = s.call_id {
            attrs.push(attr("gen_ai.tool.call.id", id));
        }
        let mut status = Status::Unset;
        if s.kind == DecisionKind::Shed {
            attrs.push(attr("error.type", "rate_limited"));
            status = Status::error(format!("shed by {scope_name}"));
        }
        let mut events = Vec::new();
        if s.opened {
            events.push(SpanEvent::new(
                "admitd.admitted",
                system_time(s.decided_ns + s.waited_ns),
                vec![attr("admitd.waited_ms", (s.waited_ns / 1_000_000) as i64)],
                0,
            ));
        }
        match s.ending {
            Ending::Decided | Ending::Stopped => {}
            Ending::LeaseExpired => events.push(SpanEvent::new(
                "admitd.lease_expired",
                system_time(s.end_ns),
                Vec::new(),
                0,
            )),
            Ending::Released(r) => {
                events.push(SpanEvent::new(
                    "admitd.release",
                    system_time(s.end_ns),
                    release_attributes(&r),
                    0,
                ));
                if r.outcome == "upstream_rate_limited" || r.upstream_status == Some(429) {
                    attrs.push(attr("error.type", "429"));
                    status = Status::error("upstream rate limited");
                } else if r.outcome == "error" {
                    status = Status::error("tool error");
                }
            }
        }
        let parent = match s.parent_span_id {
            0 => SpanId::INVALID,
            p => SpanId::from_bytes(p.to_be_bytes()),
        };
        span_data(
            context(s.trace_id, s.span_id),
            parent,
            Cow::Owned(["execute_tool ", &s.tool].concat()),
            (system_time(s.start_ns), system_time(s.end_ns)),
            attrs,
            events,
            status,
            scope,
        )
    }
}

/// The export side: a thread that builds and exports what the actor finished.
pub struct Exporter {
    tx: SyncSender<Vec<Finished>>,
    done: Receiver<()>,
    paused: Pause,
}

/// Until when (monotonic ns) the export thread drops what it gets, shared with the span actor so it
/// does not even record spans that would be dropped.
#[derive(Debug, Clone, Default)]
struct Pause(Arc<AtomicU64>);

impl Pause {
    fn set(&self, until: Option<Nanos>) {
        self.0.store(until.unwrap_or(0), Ordering::Relaxed);
    }

    fn active(&self, now: Nanos) -> bool {
        now < self.0.load(Ordering::Relaxed)
    }
}

/// Starts the OTLP exporter on a thread of its own. Fails when the exporter cannot be set up (an
/// endpoint the HTTP or gRPC client refuses).
pub fn start(cfg: &OtlpConfig, clock: Arc<dyn Clock>) -> Result<Exporter, String> {
    let cfg = cfg.clone();
    let (tx, rx) = mpsc::sync_channel::<Vec<Finished>>(EXPORT_QUEUE);
    let (done_tx, done) = mpsc::channel();
    let (ready_tx, ready) = mpsc::channel();
    let paused = Pause::default();
    let pause = paused.clone();
    std::thread::Builder::new()
        .name("otlp-export".into())
        .spawn(move || {
            let cannot = |e: &dyn std::fmt::Display| {
                format!(
                    "cannot set up OTLP export ({}) to {}: {e}",
                    cfg.protocol.as_str(),
                    cfg.endpoint
                )
            };
            let run = |mut exporter: Box<dyn ExportOn>| {
                let _ = ready_tx.send(Ok(()));
                exporter.set_resource(
                    &Resource::builder()
                        .with_service_name(cfg.service_name.clone())
                        .build(),
                );
                export_loop(&*exporter, &rx, &*clock, &pause, &cfg.endpoint);
                exporter.shutdown();
                let _ = done_tx.send(());
            };
            // A failed export pauses export (see `Backoff`) instead of being retried at once:
            // retries would hold the export thread while the queue overflows.
            let no_retry = opentelemetry_otlp::RetryPolicy::disabled();
            match cfg.protocol {
                OtlpProtocol::HttpProtobuf | OtlpProtocol::HttpJson => {
                    // The blocking HTTP client is created, used and dropped on this plain thread,
                    // never on an async runtime's.
                    let protocol = match cfg.protocol {
                        OtlpProtocol::HttpJson => Protocol::HttpJson,
                        _ => Protocol::HttpBinary,
                    };
                    match opentelemetry_otlp::SpanExporter::builder()
                        .with_http()
                        .with_endpoint(cfg.endpoint.clone())
                        .with_protocol(protocol)
                        .with_timeout(EXPORT_TIMEOUT)
                        .with_retry_policy(no_retry)
                        .build()
                    {
                        Ok(e) => run(Box::new(Blocking(e))),
                        Err(e) => {
                            let _ = ready_tx.send(Err(cannot(&e)));
                        }
                    }
                }
                OtlpProtocol::Grpc => {
                    // tonic needs a tokio runtime: a single-threaded one that runs only while this
                    // thread exports.
                    let built = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| cannot(&e))
                        .and_then(|rt| {
                            let _entered = rt.enter();
                            opentelemetry_otlp::SpanExporter::builder()
                                .with_tonic()
                                .with_endpoint(cfg.endpoint.clone())
                                .with_protocol(Protocol::Grpc)
                                .with_timeout(EXPORT_TIMEOUT)
                                .with_retry_policy(no_retry)
                                .build()
                                .map_err(|e| cannot(&e))
                                .map(|e| OnRuntime(e, rt))
                        });
                    match built {
                        Ok(e) => run(Box::new(e)),
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                }
            }
        })
        .map_err(|e| format!("cannot start the OTLP export thread: {e}"))?;
    ready
        .recv()
        .map_err(|_| "the OTLP export thread stopped while starting".to_string())??;
    Ok(Exporter { tx, done, paused })
}

/// A collector that does not answer within this is treated as down.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// An exporter as the export thread drives it: one blocking call per batch.
trait ExportOn {
    fn export_blocking(&self, batch: Vec<SpanData>) -> OTelSdkResult;
    fn set_resource(&mut self, resource: &Resource);
    fn shutdown(&mut self);
}

/// An exporter whose futures need no runtime (the blocking HTTP client's).
struct Blocking<E>(E);

impl<E: SpanExporter> ExportOn for Blocking<E> {
    fn export_blocking(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        futures_executor::block_on(self.0.export(batch))
    }
    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
    fn shutdown(&mut self) {
        let _ = self.0.shutdown();
    }
}

/// An exporter whose futures run on a tokio runtime (tonic's).
struct OnRuntime<E>(E, tokio::runtime::Runtime);

impl<E: SpanExporter> ExportOn for OnRuntime<E> {
    fn export_blocking(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.1.block_on(self.0.export(batch))
    }
    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
    fn shutdown(&mut self) {
        let _entered = self.1.enter();
        let _ = self.0.shutdown();
    }
}

impl Exporter {
    fn sender(&self) -> SyncSender<Vec<Finished>> {
        self.tx.clone()
    }

    /// Waits (up to `timeout`) for the export thread to export what it was given. Call after the
    /// span actor stopped: the thread finishes once every sender is gone.
    pub fn shutdown(self, timeout: Duration) {
        drop(self.tx);
        let _ = self.done.recv_timeout(timeout);
    }
}

fn count_dropped(reason: &'static str, n: usize) {
    if n > 0 {
        ::metrics::counter!(names::SPANS_DROPPED, "reason" => reason).increment(n as u64);
    }
}

/// When export may be tried again after failures.
#[derive(Debug, Default)]
struct Backoff {
    /// Monotonic time before which batches are dropped; `None` while exports succeed.
    until: Option<Nanos>,
    next: Nanos,
}

impl Backoff {
    fn waiting(&self, now: Nanos) -> bool {
        self.until.is_some_and(|t| now < t)
    }

    /// Records a failed export; returns how long batches will now be dropped.
    fn failed(&mut self, now: Nanos) -> Nanos {
        let wait = self.next.max(FIRST_BACKOFF);
        self.until = Some(now + wait);
        self.next = (wait * 2).min(MAX_BACKOFF);
        wait
    }

    /// Records a successful export; true when it ends a run of failures.
    fn succeeded(&mut self) -> bool {
        self.next = 0;
        self.until.take().is_some()
    }
}

/// The export thread's state: what it exports with, and whether export is paused after failures.
struct ExportState<'a, E: ?Sized> {
    exporter: &'a E,
    scope: InstrumentationScope,
    backoff: Backoff,
    pause: &'a Pause,
    endpoint: &'a str,
}

impl<'a, E: ExportOn + ?Sized> ExportState<'a, E> {
    fn new(exporter: &'a E, pause: &'a Pause, endpoint: &'a str) -> Self {
        ExportState {
            exporter,
            scope: InstrumentationScope::builder("admitd")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            backoff: Backoff::default(),
            pause,
            endpoint,
        }
    }

    /// How long to wait for the next batch before probing the collector; `None` while export works.
    fn probe_in(&self, now: Nanos) -> Option<Duration> {
        self.backoff
            .until
            .map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }

    /// Builds and exports a batch, or drops it while export is paused.
    fn batch(&mut self, batch: Vec<Finished>, now: Nanos) {
        if self.backoff.waiting(now) {
            count_dropped("export_failed", batch.len());
            return;
        }
        let n = batch.len();
        let data: Vec<SpanData> = batch
            .into_iter()
            .map(|f| f.into_span_data(&self.scope))
            .collect();
        self.export(data, n, now);
    }

    /// Asks the collector whether it is back, with an empty export, once the pause is over.
    fn probe(&mut self, now: Nanos) {
        if !self.backoff.waiting(now) {
            self.export(Vec::new(), 0, now);
        }
    }

    fn export(&mut self, data: Vec<SpanData>, n: usize, now: Nanos) {
        match self.exporter.export_blocking(data) {
            Ok(()) => {
                if n > 0 {
                    ::metrics::counter!(names::SPANS_EXPORTED).increment(n as u64);
                }
                if self.backoff.succeeded() {
                    self.pause.set(None);
                    tracing::info!(endpoint = self.endpoint, "OTLP span export works again");
                }
            }
            Err(e) => {
                count_dropped("export_failed", n);
                let first = self.backoff.until.is_none();
                let wait = self.backoff.failed(now);
                self.pause.set(self.backoff.until);
                if first {
                    tracing::warn!(
                        endpoint = self.endpoint,
                        error = %e,
                        "OTLP span export failed; spans are not recorded until the collector answers again (asked again in {} s, then less and less often)",
                        wait / NS_PER_SEC
                    );
                }
            }
        }
    }
}

/// Builds and exports batches until every sender is gone. While export is paused, batches that
/// still arrive (spans that were open) are dropped and the collector is probed when the pause ends.
fn export_loop<E: ExportOn + ?Sized>(
    exporter: &E,
    rx: &Receiver<Vec<Finished>>,
    clock: &dyn Clock,
    pause: &Pause,
    endpoint: &str,
) {
    let mut state = ExportState::new(exporter, pause, endpoint);
    loop {
        let next = match state.probe_in(clock.mono()) {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(wait) => rx.recv_timeout(wait),
        };
        match next {
            Ok(batch) => state.batch(batch, clock.mono()),
            Err(RecvTimeoutError::Timeout) => state.probe(clock.mono()),
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
}

/// Identifies a live lease's span: the lease number and its tenant (numbers repeat across tenants).
type OpenKey = (u64, Arc<str>);

/// An [`OpenKey`] to look up with, borrowing the tenant. Hashes as the tuple does.
#[derive(Hash)]
struct OpenRef<'a>(u64, &'a str);

impl hashbrown::Equivalent<OpenKey> for OpenRef<'_> {
    fn equivalent(&self, key: &OpenKey) -> bool {
        self.0 == key.0 && self.1 == &*key.1
    }
}

pub struct SpanActor {
    clock: Arc<dyn Clock>,
    lease_ttl: Duration,
    sampler: Sampler,
    /// At most `max_spans_per_second` spans a second (none: no limit). Exporting a span costs a few
    /// microseconds of CPU here and more on the collector; unbounded, a daemon deciding tens of
    /// thousands of calls a second would spend a fifth of its core on them.
    budget: Option<Throttle>,
    /// Monotonic time of the batch being handled.
    now: Nanos,
    /// Sampled calls of the batch being handled that got no span because the budget was spent.
    over_budget: usize,
    ids: Ids,
    open: hashbrown::HashMap<OpenKey, (Box<AdmissionSpan>, Nanos), foldhash::fast::RandomState>,
    finished: Vec<Finished>,
    to_export: SyncSender<Vec<Finished>>,
    /// Set while export is failing: new spans are not recorded.
    paused: Pause,
}

impl SpanActor {
    pub fn new(
        exporter: &Exporter,
        cfg: &OtlpConfig,
        clock: Arc<dyn Clock>,
        lease_ttl: Duration,
    ) -> Self {
        Self::with_sender(
            exporter.sender(),
            exporter.paused.clone(),
            cfg,
            clock,
            lease_ttl,
        )
    }

    fn with_sender(
        to_export: SyncSender<Vec<Finished>>,
        paused: Pause,
        cfg: &OtlpConfig,
        clock: Arc<dyn Clock>,
        lease_ttl: Duration,
    ) -> Self {
        let now = clock.mono();
        SpanActor {
            clock,
            lease_ttl,
            sampler: Sampler::new(cfg.sample_ratio),
            budget: (cfg.max_spans_per_second > 0)
                .then(|| Throttle::new(f64::from(cfg.max_spans_per_second))),
            now,
            over_budget: 0,
            ids: Ids::seeded(),
            open: Default::default(),
            finished: Vec::with_capacity(EXPORT_BATCH),
            to_export,
            paused,
        }
    }

    /// Takes a place in the span budget; counts the call when there is none.
    fn within_budget(&mut self) -> bool {
        let now = self.now;
        let ok = self.budget.as_mut().is_none_or(|b| b.allow(now));
        if !ok {
            self.over_budget += 1;
        }
        ok
    }

    fn finish(&mut self, f: Finished) {
        self.finished.push(f);
        if self.finished.len() >= EXPORT_BATCH {
            self.hand_over();
        }
    }

    /// Gives the finished spans to the export thread, or drops them when its queue is full.
    fn hand_over(&mut self) {
        if self.finished.is_empty() {
            return;
        }
        let batch = std::mem::replace(&mut self.finished, Vec::with_capacity(EXPORT_BATCH));
        match self.to_export.try_send(batch) {
            Ok(()) => {}
            Err(TrySendError::Full(b) | TrySendError::Disconnected(b)) => {
                count_dropped("queue_full", b.len());
                // The export thread is behind (or stuck on a collector that does not answer):
                // spans recorded now would be dropped too.
                self.paused.set(Some(self.clock.mono() + QUEUE_FULL_PAUSE));
            }
        }
    }

    fn decision(&mut self, d: &DecisionEvent) {
        let fields = d.span.as_deref();
        let parent = fields
            .and_then(|f| f.traceparent.as_deref())
            .and_then(parse_traceparent);
        let trace_id = match parent {
            Some(p) => p.trace_id,
            None => u128::from(self.ids.next()) << 64 | u128::from(self.ids.next()),
        };
        if !self.sampler.sampled(parent, trace_id) {
            return;
        }
        if !self.within_budget() {
            return;
        }
        let start_ns = fields.map_or(0, |f| f.start_unix_ns.min(u128::from(u64::MAX)) as u64);
        let decided_ns = start_ns.saturating_add(d.decision_ns);
        let mut span = Box::new(AdmissionSpan {
            trace_id,
            span_id: self.ids.next(),
            parent_span_id: parent.map_or(0, |p| p.span_id),
            start_ns,
            decided_ns,
            end_ns: decided_ns,
            tenant: d.tenant.clone(),
            tool: d.tool.clone(),
            upstream: d.upstream.clone(),
            subject_hash: super::fnv1a(&d.subject),
            cost: d.cost,
            kind: d.kind,
            scope: d.scope,
            waited_ns: d.waited_ns,
            retry_after_ms: d.retry_after_ms,
            decision_ns: d.decision_ns,
            call_id: d.call_id.clone(),
            opened: false,
            ending: Ending::Decided,
        });
        if d.kind != DecisionKind::Shed && self.open.len() < MAX_OPEN {
            if let Some(lease) = fields.and_then(|f| f.lease) {
                span.opened = true;
                self.open
                    .insert((lease, d.tenant.clone()), (span, self.clock.mono()));
                return;
            }
        }
        self.finish(Finished(FinishedKind::Admission(span)));
    }

    fn release(&mut self, r: &Arc<ReleaseEvent>) {
        let Some((mut span, _)) = self.open.remove(&OpenRef(r.lease, &r.tenant)) else {
            return;
        };
        span.end_ns = unix_ns_now().max(span.decided_ns);
        span.ending = Ending::Released(r.clone());
        self.finish(Finished(FinishedKind::Admission(span)));
    }

    fn feedback(&mut self, f: &Arc<FeedbackEvent>) {
        let trace_id = u128::from(self.ids.next()) << 64 | u128::from(self.ids.next());
        if !self.sampler.sampled(None, trace_id) {
            return;
        }
        if !self.within_budget() {
            return;
        }
        let span_id = self.ids.next();
        self.finish(Finished(FinishedKind::Feedback {
            trace_id,
            span_id,
            at_ns: unix_ns_now(),
            event: f.clone(),
        }));
    }

    /// Ends the spans of leases that outlived the lease TTL (their servers never released them).
    fn sweep(&mut self) {
        let now = self.clock.mono();
        let limit = self.lease_ttl.as_nanos() as u64 + 5 * NS_PER_SEC;
        let expired: Vec<OpenKey> = self
            .open
            .iter()
            .filter(|(_, (_, opened))| now.saturating_sub(*opened) > limit)
            .map(|(k, _)| k.clone())
            .collect();
        let end_ns = unix_ns_now();
        for k in expired {
            if let Some((mut span, _)) = self.open.remove(&k) {
                span.end_ns = end_ns.max(span.decided_ns);
                span.ending = Ending::LeaseExpired;
                self.finish(Finished(FinishedKind::Admission(span)));
            }
        }
    }

    /// Ends every open span (the daemon stops) and hands everything over for export.
    fn end_all(&mut self) {
        let end_ns = unix_ns_now();
        let open: Vec<_> = self.open.drain().map(|(_, (span, _))| span).collect();
        for mut span in open {
            span.end_ns = end_ns.max(span.decided_ns);
            span.ending = Ending::Stopped;
            self.finish(Finished(FinishedKind::Admission(span)));
        }
        self.hand_over();
    }

    fn handle_events(&mut self, events: &[Event]) {
        // While export fails, new spans would only be dropped: record none (spans already open still
        // end, and their export probes whether the collector is back).
        self.now = self.clock.mono();
        let record = !self.paused.active(self.now);
        let mut skipped = 0;
        for ev in events {
            match ev {
                Event::Decision(d) if record => self.decision(d),
                Event::Feedback(f) if record => self.feedback(f),
                Event::Release(r) => self.release(r),
                Event::Decision(_) | Event::Feedback(_) => skipped += 1,
                Event::Tenant(_) => {}
            }
        }
        count_dropped("paused", skipped);
        count_dropped("rate_limited", std::mem::take(&mut self.over_budget));
    }
}

impl Actor for SpanActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(super::MAILBOX);
        ctx.run_interval(Duration::from_secs(5), |act, _| act.sweep());
        ctx.run_interval(FLUSH_EVERY, |act, _| act.hand_over());
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.end_all();
    }
}

impl Drop for SpanActor {
    /// An arbiter that stops may drop its actors without stopping them first.
    fn drop(&mut self) {
        self.end_all();
    }
}

impl Handler<super::Batch> for SpanActor {
    type Result = ();

    fn handle(&mut self, batch: super::Batch, _: &mut Context<Self>) {
        self.handle_events(&batch.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn traceparents_follow_the_w3c_layout() {
        let p = parse_traceparent(TP).unwrap();
        assert_eq!(p.trace_id, 0x0af7651916cd43dd8448eb211c80319c);
        assert_eq!(p.span_id, 0xb7ad6b7169203331);
        assert!(p.sampled);
        let unsampled = parse_traceparent(&TP.replace("-01", "-00")).unwrap();
        assert!(!unsampled.sampled);
        // A later version may append fields after a dash; version 00 may not.
        assert!(parse_traceparent(&format!("01{}-later", &TP[2..])).is_some());
        for bad in [
            "",
            "garbage",
            &format!("{TP}-later"),
            &TP.to_uppercase(),
            &format!("ff{}", &TP[2..]),
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sampling_follows_the_parent_or_the_ratio_of_trace_ids() {
        let parent = |sampled| {
            Some(Parent {
                trace_id: 1,
                span_id: 1,
                sampled,
            })
        };
        assert!(Sampler::new(0.0).sampled(parent(true), 1));
        assert!(!Sampler::new(1.0).sampled(parent(false), 1));
        let mut ids = Ids(42);
        let roots: Vec<u128> = (0..20_000)
            .map(|_| u128::from(ids.next()) << 64 | u128::from(ids.next()))
            .collect();
        let share = |ratio| {
            let s = Sampler::new(ratio);
            roots.iter().filter(|&&t| s.sampled(None, t)).count() as f64 / roots.len() as f64
        };
        assert_eq!(share(1.0), 1.0);
        assert_eq!(share(0.0), 0.0);
        let quarter = share(0.25);
        assert!((0.23..0.27).contains(&quarter), "{quarter}");
    }

    fn decision(tenant: &str, kind: DecisionKind, lease: Option<u64>) -> DecisionEvent {
        DecisionEvent {
            tenant: Arc::from(tenant),
            subject: Arc::from("agent-7"),
            subject_label: Arc::from("agent-7"),
            tool: Arc::from("search"),
            upstream: Some(Arc::from("warehouse")),
            cost: 2.0,
            kind,
            scope: (kind == DecisionKind::Shed).then_some(Scope::Subject),
            retryable: kind == DecisionKind::Shed,
            waited_ns: 3_000_000,
            retry_after_ms: if kind == DecisionKind::Shed { 1500 } else { 0 },
            decision_ns: 40_000,
            call_id: Some("c-1".into()),
            span: Some(Box::new(crate::telemetry::SpanFields {
                traceparent: None,
                lease,
                start_unix_ns: 1_700_000_000_000_000_000,
            })),
        }
    }

    /// An admitted call holding `lease`.
    fn admit(a: &mut SpanActor, tenant: &str, lease: u64) {
        a.handle_events(&[Event::Decision(decision(
            tenant,
            DecisionKind::Admitted,
            Some(lease),
        ))]);
    }

    fn release(tenant: &str, lease: u64, status: Option<u16>) -> Arc<ReleaseEvent> {
        Arc::new(ReleaseEvent {
            tenant: Arc::from(tenant),
            subject: Arc::from("agent-7"),
            tool: Arc::from("search"),
            upstream: Some(Arc::from("warehouse")),
            outcome: if status == Some(429) {
                "upstream_rate_limited"
            } else {
                "ok"
            },
            upstream_status: status,
            retry_after: status.filter(|&s| s == 429).map(|_| "30".to_string()),
            penalty_ms: None,
            duration_ms: Some(120),
            lease,
        })
    }

    fn feedback_event() -> FeedbackEvent {
        FeedbackEvent {
            tenant: "acme".into(),
            upstream: "crm".into(),
            status: 429,
            retry_after: Some("2".into()),
            penalty_ms: Some(2000),
        }
    }

    fn otlp(sample_ratio: f64, max_spans_per_second: u32) -> OtlpConfig {
        OtlpConfig {
            endpoint: "http://127.0.0.1:9/v1/traces".into(),
            service_name: "admitd".into(),
            sample_ratio,
            max_spans_per_second,
            protocol: OtlpProtocol::HttpProtobuf,
        }
    }

    fn actor(clock: &FakeClock, ratio: f64) -> (SpanActor, Receiver<Vec<Finished>>) {
        limited_actor(clock, ratio, 0)
    }

    fn limited_actor(
        clock: &FakeClock,
        ratio: f64,
        per_sec: u32,
    ) -> (SpanActor, Receiver<Vec<Finished>>) {
        let (tx, rx) = mpsc::sync_channel(EXPORT_QUEUE);
        let a = SpanActor::with_sender(
            tx,
            Pause::default(),
            &otlp(ratio, per_sec),
            Arc::new(clock.clone()),
            Duration::from_secs(10),
        );
        (a, rx)
    }

    /// Everything the actor handed over, as the exporter will see it.
    fn exported(a: &mut SpanActor, rx: &Receiver<Vec<Finished>>) -> Vec<SpanData> {
        a.hand_over();
        let scope = InstrumentationScope::builder("admitd").build();
        rx.try_iter()
            .flatten()
            .map(|f| f.into_span_data(&scope))
            .collect()
    }

    fn attr_of<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
        attrs
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| &kv.value)
    }

    fn text(attrs: &[KeyValue], key: &str) -> Option<String> {
        attr_of(attrs, key).map(|v| v.as_str().into_owned())
    }

    #[test]
    fn a_shed_call_is_one_finished_span_with_the_conventions_and_an_error_status() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        let mut d = decision("acme", DecisionKind::Shed, None);
        d.span.as_mut().unwrap().traceparent = Some(TP.into());
        a.handle_events(&[Event::Decision(d)]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(s.name, "execute_tool search");
        assert_eq!(
            s.span_context.trace_id(),
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap()
        );
        assert_eq!(
            s.parent_span_id,
            SpanId::from_hex("b7ad6b7169203331").unwrap()
        );
        assert!(s.parent_span_is_remote);
        let at = |ns: u64| UNIX_EPOCH + Duration::from_nanos(ns);
        assert_eq!(s.start_time, at(1_700_000_000_000_000_000));
        assert_eq!(
            s.end_time,
            at(1_700_000_000_000_040_000),
            "ends at the decision"
        );
        let a_ = &s.attributes;
        for (k, v) in [
            ("gen_ai.operation.name", "execute_tool"),
            ("gen_ai.tool.name", "search"),
            ("mcp.method.name", "tools/call"),
            ("gen_ai.tool.call.id", "c-1"),
            ("admitd.tenant", "acme"),
            ("admitd.upstream", "warehouse"),
            ("admitd.decision", "shed"),
            ("admitd.scope", "subject"),
            ("error.type", "rate_limited"),
        ] {
            assert_eq!(text(a_, k).as_deref(), Some(v), "{k}");
        }
        assert_eq!(
            text(a_, "admitd.subject_hash"),
            Some(super::super::hash_identity("agent-7"))
        );
        assert_eq!(
            attr_of(a_, "admitd.retry_after_ms"),
            Some(&Value::I64(1500))
        );
        assert_eq!(attr_of(a_, "admitd.waited_ms"), Some(&Value::I64(3)));
        assert_eq!(attr_of(a_, "admitd.cost"), Some(&Value::F64(2.0)));
        assert_eq!(s.status, Status::error("shed by subject"));
        assert!(s.events.is_empty());
    }

    #[test]
    fn an_admitted_call_stays_open_until_its_lease_is_released_by_its_own_tenant() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        a.handle_events(&[
            Event::Decision(decision("acme", DecisionKind::Admitted, Some(5))),
            Event::Decision(decision("globex", DecisionKind::Admitted, Some(5))),
        ]);
        assert!(exported(&mut a, &rx).is_empty(), "open while leased");
        // The same lease number of another tenant ends only that tenant's span.
        a.handle_events(&[Event::Release(release("globex", 5, Some(429)))]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(
            text(&s.attributes, "admitd.tenant").as_deref(),
            Some("globex")
        );
        assert_eq!(
            s.parent_span_id,
            SpanId::INVALID,
            "no caller trace: a root span"
        );
        let names: Vec<&str> = s.events.iter().map(|e| e.name.as_ref()).collect();
        assert_eq!(names, ["admitd.admitted", "admitd.release"]);
        let rel = &s.events.events[1].attributes;
        assert_eq!(
            attr_of(rel, "http.response.status_code"),
            Some(&Value::I64(429))
        );
        assert_eq!(text(rel, "admitd.retry_after").as_deref(), Some("30"));
        assert_eq!(text(&s.attributes, "error.type").as_deref(), Some("429"));
        assert_eq!(s.status, Status::error("upstream rate limited"));
        assert!(s.end_time >= s.start_time);
        // A second release of the same lease finds nothing.
        a.handle_events(&[Event::Release(release("globex", 5, None))]);
        assert!(exported(&mut a, &rx).is_empty());
        a.handle_events(&[Event::Release(release("acme", 5, None))]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].status, Status::Unset);
    }

    #[test]
    fn leases_never_released_end_with_lease_expired_and_open_spans_end_when_the_actor_goes() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        admit(&mut a, "acme", 1);
        clock.advance(Duration::from_secs(14));
        a.sweep();
        assert!(exported(&mut a, &rx).is_empty(), "within lease TTL + 5 s");
        admit(&mut a, "acme", 2);
        clock.advance(Duration::from_secs(2));
        a.sweep();
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        let names: Vec<&str> = spans[0].events.iter().map(|e| e.name.as_ref()).collect();
        assert_eq!(names, ["admitd.admitted", "admitd.lease_expired"]);
        drop(a);
        let scope = InstrumentationScope::builder("admitd").build();
        let left: Vec<SpanData> = rx
            .try_iter()
            .flatten()
            .map(|f| f.into_span_data(&scope))
            .collect();
        assert_eq!(
            left.len(),
            1,
            "the span of lease 2 is exported when the actor goes"
        );
    }

    #[test]
    fn unsampled_calls_record_nothing_and_sampled_parents_always_record() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 0.0);
        let mut unsampled = decision("acme", DecisionKind::Shed, None);
        unsampled.span.as_mut().unwrap().traceparent = Some(TP.replace("-01", "-00"));
        let mut sampled = decision("acme", DecisionKind::Shed, None);
        sampled.span.as_mut().unwrap().traceparent = Some(TP.into());
        a.handle_events(&[
            Event::Decision(decision("acme", DecisionKind::Shed, None)),
            Event::Decision(unsampled),
            Event::Decision(sampled),
        ]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        assert_eq!(
            spans[0].parent_span_id,
            SpanId::from_hex("b7ad6b7169203331").unwrap()
        );
    }

    #[test]
    fn calls_past_the_span_budget_get_no_span_whatever_their_parent_says() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = limited_actor(&clock, 1.0, 3);
        let mut parented = decision("acme", DecisionKind::Shed, None);
        parented.span.as_mut().unwrap().traceparent = Some(TP.into());
        let calls: Vec<Event> = (0..4)
            .map(|_| Event::Decision(decision("acme", DecisionKind::Shed, None)))
            .chain([
                Event::Decision(parented.clone()),
                Event::Feedback(Arc::new(feedback_event())),
            ])
            .collect();
        a.handle_events(&calls);
        assert_eq!(
            exported(&mut a, &rx).len(),
            3,
            "three spans in the first second"
        );
        // spans already open still end when the budget is spent
        clock.advance(Duration::from_secs(1));
        admit(&mut a, "acme", 7);
        a.handle_events(&calls);
        assert_eq!(
            exported(&mut a, &rx).len(),
            2,
            "the budget refilled: three spans, one of them open"
        );
        a.handle_events(&[Event::Release(release("acme", 7, None))]);
        assert_eq!(
            exported(&mut a, &rx).len(),
            1,
            "the open span ends at release"
        );
        clock.advance(Duration::from_millis(340));
        a.handle_events(&[Event::Decision(parented)]);
        assert_eq!(
            exported(&mut a, &rx).len(),
            1,
            "a sampled parent's call gets a span once the budget has refilled a place"
        );
    }

    #[test]
    fn while_export_is_paused_new_spans_are_not_recorded_but_open_ones_still_end() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        admit(&mut a, "acme", 1);
        a.paused.set(Some(clock.mono() + NS_PER_SEC));
        a.handle_events(&[
            Event::Decision(decision("acme", DecisionKind::Shed, None)),
            Event::Decision(decision("acme", DecisionKind::Admitted, Some(2))),
            Event::Release(release("acme", 1, None)),
        ]);
        assert_eq!(a.open.len(), 0);
        assert_eq!(
            exported(&mut a, &rx).len(),
            1,
            "only the span that was open"
        );
        clock.advance(Duration::from_secs(1));
        a.handle_events(&[Event::Decision(decision("acme", DecisionKind::Shed, None))]);
        assert_eq!(
            exported(&mut a, &rx).len(),
            1,
            "recording again after the pause"
        );
    }

    #[test]
    fn a_full_export_queue_drops_the_batch_and_pauses_recording() {
        let clock = FakeClock::new(0);
        let (tx, rx) = mpsc::sync_channel(1);
        let mut a = SpanActor::with_sender(
            tx,
            Pause::default(),
            &otlp(1.0, 0),
            Arc::new(clock.clone()),
            Duration::from_secs(10),
        );
        let sheds: Vec<Event> = (0..EXPORT_BATCH * 2)
            .map(|_| Event::Decision(decision("acme", DecisionKind::Shed, None)))
            .collect();
        a.handle_events(&sheds);
        assert_eq!(
            rx.try_iter().count(),
            1,
            "the queue holds one batch; the second is dropped"
        );
        assert!(a.paused.active(clock.mono()));
        a.handle_events(&sheds[..1]);
        assert!(a.finished.is_empty(), "not recorded while paused");
        clock.advance(Duration::from_nanos(QUEUE_FULL_PAUSE));
        a.handle_events(&sheds[..1]);
        assert_eq!(a.finished.len(), 1);
    }

    #[derive(Debug, Default)]
    struct FakeExporter {
        down: AtomicBool,
        /// Sizes of the batches it was asked to export.
        calls: Mutex<Vec<usize>>,
    }

    impl SpanExporter for FakeExporter {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.calls.lock().unwrap().push(batch.len());
            match self.down.load(Ordering::SeqCst) {
                true => Err(OTelSdkError::InternalFailure("connection refused".into())),
                false => Ok(()),
            }
        }
    }

    fn sheds(n: usize) -> Vec<Finished> {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        for _ in 0..n {
            a.decision(&decision("acme", DecisionKind::Shed, None));
        }
        a.hand_over();
        rx.try_iter().flatten().collect()
    }

    #[test]
    fn failed_exports_pause_export_with_a_doubling_backoff_and_a_probe_resumes_it() {
        let exporter = Blocking(FakeExporter::default());
        let pause = Pause::default();
        let mut st = ExportState::new(&exporter, &pause, "http://collector");
        let s = NS_PER_SEC;
        st.batch(sheds(3), 0);
        assert_eq!(*exporter.0.calls.lock().unwrap(), [3]);
        assert_eq!(st.probe_in(0), None, "export works: no probing");

        exporter.0.down.store(true, Ordering::SeqCst);
        st.batch(sheds(2), 10 * s);
        assert!(pause.active(10 * s) && !pause.active(11 * s));
        assert_eq!(st.probe_in(10 * s), Some(Duration::from_secs(1)));
        st.batch(sheds(4), 10 * s + 1);
        assert_eq!(
            exporter.0.calls.lock().unwrap().len(),
            2,
            "dropped while paused"
        );
        st.probe(10 * s + 2);
        assert_eq!(
            exporter.0.calls.lock().unwrap().len(),
            2,
            "no probe before the pause ends"
        );
        // Each failed probe doubles the pause: 2 s, 4 s, ... up to 30 s.
        let mut now = 11 * s;
        for wait in [2, 4, 8, 16, 30, 30] {
            st.probe(now);
            assert_eq!(
                exporter.0.calls.lock().unwrap().last(),
                Some(&0),
                "an empty probe"
            );
            assert_eq!(st.probe_in(now), Some(Duration::from_secs(wait)));
            now += wait * s;
        }
        exporter.0.down.store(false, Ordering::SeqCst);
        st.probe(now);
        assert_eq!(st.probe_in(now), None);
        assert!(!pause.active(now));
        st.batch(sheds(5), now);
        assert_eq!(exporter.0.calls.lock().unwrap().last(), Some(&5));
        // The next outage starts again at 1 s.
        exporter.0.down.store(true, Ordering::SeqCst);
        st.batch(sheds(1), now);
        assert_eq!(st.probe_in(now), Some(Duration::from_secs(1)));
    }
}
