//! OpenTelemetry spans for admission decisions and lease releases, exported over OTLP (HTTP with
//! protobuf or JSON bodies, or gRPC).
//!
//! Every sampled decision gets an admission span that ends when the decision is answered, so it
//! reaches the collector within an export interval ([`FLUSH_EVERY`]) whether or not the call is
//! ever released: a server that crashed mid-call still shows its admission, and a slow agent turn
//! shows how long admission held it. An admitted call's release is a span of its own in the same
//! trace, linked to the admission span; a lease that expires instead gets one saying so. What the
//! spans carry and how they are named is in [`build`].
//!
//! The module is split by what each part owns:
//! - [`sampling`]: the caller's `traceparent`, which calls get spans, new ids;
//! - [`build`]: the compact span records and how they become the SDK's `SpanData`;
//! - [`export`]: the export thread, its bounded queue and its back-off while a collector is down;
//! - here, [`SpanActor`]: turning decision, release and feedback events into span records, and
//!   remembering each live lease's place in its trace until it is released.
//!
//! # Budget
//! Sampled calls spend a place in the span budget (`max_spans_per_second`, default 1000, a burst of
//! one second's worth); calls past it get no span and are counted as dropped (`rate_limited`), so a
//! flood of calls costs a bounded amount of CPU and collector traffic. A release span comes with its
//! admission's place: a call that got an admission span gets its release span too.
//!
//! # Cost
//! Spans are the most expensive telemetry admitd has (an OTLP span with its attributes is a few
//! hundred bytes built from about thirty small allocations), so the actor does not go through the
//! SDK's tracer: it keeps a compact record per span and hands finished records to the export thread
//! in batches of [`EXPORT_BATCH`], which builds them only if it exports them.

mod build;
mod export;
mod sampling;

use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::{DecisionEvent, DecisionKind, Event, FeedbackEvent, ReleaseEvent, Throttle};
use crate::clock::{Clock, Nanos, NS_PER_SEC};
use crate::config::OtlpConfig;
use build::{
    unix_ns_now, AdmissionSpan, CallNames, FinishedKind, LeaseEnd, LeaseTrace, ReleaseSpan,
};
use export::{count_dropped, Pause};
use sampling::{parse_traceparent, Ids, Sampler};

pub use build::Finished;
pub use export::{start, Exporter, EXPORT_BATCH};

/// Live leases whose place in their trace is kept, at most; past this, a release gets no span.
const MAX_OPEN: usize = 100_000;
/// Finished spans wait at most this long before they are handed to the export thread.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Spans are not recorded for this long after the export queue was found full.
const QUEUE_FULL_PAUSE: Nanos = NS_PER_SEC;

/// Identifies a live lease: the lease number and its tenant (numbers repeat across tenants).
type OpenKey = (u64, Arc<str>);

/// An [`OpenKey`] to look up with, borrowing the tenant. Hashes as the tuple does.
#[derive(Hash)]
struct OpenRef<'a>(u64, &'a str);

impl hashbrown::Equivalent<OpenKey> for OpenRef<'_> {
    fn equivalent(&self, key: &OpenKey) -> bool {
        self.0 == key.0 && self.1 == &*key.1
    }
}

