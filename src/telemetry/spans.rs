//! OpenTelemetry spans for admissions, exported over OTLP/HTTP.
//!
//! One span per admission decision, following the GenAI and MCP semantic conventions
//! (`gen_ai.operation.name = "execute_tool"`, `gen_ai.tool.name`, `mcp.method.name = "tools/call"`),
//! parented on the caller's W3C `traceparent` when it sent one, plus `admitd.*` attributes (tenant,
//! hashed subject, upstream, cost, decision, scope, wait, retry hint). A shed call's span ends at the
//! decision. An admitted call's span stays open for the life of its lease and ends at release with an
//! `admitd.release` event (outcome, upstream status, Retry-After), so the span covers the tool execution
//! the way `execute_tool` spans do; a lease never released ends its span with `admitd.lease_expired`.
//!
//! Export is batched by the SDK's batch processor on its own thread with a bounded queue: the actor only
//! hands finished spans over, so a slow or absent collector costs dropped spans, never admission time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix::prelude::*;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::{KeyValue, StringValue, Value};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, Span, Tracer,
};
use opentelemetry_sdk::Resource;

use super::{
    hash_identity, Batch, DecisionEvent, DecisionKind, Event, FeedbackEvent, ReleaseEvent,
};
use crate::clock::{Clock, Nanos, NS_PER_SEC};
use crate::config::OtlpConfig;

/// Open spans kept at most (one per live lease); past this, admitted spans end at the decision.
const MAX_OPEN: usize = 100_000;

/// A span attribute that shares the event's string instead of copying it.
fn shared(s: &Arc<str>) -> Value {
    Value::String(StringValue::from(s.clone()))
}

/// Builds the tracer provider. Done on a plain thread: the blocking HTTP client must not be created or
/// dropped on an async runtime's thread.
pub fn provider(cfg: &OtlpConfig) -> Result<SdkTracerProvider, String> {
    let cfg = cfg.clone();
    std::thread::spawn(move || {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(cfg.endpoint.clone())
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("cannot set up OTLP export to {}: {e}", cfg.endpoint))?;
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(8192)
            .with_scheduled_delay(Duration::from_millis(500))
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        Ok(SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(
                Resource::builder()
                    .with_service_name(cfg.service_name.clone())
                    .build(),
            )
            .build())
    })
    .join()
    .map_err(|_| "the OTLP set-up thread panicked".to_string())?
}

/// Flushes and stops the provider, off any async runtime thread.
pub fn shutdown(provider: SdkTracerProvider) {
    let _ = std::thread::spawn(move || {
        let _ = provider.shutdown_with_timeout(Duration::from_secs(3));
    })
    .join();
}

fn system_time(unix_ns: u128) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(unix_ns.min(u64::MAX as u128) as u64)
}

pub struct SpanActor {
    tracer: Tracer,
    clock: Arc<dyn Clock>,
    lease_ttl: Duration,
    open: std::collections::HashMap<String, (Span, Nanos), foldhash::fast::RandomState>,
    propagator: TraceContextPropagator,
}

impl SpanActor {
    pub fn new(provider: &SdkTracerProvider, clock: Arc<dyn Clock>, lease_ttl: Duration) -> Self {
        SpanActor {
            tracer: provider.tracer("admitd"),
            clock,
            lease_ttl,
            open: Default::default(),
            propagator: TraceContextPropagator::new(),
        }
    }

