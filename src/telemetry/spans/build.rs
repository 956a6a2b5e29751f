//! What admitd's spans are made of, and how each becomes the SDK's `SpanData`.
//!
//! The span actor keeps a compact record per span (ids, times, shared names, numbers) and the export
//! thread builds it into `SpanData` only when it exports it: building is most of a span's cost (about
//! thirty small allocations), and a span dropped while export is paused is never built. Names and
//! attributes are decided here, in one place:
//!
//! - `admitd admit {tool}`: one per admission decision, from the request's arrival to its answer, so
//!   it covers any hold. It carries the `GenAI` and MCP attributes (`gen_ai.operation.name =
//!   "execute_tool"`, `gen_ai.tool.name`, `mcp.method.name = "tools/call"`, `gen_ai.tool.call.id`)
//!   and admitd's (tenant, hashed subject, upstream, cost, decision, scope, wait, retry hint).
//! - `admitd release {tool}`: one per released (or expired) lease, at the moment the release was
//!   answered, in the admission's trace with a link to its admission span, carrying the same `GenAI`
//!   and MCP attributes plus what the server reported (outcome, upstream status, Retry-After, tool
//!   duration) and how long the lease was held.
//! - `admitd upstream_feedback`: an upstream answer reported outside a lease.
//!
//! Both call spans are children of the caller's span when the request carried a `traceparent`: under
//! the MCP server's `execute_tool` span they read as its admission and release steps. A call that
//! started a trace has its admission span as the root and its release span as that span's child.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{
    Event as SpanEvent, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId,
    TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use super::super::{hex16, DecisionKind, FeedbackEvent, ReleaseEvent};
use crate::engine::Scope;

pub(super) fn unix_ns_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn system_time(unix_ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(unix_ns)
}

/// An admission span as the actor keeps it: what `SpanData` is built from, without building it.
#[derive(Debug)]
pub(super) struct AdmissionSpan {
    pub trace_id: u128,
    pub span_id: u64,
    /// The caller's span; 0 when the call started a new trace.
    pub parent_span_id: u64,
    pub start_ns: u64,
    /// When the decision was answered (after any hold).
    pub end_ns: u64,
    pub call: CallNames,
    pub cost: f64,
    pub kind: DecisionKind,
    pub scope: Option<Scope>,
    pub waited_ns: u64,
    pub retry_after_ms: u64,
    pub decision_ns: u64,
    /// Admitted by `on_error = "fail_open"` without any check.
    pub unchecked: bool,
}

/// Who called which tool: what both spans of a call carry.
#[derive(Debug, Clone)]
pub(super) struct CallNames {
    pub tenant: Arc<str>,
    pub tool: Arc<str>,
    pub upstream: Option<Arc<str>>,
    pub subject_hash: u64,
    pub call_id: Option<String>,
}

/// A live lease's place in its trace, kept from its admission to its release (or expiry).
#[derive(Debug)]
pub(super) struct LeaseTrace {
    pub trace_id: u128,
    pub admission_span_id: u64,
    /// The caller's span; 0 when the call started a new trace.
    pub caller_span_id: u64,
    /// When the lease was granted (the admission's answer).
    pub granted_ns: u64,
    pub call: CallNames,
}

/// How a lease ended.
#[derive(Debug)]
pub(super) enum LeaseEnd {
    Released(Arc<ReleaseEvent>),
    /// The server never released it; the daemon expired it after the lease TTL.
    Expired,
}

/// A release span as the actor keeps it.
#[derive(Debug)]
pub(super) struct ReleaseSpan {
    pub lease: LeaseTrace,
    pub span_id: u64,
    /// When the release was answered (or the expiry noticed).
    pub at_ns: u64,
    pub end: LeaseEnd,
}

/// A finished span on its way to the export thread.
#[derive(Debug)]
pub struct Finished(pub(super) FinishedKind);

