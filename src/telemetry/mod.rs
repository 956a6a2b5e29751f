//! Telemetry: decision events out of the hot path, into metrics, spans, the refusal log and alerts.
//!
//! The HTTP layer and the tenant actors describe what happened as events and hand them to
//! [`Telemetry`], which offers each event to every telemetry sink's bounded mailbox with `try_send`. A
//! full mailbox drops the event and counts the drop (`admitd_telemetry_events_dropped_total`); admission
//! never waits for telemetry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use actix::prelude::*;

use crate::engine::Scope;

/// What became of an admission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    pub traceparent: Option<String>,
    pub lease_id: Option<String>,
    /// Wall-clock start of the request (Unix ns), for spans.
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
    pub lease_id: String,
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

/// State changes and samples from the actors.
#[derive(Debug, Clone)]
pub enum TenantEvent {
    LeaseExpired {
        tenant: Arc<str>,
        subject: Arc<str>,
        tool: Arc<str>,
        upstream: Option<Arc<str>>,
    },
    Gauges {
        tenant: Arc<str>,
        inflight: u32,
    },
    Global {
        tenants: usize,
    },
}

/// Everything a telemetry sink may receive.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub enum Event {
    Decision(Arc<DecisionEvent>),
    Release(Arc<ReleaseEvent>),
    Feedback(Arc<FeedbackEvent>),
    Tenant(Arc<TenantEvent>),
}

/// The handle the daemon reports through. Cheap to clone.
#[derive(Clone, Default)]
pub struct Telemetry {
    sinks: Arc<Vec<Recipient<Event>>>,
    dropped: Arc<AtomicU64>,
}

impl Telemetry {
    /// A handle that reports nowhere (tests, `check`).
    pub fn disabled() -> Self {
        Telemetry::default()
    }

    pub fn with_sinks(sinks: Vec<Recipient<Event>>) -> Self {
        Telemetry {
            sinks: Arc::new(sinks),
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }

    fn offer(&self, ev: Event) {
        for sink in self.sinks.iter() {
            if sink.try_send(ev.clone()).is_err() {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn decision(&self, ev: DecisionEvent) {
        if !self.sinks.is_empty() {
            self.offer(Event::Decision(Arc::new(ev)));
        }
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

    /// Events dropped because a sink's mailbox was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