    fn decision(&mut self, d: &DecisionEvent) {
        let parent = match &d.traceparent {
            Some(tp) => {
                let mut carrier = HashMap::new();
                carrier.insert("traceparent".to_string(), tp.clone());
                self.propagator.extract(&carrier)
            }
            None => opentelemetry::Context::new(),
        };
        let start = system_time(d.start_unix_ns);
        let decided = start + Duration::from_nanos(d.decision_ns);
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", "execute_tool"),
            KeyValue::new("gen_ai.tool.name", shared(&d.tool)),
            KeyValue::new("mcp.method.name", "tools/call"),
            KeyValue::new("admitd.tenant", shared(&d.tenant)),
            KeyValue::new("admitd.subject_hash", hash_identity(&d.subject)),
            KeyValue::new(
                "admitd.upstream",
                d.upstream.as_ref().map_or(Value::from("none"), shared),
            ),
            KeyValue::new("admitd.cost", d.cost),
            KeyValue::new("admitd.decision", d.kind.as_str()),
            KeyValue::new("admitd.scope", d.scope.map_or("none", |s| s.as_str())),
            KeyValue::new("admitd.waited_ms", (d.waited_ns / 1_000_000) as i64),
            KeyValue::new("admitd.retry_after_ms", d.retry_after_ms as i64),
            KeyValue::new("admitd.decision_us", (d.decision_ns / 1_000) as i64),
        ];
        if let Some(id) = &d.call_id {
            attrs.push(KeyValue::new("gen_ai.tool.call.id", id.clone()));
        }
        if d.kind == DecisionKind::Shed {
            attrs.push(KeyValue::new("error.type", "rate_limited"));
        }
        let mut span = self
            .tracer
            .span_builder(["execute_tool ", &d.tool].concat())
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attrs)
            .start_with_context(&self.tracer, &parent);
        match (&d.lease_id, d.kind) {
            (Some(lease), DecisionKind::Admitted | DecisionKind::ShadowShed)
                if self.open.len() < MAX_OPEN =>
            {
                span.add_event_with_timestamp(
                    "admitd.admitted",
                    decided + Duration::from_nanos(d.waited_ns),
                    vec![KeyValue::new(
                        "admitd.waited_ms",
                        (d.waited_ns / 1_000_000) as i64,
                    )],
                );
                self.open.insert(lease.clone(), (span, self.clock.mono()));
            }
            _ => {
                if d.kind == DecisionKind::Shed {
                    span.set_status(Status::error(format!(
                        "shed by {}",
                        d.scope.map_or("none", |s| s.as_str())
                    )));
                }
                span.end_with_timestamp(decided);
            }
        }
    }

    fn release(&mut self, r: &ReleaseEvent) {
        let Some((mut span, _)) = self.open.remove(&r.lease_id) else {
            return;
        };
        let mut attrs = vec![KeyValue::new("admitd.outcome", r.outcome)];
        if let Some(s) = r.upstream_status {
            attrs.push(KeyValue::new("http.response.status_code", i64::from(s)));
        }
        if let Some(ra) = &r.retry_after {
            attrs.push(KeyValue::new("admitd.retry_after", ra.clone()));
        }
        if let Some(p) = r.penalty_ms {
            attrs.push(KeyValue::new("admitd.penalty_ms", p as i64));
        }
        if let Some(d) = r.duration_ms {
            attrs.push(KeyValue::new("admitd.tool_duration_ms", d as i64));
        }
        span.add_event("admitd.release", attrs);
        if r.outcome == "upstream_rate_limited" || r.upstream_status == Some(429) {
            span.set_attribute(KeyValue::new("error.type", "429"));
            span.set_status(Status::error("upstream rate limited"));
        } else if r.outcome == "error" {
            span.set_status(Status::error("tool error"));
        }
        span.end();
    }

    fn feedback(&mut self, f: &FeedbackEvent) {
        let mut attrs = vec![
            KeyValue::new("admitd.tenant", f.tenant.to_string()),
            KeyValue::new("admitd.upstream", f.upstream.to_string()),
            KeyValue::new("http.response.status_code", i64::from(f.status)),
        ];
        if let Some(ra) = &f.retry_after {
            attrs.push(KeyValue::new("admitd.retry_after", ra.clone()));
        }
        if let Some(p) = f.penalty_ms {
            attrs.push(KeyValue::new("admitd.penalty_ms", p as i64));
        }
        let mut span = self
            .tracer
            .span_builder("admitd upstream_feedback")
            .with_kind(SpanKind::Internal)
            .start(&self.tracer);
        span.add_event("admitd.feedback", attrs);
        span.end();
    }

    /// Ends the spans of leases that outlived the lease TTL (their servers never released them).
    fn sweep(&mut self) {
        let now = self.clock.mono();
        let limit = self.lease_ttl.as_nanos() as u64 + 5 * NS_PER_SEC;
        let expired: Vec<String> = self
            .open
            .iter()
            .filter(|(_, (_, opened))| now.saturating_sub(*opened) > limit)
            .map(|(k, _)| k.clone())
            .collect();
        for k in expired {
            if let Some((mut span, _)) = self.open.remove(&k) {
                span.add_event("admitd.lease_expired", vec![]);
                span.end();
            }
        }
    }
}

impl Actor for SpanActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(super::MAILBOX);
        ctx.run_interval(Duration::from_secs(5), |act, _| act.sweep());
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        for (_, (mut span, _)) in self.open.drain() {
            span.end();
        }
    }
}

impl Handler<Batch> for SpanActor {
    type Result = ();

    fn handle(&mut self, batch: Batch, _: &mut Context<Self>) {
        for ev in batch.0.iter() {
            match ev {
                Event::Decision(d) => self.decision(d),
                Event::Release(r) => self.release(r),
                Event::Feedback(f) => self.feedback(f),
                Event::Tenant(_) => {}
            }
        }
    }
}