#[derive(Debug)]
pub(super) enum FinishedKind {
    Admission(Box<AdmissionSpan>),
    Release(Box<ReleaseSpan>),
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

fn span_id(id: u64) -> SpanId {
    match id {
        0 => SpanId::INVALID,
        id => SpanId::from_bytes(id.to_be_bytes()),
    }
}

impl CallNames {
    /// The attributes both spans of a call carry: the `GenAI` and MCP conventions, then admitd's.
    fn attributes(self, capacity: usize) -> Vec<KeyValue> {
        let mut attrs = Vec::with_capacity(capacity);
        attrs.push(attr("gen_ai.operation.name", "execute_tool"));
        attrs.push(attr("gen_ai.tool.name", shared(self.tool)));
        attrs.push(attr("mcp.method.name", "tools/call"));
        if let Some(id) = self.call_id {
            attrs.push(attr("gen_ai.tool.call.id", id));
        }
        attrs.push(attr("admitd.tenant", shared(self.tenant)));
        attrs.push(attr("admitd.subject_hash", hex16(self.subject_hash)));
        attrs.push(attr(
            "admitd.upstream",
            self.upstream.map_or(Value::from("none"), shared),
        ));
        attrs
    }
}

/// What the pieces of a span are, as [`span_data`] assembles them.
struct Parts {
    context: SpanContext,
    /// The parent span, and whether it is the caller's (another process's).
    parent: (SpanId, bool),
    name: Cow<'static, str>,
    times: (SystemTime, SystemTime),
    attributes: Vec<KeyValue>,
    events: Vec<SpanEvent>,
    links: Vec<Link>,
    status: Status,
}

fn span_data(p: Parts, scope: &InstrumentationScope) -> SpanData {
    let mut events = SpanEvents::default();
    events.events = p.events;
    let mut links = SpanLinks::default();
    links.links = p.links;
    SpanData {
        span_context: p.context,
        parent_span_id: p.parent.0,
        parent_span_is_remote: p.parent.1,
        span_kind: SpanKind::Internal,
        name: p.name,
        start_time: p.times.0,
        end_time: p.times.1,
        attributes: p.attributes,
        dropped_attributes_count: 0,
        events,
        links,
        status: p.status,
        instrumentation_scope: scope.clone(),
    }
}

impl Finished {
    /// The span as OpenTelemetry's SDK describes it, for the OTLP exporter.
    pub(super) fn into_span_data(self, scope: &InstrumentationScope) -> SpanData {
        let parts = match self.0 {
            FinishedKind::Admission(s) => s.into_parts(),
            FinishedKind::Release(s) => s.into_parts(),
            FinishedKind::Feedback {
                trace_id,
                span_id,
                at_ns,
                event,
            } => feedback_parts(trace_id, span_id, at_ns, &event),
        };
        span_data(parts, scope)
    }
}

fn feedback_parts(trace_id: u128, span_id: u64, at_ns: u64, f: &FeedbackEvent) -> Parts {
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
    Parts {
        context: context(trace_id, span_id),
        parent: (SpanId::INVALID, false),
        name: Cow::Borrowed("admitd upstream_feedback"),
        times: (at, at),
        attributes: Vec::new(),
        events: vec![SpanEvent::new("admitd.feedback", at, attrs, 0)],
        links: Vec::new(),
        status: Status::Unset,
    }
}

impl AdmissionSpan {
    fn into_parts(self) -> Parts {
        let s = self;
        let scope_name = s.scope.map_or("none", |sc| sc.as_str());
        let name = Cow::Owned(["admitd admit ", &s.call.tool].concat());
        let mut attrs = s.call.attributes(14);
        attrs.push(attr("admitd.cost", s.cost));
        attrs.push(attr("admitd.decision", s.kind.as_str()));
        attrs.push(attr("admitd.scope", scope_name));
        attrs.push(attr("admitd.waited_ms", (s.waited_ns / 1_000_000) as i64));
        attrs.push(attr("admitd.retry_after_ms", s.retry_after_ms as i64));
        attrs.push(attr("admitd.decision_us", (s.decision_ns / 1_000) as i64));
        if s.unchecked {
            attrs.push(attr("admitd.unchecked", true));
        }
        let mut status = Status::Unset;
        if s.kind == DecisionKind::Shed {
            attrs.push(attr("error.type", "rate_limited"));
            status = Status::error(format!("shed by {scope_name}"));
        }
        Parts {
            context: context(s.trace_id, s.span_id),
            parent: (span_id(s.parent_span_id), s.parent_span_id != 0),
            name,
            times: (system_time(s.start_ns), system_time(s.end_ns)),
            attributes: attrs,
            events: Vec::new(),
            links: Vec::new(),
            status,
        }
    }
}

impl ReleaseSpan {
    fn into_parts(self) -> Parts {
        let l = self.lease;
        let name = Cow::Owned(["admitd release ", &l.call.tool].concat());
        let mut attrs = l.call.attributes(14);
        let held_ms = self.at_ns.saturating_sub(l.granted_ns) / 1_000_000;
        attrs.push(attr("admitd.lease_held_ms", held_ms as i64));
        let status = match &self.end {
            LeaseEnd::Expired => {
                attrs.push(attr("admitd.outcome", "lease_expired"));
                Status::error("lease expired")
            }
            LeaseEnd::Released(r) => {
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
                if r.outcome == "upstream_rate_limited" || r.upstream_status == Some(429) {
                    attrs.push(attr("error.type", "429"));
                    Status::error("upstream rate limited")
                } else if r.outcome == "error" {
                    Status::error("tool error")
                } else {
                    Status::Unset
                }
            }
        };
        // Beside the admission under the caller's span; under the admission when there is none.
        let parent = match l.caller_span_id {
            0 => (span_id(l.admission_span_id), false),
            caller => (span_id(caller), true),
        };
        let at = system_time(self.at_ns);
        Parts {
            context: context(l.trace_id, self.span_id),
            parent,
            name,
            times: (at, at),
            attributes: attrs,
            events: Vec::new(),
            links: vec![Link::with_context(context(l.trace_id, l.admission_span_id))],
            status,
        }
    }
}

#[cfg(test)]
impl Finished {
    /// A feedback span, for tests of the export side.
    pub(super) fn feedback_example() -> Finished {
        Finished(FinishedKind::Feedback {
            trace_id: 1,
            span_id: 1,
            at_ns: 1_700_000_000_000_000_000,
            event: Arc::new(FeedbackEvent {
                tenant: "acme".into(),
                upstream: "crm".into(),
                status: 429,
                retry_after: Some("2".into()),
                penalty_ms: Some(2000),
            }),
        })
    }
}