/// Turns events into span records and hands them to the export thread. Runs on the telemetry
/// arbiter; owns the span budget, the id generator and the live leases' places in their traces.
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
    /// Each live lease's place in its trace, and when it was granted (monotonic, for expiry).
    open: hashbrown::HashMap<OpenKey, (Box<LeaseTrace>, Nanos), foldhash::fast::RandomState>,
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
            None => self.ids.trace_id(),
        };
        if !self.sampler.sampled(parent, trace_id) {
            return;
        }
        if !self.within_budget() {
            return;
        }
        let start_ns = fields.map_or(0, |f| f.start_unix_ns.min(u128::from(u64::MAX)) as u64);
        // Answered after deciding and after any hold.
        let end_ns = start_ns
            .saturating_add(d.decision_ns)
            .saturating_add(d.waited_ns);
        let span = Box::new(AdmissionSpan {
            trace_id,
            span_id: self.ids.next(),
            parent_span_id: parent.map_or(0, |p| p.span_id),
            start_ns,
            end_ns,
            call: CallNames {
                tenant: d.tenant.clone(),
                tool: d.tool.clone(),
                upstream: d.upstream.clone(),
                subject_hash: super::identity_hash(&d.subject),
                call_id: d.call_id.clone(),
            },
            cost: d.cost,
            kind: d.kind,
            scope: d.scope,
            waited_ns: d.waited_ns,
            retry_after_ms: d.retry_after_ms,
            decision_ns: d.decision_ns,
            unchecked: d.unchecked,
        });
        if d.kind != DecisionKind::Shed && self.open.len() < MAX_OPEN {
            if let Some(lease) = fields.and_then(|f| f.lease) {
                let trace = Box::new(LeaseTrace {
                    trace_id,
                    admission_span_id: span.span_id,
                    caller_span_id: span.parent_span_id,
                    granted_ns: end_ns,
                    call: span.call.clone(),
                });
                self.open
                    .insert((lease, d.tenant.clone()), (trace, self.clock.mono()));
            }
        }
        self.finish(Finished(FinishedKind::Admission(span)));
    }

    /// The release span of a lease whose admission got a span; `record` is false while export is
    /// paused (the lease is forgotten, its release not recorded).
    fn release(&mut self, r: &Arc<ReleaseEvent>, record: bool) -> bool {
        let Some((lease, _)) = self.open.remove(&OpenRef(r.lease, &r.tenant)) else {
            return true;
        };
        if !record {
            return false;
        }
        let at_ns = match r.released_unix_ns {
            0 => unix_ns_now(),
            at => at,
        };
        let span_id = self.ids.next();
        self.finish(Finished(FinishedKind::Release(Box::new(ReleaseSpan {
            at_ns: at_ns.max(lease.granted_ns),
            span_id,
            lease: *lease,
            end: LeaseEnd::Released(r.clone()),
        }))));
        true
    }

    fn feedback(&mut self, f: &Arc<FeedbackEvent>) {
        let trace_id = self.ids.trace_id();
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

    /// Gives the leases that outlived the lease TTL (their servers never released them) a release
    /// span that says so.
    fn sweep(&mut self) {
        let now = self.clock.mono();
        let limit = self.lease_ttl.as_nanos() as u64 + 5 * NS_PER_SEC;
        let expired: Vec<OpenKey> = self
            .open
            .iter()
            .filter(|(_, (_, opened))| now.saturating_sub(*opened) > limit)
            .map(|(k, _)| k.clone())
            .collect();
        let at_ns = unix_ns_now();
        for k in expired {
            if let Some((lease, _)) = self.open.remove(&k) {
                let span_id = self.ids.next();
                self.finish(Finished(FinishedKind::Release(Box::new(ReleaseSpan {
                    at_ns: at_ns.max(lease.granted_ns),
                    span_id,
                    lease: *lease,
                    end: LeaseEnd::Expired,
                }))));
            }
        }
    }

    fn handle_events(&mut self, events: &[Event]) {
        // While export fails, new spans would only be dropped: record none (the export thread
        // probes whether the collector is back by itself).
        self.now = self.clock.mono();
        let record = !self.paused.active(self.now);
        let mut skipped = 0;
        for ev in events {
            match ev {
                Event::Decision(d) if record => self.decision(d),
                Event::Feedback(f) if record => self.feedback(f),
                Event::Release(r) => skipped += usize::from(!self.release(r, record)),
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
        self.hand_over();
    }
}

impl Drop for SpanActor {
    /// Hands over what is finished for export when the daemon stops (an arbiter that stops may
    /// drop its actors without stopping them first). Live leases are forgotten: their admission
    /// spans are exported already.
    fn drop(&mut self) {
        self.hand_over();
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
    use std::sync::mpsc::{self, Receiver};
    use std::time::UNIX_EPOCH;

    use opentelemetry::trace::{SpanId, Status, TraceId};
    use opentelemetry::{InstrumentationScope, KeyValue, Value};
    use opentelemetry_sdk::trace::SpanData;

    use super::export::EXPORT_QUEUE;
    use super::*;
    use crate::clock::FakeClock;
    use crate::config::OtlpProtocol;
    use crate::engine::Scope;

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    /// The requests' wall-clock start in these tests.
    const START: u64 = 1_700_000_000_000_000_000;

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
            lease: 0,
            unchecked: false,
            span: Some(Box::new(crate::telemetry::SpanFields {
                traceparent: None,
                lease,
                start_unix_ns: u128::from(START),
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

    /// A release answered two seconds after the calls of these tests started.
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
            released_unix_ns: START + 2 * NS_PER_SEC,
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

    fn at(ns: u64) -> std::time::SystemTime {
        UNIX_EPOCH + Duration::from_nanos(ns)
    }

    #[test]
    fn a_shed_call_is_one_admission_span_with_the_conventions_and_an_error_status() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        let mut d = decision("acme", DecisionKind::Shed, None);
        d.span.as_mut().unwrap().traceparent = Some(TP.into());
        a.handle_events(&[Event::Decision(d)]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(s.name, "admitd admit search");
        assert_eq!(
            s.span_context.trace_id(),
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap()
        );
        assert_eq!(
            s.parent_span_id,
            SpanId::from_hex("b7ad6b7169203331").unwrap()
        );
        assert!(s.parent_span_is_remote);
        assert_eq!(s.start_time, at(START));
        assert_eq!(
            s.end_time,
            at(START + 40_000 + 3_000_000),
            "ends when answered: deciding and the hold"
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
        assert!(s.events.is_empty() && s.links.is_empty());
    }

    #[test]
    fn an_unchecked_admission_says_so_in_its_span_and_a_checked_one_does_not() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        let mut unchecked = decision("acme", DecisionKind::Admitted, Some(5));
        unchecked.unchecked = true;
        a.handle_events(&[
            Event::Decision(unchecked),
            Event::Decision(decision("globex", DecisionKind::Admitted, Some(6))),
        ]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 2);
        for s in &spans {
            let tenant = text(&s.attributes, "admitd.tenant").unwrap();
            let flag = attr_of(&s.attributes, "admitd.unchecked");
            if tenant == "acme" {
                assert_eq!(flag, Some(&Value::Bool(true)));
            } else {
                assert_eq!(flag, None, "a checked admission carries no flag");
            }
        }
    }

    #[test]
    fn an_admitted_call_is_exported_at_once_and_its_own_tenants_release_gets_a_linked_span() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        let mut parented = decision("acme", DecisionKind::Admitted, Some(5));
        parented.span.as_mut().unwrap().traceparent = Some(TP.into());
        a.handle_events(&[
            Event::Decision(parented),
            Event::Decision(decision("globex", DecisionKind::Admitted, Some(5))),
        ]);
        let admissions = exported(&mut a, &rx);
        assert_eq!(
            admissions.len(),
            2,
            "admission spans do not wait for release"
        );
        for s in &admissions {
            assert_eq!(s.name, "admitd admit search");
            assert_eq!(s.end_time, at(START + 40_000 + 3_000_000));
            assert_eq!(
                text(&s.attributes, "admitd.decision").as_deref(),
                Some("admitted")
            );
            assert_eq!(s.status, Status::Unset);
        }
        let of = |tenant: &str| {
            admissions
                .iter()
                .find(|s| text(&s.attributes, "admitd.tenant").as_deref() == Some(tenant))
                .unwrap()
                .span_context
                .clone()
        };
        let (acme, globex) = (of("acme"), of("globex"));

        // The same lease number of another tenant is that tenant's lease only.
        a.handle_events(&[Event::Release(release("globex", 5, Some(429)))]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        let r = &spans[0];
        assert_eq!(r.name, "admitd release search");
        assert_eq!(
            r.span_context.trace_id(),
            globex.trace_id(),
            "the admission's trace"
        );
        assert_ne!(r.span_context.span_id(), globex.span_id());
        assert_eq!(
            r.parent_span_id,
            globex.span_id(),
            "a call that started its trace: under its admission span"
        );
        assert!(!r.parent_span_is_remote);
        assert_eq!(r.links.len(), 1);
        assert_eq!(r.links[0].span_context, globex);
        for (k, v) in [
            ("gen_ai.operation.name", "execute_tool"),
            ("gen_ai.tool.name", "search"),
            ("mcp.method.name", "tools/call"),
            ("gen_ai.tool.call.id", "c-1"),
            ("admitd.tenant", "globex"),
            ("admitd.upstream", "warehouse"),
            ("admitd.outcome", "upstream_rate_limited"),
            ("admitd.retry_after", "30"),
            ("error.type", "429"),
        ] {
            assert_eq!(text(&r.attributes, k).as_deref(), Some(v), "{k}");
        }
        assert_eq!(
            attr_of(&r.attributes, "http.response.status_code"),
            Some(&Value::I64(429))
        );
        assert_eq!(
            attr_of(&r.attributes, "admitd.tool_duration_ms"),
            Some(&Value::I64(120))
        );
        // Granted 3.04 ms after the start (deciding and the hold), released at 2 s.
        assert_eq!(
            attr_of(&r.attributes, "admitd.lease_held_ms"),
            Some(&Value::I64(1996))
        );
        assert_eq!(r.start_time, at(START + 2 * NS_PER_SEC));
        assert_eq!(r.end_time, r.start_time);
        assert_eq!(r.status, Status::error("upstream rate limited"));

        // A second release of the same lease finds nothing.
        a.handle_events(&[Event::Release(release("globex", 5, None))]);
        assert!(exported(&mut a, &rx).is_empty());
        // A call under a caller's span: its release sits beside the admission, under the caller.
        a.handle_events(&[Event::Release(release("acme", 5, None))]);
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        let r = &spans[0];
        assert_eq!(r.span_context.trace_id(), acme.trace_id());
        assert_eq!(
            r.parent_span_id,
            SpanId::from_hex("b7ad6b7169203331").unwrap()
        );
        assert!(r.parent_span_is_remote);
        assert_eq!(r.links[0].span_context, acme);
        assert_eq!(r.status, Status::Unset);
    }

    #[test]
    fn a_lease_never_released_gets_a_lease_expired_release_span_and_the_actor_forgets_the_rest() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        admit(&mut a, "acme", 1);
        assert_eq!(exported(&mut a, &rx).len(), 1, "the admission");
        clock.advance(Duration::from_secs(14));
        a.sweep();
        assert!(exported(&mut a, &rx).is_empty(), "within lease TTL + 5 s");
        admit(&mut a, "acme", 2);
        assert_eq!(exported(&mut a, &rx).len(), 1);
        clock.advance(Duration::from_secs(2));
        a.sweep();
        let spans = exported(&mut a, &rx);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].name, "admitd release search");
        assert_eq!(
            text(&spans[0].attributes, "admitd.outcome").as_deref(),
            Some("lease_expired")
        );
        assert_eq!(spans[0].status, Status::error("lease expired"));
        assert_eq!(spans[0].links.len(), 1);
        // Lease 2 is still live when the actor goes: nothing more is exported for it.
        drop(a);
        assert_eq!(rx.try_iter().flatten().count(), 0);
    }

    #[test]
    fn unsampled_calls_record_nothing_and_sampled_parents_always_record() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 0.0);
        let mut unsampled = decision("acme", DecisionKind::Admitted, Some(1));
        unsampled.span.as_mut().unwrap().traceparent = Some(TP.replace("-01", "-00"));
        let mut sampled = decision("acme", DecisionKind::Shed, None);
        sampled.span.as_mut().unwrap().traceparent = Some(TP.into());
        a.handle_events(&[
            Event::Decision(decision("acme", DecisionKind::Shed, None)),
            Event::Decision(unsampled),
            Event::Decision(sampled),
            Event::Release(release("acme", 1, None)),
        ]);
        let spans = exported(&mut a, &rx);
        assert_eq!(
            spans.len(),
            1,
            "no release span for a call without an admission span"
        );
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
        clock.advance(Duration::from_secs(1));
        admit(&mut a, "acme", 7);
        a.handle_events(&calls);
        assert_eq!(
            exported(&mut a, &rx).len(),
            3,
            "the budget refilled: three spans, one of them the admission"
        );
        // A release span comes with its admission's place, budget or not.
        a.handle_events(&[Event::Release(release("acme", 7, None))]);
        assert_eq!(exported(&mut a, &rx).len(), 1, "the release span");
        clock.advance(Duration::from_millis(340));
        a.handle_events(&[Event::Decision(parented)]);
        assert_eq!(
            exported(&mut a, &rx).len(),
            1,
            "a sampled parent's call gets a span once the budget has refilled a place"
        );
    }

    #[test]
    fn while_export_is_paused_no_span_is_recorded_and_released_leases_are_forgotten() {
        let clock = FakeClock::new(0);
        let (mut a, rx) = actor(&clock, 1.0);
        admit(&mut a, "acme", 1);
        assert_eq!(exported(&mut a, &rx).len(), 1);
        a.paused.set(Some(clock.mono() + NS_PER_SEC));
        a.handle_events(&[
            Event::Decision(decision("acme", DecisionKind::Shed, None)),
            Event::Decision(decision("acme", DecisionKind::Admitted, Some(2))),
            Event::Release(release("acme", 1, None)),
        ]);
        assert_eq!(a.open.len(), 0);
        assert!(exported(&mut a, &rx).is_empty());
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
}
