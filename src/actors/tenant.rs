//! The tenant actor: one per tenant, owning that tenant's [`TenantEngine`].
//!
//! Every handler is synchronous: it reads the clock, runs the engine and answers. Nothing awaits while
//! holding state, so a decision never waits on another tenant, on the network or on telemetry. Calls that
//! must wait for a concurrency slot are answered with a oneshot receiver; the actor completes it when a
//! slot frees (release, cancellation, lease expiry) or the deadline passes (a timer per waiter). A call
//! whose receiver is gone by then gets everything it took handed back at once.
//!
//! Once a second its arbiter's ticker sends it [`Tick`]: it expires leases, prunes resting state and
//! reports its gauges and expired leases together with the calls it answered since the last report
//! (what the shed-ratio alerts count). Leases also expire at their TTL in between: a call that needs
//! a slot, a release or a snapshot expires the ones that are due, and while calls wait for a slot a
//! timer at the next lease's end does. The actor stops itself once its state is back at rest and it has been idle for
//! `idle_ttl`, removing itself from the registry first, so memory follows the set of tenants that are
//! actually active.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::Shared;
use crate::clock::Nanos;
use crate::engine::durable::TenantDurable;
use crate::engine::{
    AdmitRequest, AdmitResult, Decision, LayerState, ReleaseInfo, TenantEngine, TenantSnapshot,
    UnknownLease, Verdict,
};
use crate::prefetch::prefetch_all;
use crate::store::Store;
use crate::telemetry::{CallCounts, TenantEvent};

/// How often leases are expired and idleness is checked (the arbiter's ticker sends [`Tick`]).
pub const TICK: Duration = Duration::from_secs(1);
/// How often resting per-subject state is pruned.
const PRUNE_EVERY_TICKS: u32 = 5;

pub struct TenantActor {
    /// The tenant's engine: its state in memory mode; with a shared store, the fallback engine
    /// (`on_error = "local_fallback"`) whose limits are divided by the replicas.
    pub(super) engine: TenantEngine,
    pub(super) shared: Arc<Shared>,
    /// With a shared store: the store, and the engine that plans for it (see [`super::remote`]).
    pub(super) remote: Option<super::remote::Remote>,
    generation: u64,
    waiters: HashMap<u64, oneshot::Sender<Decision>>,
    ticks: u32,
    /// Answers given since the last report (see [`CallCounts`]).
    pub(super) calls: CallCounts,
    /// When the timer armed by [`TenantActor::arm_expiry_timer`] fires, if one is armed.
    expiry_timer: Option<Nanos>,
    /// Admissions in the mailbox, counted up by their senders and down here as each is taken
    /// (see [`super::Shared::admit`]).
    mailbox: Arc<AtomicU32>,
}

/// Admitted, and not a shadow-mode admission that enforce mode would have refused.
pub(super) fn truly_admitted(d: &Decision) -> bool {
    matches!(&d.verdict, Verdict::Admitted(a) if a.would_shed.is_none())
}

impl TenantActor {
    pub fn new(tenant: Arc<str>, shared: Arc<Shared>, generation: u64) -> Self {
        let cfg = shared.config.load_full();
        let seed = shared.seed ^ generation.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let (engine, remote) = match shared.store() {
            Store::Memory => (
                TenantEngine::new(tenant, cfg, shared.budgets.clone(), seed),
                None,
            ),
            Store::Redis(store) => {
                let (fallback, budgets) = shared.local_fallback(&cfg);
                let mut planner =
                    TenantEngine::new(tenant.clone(), cfg, shared.budgets.clone(), seed ^ 1);
                planner.set_subject_labels(shared.telemetry.subject_labels());
                (
                    TenantEngine::new(tenant, fallback, budgets, seed),
                    Some(super::remote::Remote::new(store.clone(), planner)),
                )
            }
        };
        let mut engine = engine;
        engine.set_subject_labels(shared.telemetry.subject_labels());
        TenantActor {
            engine,
            shared,
            remote,
            generation,
            waiters: HashMap::new(),
            expiry_timer: None,
            ticks: 0,
            calls: CallCounts::default(),
            mailbox: Arc::default(),
        }
    }

    /// Shares the count of admissions in its mailbox with the registry.
    pub fn with_mailbox_count(mut self, count: Arc<AtomicU32>) -> Self {
        self.mailbox = count;
        self
    }

    /// The clock, after making sure the engine runs on the current config.
    pub(super) fn now(&mut self) -> (Nanos, i64) {
        let now = self.shared.clock.mono();
        let cfg = self.shared.config.load();
        let wall = self.shared.clock.wall_ms();
        if let Some(remote) = &mut self.remote {
            if !Arc::ptr_eq(&cfg, remote.planner.config()) {
                remote.planner.set_config(Arc::clone(&cfg), now);
                let (fallback, _) = self.shared.local_fallback(&cfg);
                self.engine.set_config(fallback, now);
                let granted = self.engine.grant_waiting(now, wall);
                self.deliver(granted);
            }
            return (now, wall);
        }
        if !Arc::ptr_eq(&cfg, self.engine.config()) {
            self.engine.set_config(Arc::clone(&cfg), now);
            // A reload may have raised a concurrency limit: let queued calls in now.
            let granted = self.engine.grant_waiting(now, wall);
            self.deliver(granted);
        }
        (now, wall)
    }

    /// Counts an answer for the shed-ratio alerts; a shadow-mode admission that enforce mode would
    /// have refused counts as shed, so shadow mode predicts enforce mode's alerts.
    pub(super) fn count(&mut self, admitted: bool) {
        if admitted {
            self.calls.admitted += 1;
        } else {
            self.calls.shed += 1;
        }
    }

    /// Ends the lease of an admission whose caller went away before the answer reached it, giving back
    /// what it took; returns the decisions of queued calls that got the freed slot.
    pub(super) fn give_back(&mut self, d: &Decision) -> Vec<(u64, Decision)> {
        let Verdict::Admitted(a) = &d.verdict else {
            return Vec::new();
        };
        let (now, wall) = self.now();
        self.engine
            .cancel_lease(a.lease, now, wall)
            .unwrap_or_default()
    }

    /// Sends a reply that [`Self::decide`] counted as answered. A caller that went away meanwhile
    /// was not answered after all: its count is taken back and its lease, if any, given back.
    pub(super) fn send_decided(&mut self, tx: oneshot::Sender<AdmitReply>, reply: AdmitReply) {
        if let Err(AdmitReply::Decided(d, _)) = tx.send(reply) {
            if truly_admitted(&d) {
                self.calls.admitted -= 1;
            } else {
                self.calls.shed = self.calls.shed.saturating_sub(1);
            }
            let granted = self.give_back(&d);
            self.deliver(granted);
        }
    }

    /// Hands decisions to queued callers. A caller that has gone away gets its lease cancelled, which may
    /// in turn let the next queued call in.
    pub(super) fn deliver(&mut self, mut granted: Vec<(u64, Decision)>) {
        while let Some((id, decision)) = granted.pop() {
            let Some(tx) = self.waiters.remove(&id) else {
                continue;
            };
            let admitted = truly_admitted(&decision);
            match tx.send(decision) {
                Ok(()) => self.count(admitted),
                Err(decision) => granted.extend(self.give_back(&decision)),
            }
        }
    }

    /// Delivers decisions the engine made outside a direct answer (calls queued for an upstream that
    /// just went into the penalty box).
    pub(super) fn flush(&mut self) {
        let pending = self.engine.drain_decisions();
        if !pending.is_empty() {
            self.deliver(pending);
        }
    }

    /// Expires the leases past their TTL and hands their slots to queued calls.
    fn expire_leases(&mut self, now: Nanos, wall: i64) {
        let (mut expired, granted) = self.engine.expire_leases(now, wall);
        // Leases an admission expired since the last tick are reported with these.
        expired.extend(self.engine.take_expired());
        if !expired.is_empty() {
            self.shared
                .telemetry
                .tenant_event(TenantEvent::LeasesExpired {
                    tenant: self.engine.tenant().clone(),
                    leases: expired,
                });
        }
        self.deliver(granted);
    }

    /// Expires leases now if any is due: for a snapshot, and for queued calls before the next tick
    /// (admissions expire leases themselves when they need a slot).
    fn expire_due_leases(&mut self, now: Nanos, wall: i64) {
        if self.engine.next_lease_expiry().is_some_and(|at| at <= now) {
            self.expire_leases(now, wall);
        }
    }

    /// While calls wait for a slot, a timer at the next lease's end expires it then, so the slot goes
    /// to the first queued call at that lease's TTL (the tick would come up to a second later). The
    /// next end may be that of a lease released since (its entry stays until its time): the timer
    /// then arms itself again for the one after. One timer at a time, however many calls wait.
    fn arm_expiry_timer(&mut self, now: Nanos, ctx: &mut Context<Self>) {
        let (Some(at), Some(until)) = (
            self.engine.next_lease_expiry(),
            self.engine.next_waiter_deadline(),
        ) else {
            return;
        };
        if at >= until || self.expiry_timer.is_some_and(|armed| armed <= at) {
            return;
        }
        self.expiry_timer = Some(at);
        ctx.run_later(Duration::from_nanos(at.saturating_sub(now)), |act, ctx| {
            act.expiry_timer = None;
            let (now, wall) = act.now();
            act.expire_due_leases(now, wall);
            act.arm_expiry_timer(now, ctx);
        });
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        let (now, wall) = self.now();
        self.expire_leases(now, wall);
        self.expire_detached(now);
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks % PRUNE_EVERY_TICKS == 0 {
            self.engine.prune(now, wall);
        }
        let mut gauges = self.engine.gauges(now, wall);
        if let Some(r) = &self.remote {
            gauges.tasks = r.tasks;
        }
        gauges.spend_settled = self.engine.take_settled_spend();
        self.shared.telemetry.tenant_event(TenantEvent::Gauges {
            tenant: self.engine.tenant().clone(),
            gauges,
            calls: std::mem::take(&mut self.calls),
        });
        let idle_ttl = self.engine.config().server.idle_ttl.as_nanos() as u64;
        let last_active = match &self.remote {
            Some(r) => r.planner.last_active().max(self.engine.last_active()),
            None => self.engine.last_active(),
        };
        let remote_at_rest = self
            .remote
            .as_ref()
            .is_none_or(|r| r.in_store == 0 && r.detached.is_empty());
        if now.saturating_sub(last_active) >= idle_ttl
            && self.engine.is_at_rest(now, wall)
            && remote_at_rest
        {
            self.shared
                .registry_remove(self.engine.tenant(), self.generation);
            // Its series go to zero rather than freezing at their last value.
            self.shared.telemetry.tenant_event(TenantEvent::Gauges {
                tenant: self.engine.tenant().clone(),
                gauges: Default::default(),
                calls: std::mem::take(&mut self.calls),
            });
            ctx.stop();
        }
    }
}

impl Actor for TenantActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Bursts of parallel calls for one tenant are normal (agent fan-out); let them queue here rather
        // than make every sender wait for mailbox space. Admissions are bounded by `[overload]
        // mailbox` before they are sent; the capacity is above that bound so that a release (sent
        // with `send`, which waits for room) never waits behind a full mailbox of admissions.
        let admissions = self.shared.config.load().overload.mailbox;
        ctx.set_mailbox_capacity(admissions.saturating_add(1024).max(4096));
    }
}

/// Once a second, from the ticker of the actor's arbiter ([`super::Shared::tick_arbiter`]): expire
/// leases, prune resting state, report gauges and counts, and stop when idle. One ticker per arbiter
/// rather than a timer per actor: actix polls every timer an actor owns each time it handles a
/// message, and that poll showed in the profile of every admission.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct Tick;

impl Handler<Tick> for TenantActor {
    type Result = ();

    fn handle(&mut self, _: Tick, ctx: &mut Context<Self>) {
        self.tick(ctx);
    }
}

/// Admit a call (see [`TenantEngine::admit`]). Sent with `do_send` and answered on `reply` (see
/// [`super::Shared::admit`]), which lets the actor skip a call whose caller went away while it
/// waited in the mailbox, and give back an admission whose caller went away before the answer
/// arrived. `do_send` does not wait for mailbox space; the mailbox is bounded anyway, by one call
/// per open connection (each waits for its answer), and calls that waited longer than
/// [`super::ASK_TIMEOUT`] are answered at once without being decided.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Admit {
    pub req: AdmitRequest,
    /// When the request was sent, on the shared clock's monotonic scale.
    pub sent: Nanos,
    pub reply: oneshot::Sender<AdmitReply>,
}

/// The answer to [`Admit`]. The large variant is the common one: boxing it would cost an allocation
/// per admission to save a copy of a few hundred bytes on the rare ones.
#[allow(clippy::large_enum_variant)]
pub enum AdmitReply {
    /// With the tenant's name as the actor holds it, so telemetry shares it instead of copying it.
    Decided(Decision, Arc<str>),
    /// The request waited in the mailbox longer than [`super::ASK_TIMEOUT`]: the actor is that far
    /// behind, so it is not decided (a decision that late is stale, and skipping it lets the actor catch
    /// up); the caller answers 503.
    Late,
    /// Waiting for a concurrency slot: the decision arrives on the receiver.
    Queued {
        waiter: u64,
        rx: oneshot::Receiver<Decision>,
    },
    /// The shared store does not answer and `on_error = "fail_closed"`: the caller answers 503 with
    /// a retry hint.
    StoreDown,
}

impl Handler<Admit> for TenantActor {
    type Result = ();

    fn handle(&mut self, msg: Admit, ctx: &mut Context<Self>) {
        // Never below 0: an admission sent past the registry (as tests do) was not counted up.
        let _ = self
            .mailbox
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        // The actor's state (its engine included) and the lease slot it will write are most likely
        // out of cache: ask for all of it at once rather than one line at a time as it is read.
        prefetch_all(std::ptr::from_ref::<Self>(self));
        self.engine.prefetch_lease_slot();
        if msg.reply.is_closed() {
            // The caller went away while the call waited in the mailbox: nothing to decide.
            return;
        }
        if self.remote.is_some() {
            return self.admit_remote(msg, ctx);
        }
        let reply = self.decide(&msg.req, msg.sent, ctx);
        self.send_decided(msg.reply, reply);
    }
}

impl TenantActor {
    fn decide(&mut self, req: &AdmitRequest, sent: Nanos, ctx: &mut Context<Self>) -> AdmitReply {
        let (now, wall) = self.now();
        if now.saturating_sub(sent) > super::ASK_TIMEOUT.as_nanos() as u64 {
            return AdmitReply::Late;
        }
        self.decide_here(req, now, wall, ctx)
    }

    /// The in-memory decision: the engine's answer, or a place in its queue for a slot.
    pub(super) fn decide_here(
        &mut self,
        req: &AdmitRequest,
        now: Nanos,
        wall: i64,
        ctx: &mut Context<Self>,
    ) -> AdmitReply {
        let result = self.engine.admit(req, now, wall);
        // Queued calls that got the slots of leases this admission expired.
        self.flush();
        match result {
            AdmitResult::Decided(d) => {
                self.count(truly_admitted(&d));
                AdmitReply::Decided(d, self.engine.tenant().clone())
            }
            AdmitResult::Queued { waiter, deadline } => self.queue(waiter, deadline, now, ctx),
        }
    }

    /// Waits for a concurrency slot: the engine queued the call as `waiter` until `deadline`.
    pub(super) fn queue(
        &mut self,
        waiter: u64,
        deadline: Nanos,
        now: Nanos,
        ctx: &mut Context<Self>,
    ) -> AdmitReply {
        let (tx, rx) = oneshot::channel();
        self.waiters.insert(waiter, tx);
        self.arm_expiry_timer(now, ctx);
        ctx.run_later(
            Duration::from_nanos(deadline.saturating_sub(now)),
            |act, _| {
                let (now, wall) = act.now();
                act.expire_due_leases(now, wall);
                let expired = act.engine.expire_waiters(now);
                act.deliver(expired);
            },
        );
        AdmitReply::Queued { waiter, rx }
    }
}

/// Why a release ended no lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseError {
    /// No such lease: never issued, released already, or expired.
    Unknown,
    /// The shared store holding the lease did not answer (the message says how); the lease may
    /// still hold its slots there, so the caller should release it again.
    StoreUnavailable(String),
}

impl From<UnknownLease> for ReleaseError {
    fn from(_: UnknownLease) -> Self {
        ReleaseError::Unknown
    }
}

/// End a lease.
#[derive(Message, Clone)]
#[rtype(result = "Result<crate::engine::Released, ReleaseError>")]
pub struct Release {
    pub lease: u64,
    pub info: ReleaseInfo,
    /// What the call actually spent (spend per unit, cost units); empty: the estimates stand.
    pub settle: crate::engine::Settlement,
}

impl Handler<Release> for TenantActor {
    type Result = ResponseActFuture<Self, Result<crate::engine::Released, ReleaseError>>;

    fn handle(&mut self, msg: Release, _: &mut Context<Self>) -> Self::Result {
        if self.remote.is_some() {
            return self.release_remote(msg.lease, msg.info, msg.settle);
        }
        Box::pin(actix::fut::ready(
            self.release_here(msg).map_err(ReleaseError::from),
        ))
    }
}

impl TenantActor {
    fn release_here(&mut self, msg: Release) -> Result<crate::engine::Released, UnknownLease> {
        let (now, wall) = self.now();
        // A lease past its TTL has expired, whether or not a tick has reaped it yet: it is expired
        // now (and counted so), and its release is answered as an unknown lease's.
        if self.engine.lease_past_ttl(msg.lease, now) {
            self.expire_leases(now, wall);
        }
        let mut released =
            self.engine
                .release_settled(msg.lease, &msg.info, &msg.settle, now, wall)?;
        let granted = std::mem::take(&mut released.granted);
        self.deliver(granted);
        Ok(released)
    }
}

/// Give back what a held call took: its caller went away during the hold.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct CancelLease(pub u64);

impl Handler<CancelLease> for TenantActor {
    type Result = ();

    fn handle(&mut self, msg: CancelLease, _: &mut Context<Self>) {
        let (now, wall) = self.now();
        match self.engine.cancel_lease(msg.0, now, wall) {
            Ok(granted) => {
                // Counted as admitted, but its caller never got the answer.
                self.calls.admitted -= 1;
                self.deliver(granted);
            }
            Err(_) if self.remote.is_some() => {
                self.calls.admitted -= 1;
                self.release_in_store(msg.0, None, crate::store::Refund::Always);
            }
            Err(_) => {}
        }
    }
}

/// End the lease of a call admitted by the edge check at once: the gateway cannot release it, so
/// the call holds no concurrency slot and reports nothing about its upstream. What it spent on the
/// rate layers stays spent, and it stays counted as admitted.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct EndEdgeLease(pub u64);

impl Handler<EndEdgeLease> for TenantActor {
    type Result = ();

    fn handle(&mut self, msg: EndEdgeLease, _: &mut Context<Self>) {
        let (now, wall) = self.now();
        // Decided without a hold (the edge never waits), so there is no charge to refund.
        match self.engine.cancel_lease(msg.0, now, wall) {
            Ok(granted) => self.deliver(granted),
            Err(_) if self.remote.is_some() => {
                self.release_in_store(msg.0, None, crate::store::Refund::Never);
            }
            Err(_) => {}
        }
    }
}

/// Drop a queued call whose caller went away.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct CancelWaiter(pub u64);

impl Handler<CancelWaiter> for TenantActor {
    type Result = ();

    fn handle(&mut self, msg: CancelWaiter, _: &mut Context<Self>) {
        self.engine.cancel_waiter(msg.0);
        self.waiters.remove(&msg.0);
    }
}

/// An upstream answer seen outside a lease.
#[derive(Message, Clone)]
#[rtype(result = "Option<Duration>")]
pub struct Feedback {
    pub upstream: Arc<str>,
    pub status: u16,
    pub retry_after: Option<Duration>,
}

impl Handler<Feedback> for TenantActor {
    type Result = ResponseActFuture<Self, Option<Duration>>;

    fn handle(&mut self, msg: Feedback, _: &mut Context<Self>) -> Self::Result {
        if self.remote.is_some() {
            return self.feedback_remote(msg.upstream, msg.status, msg.retry_after);
        }
        let (now, _) = self.now();
        let penalty = self
            .engine
            .feedback(&msg.upstream, msg.status, msg.retry_after, now);
        self.flush();
        Box::pin(actix::fut::ready(penalty))
    }
}

/// After a hold: go ahead (`None`), or the refusal if an upstream of the call went into the penalty box
/// meanwhile (everything the call took is given back).
#[derive(Message, Clone)]
#[rtype(result = "Result<Option<Decision>, UnknownLease>")]
pub struct ConfirmHold(pub u64);

impl Handler<ConfirmHold> for TenantActor {
    type Result = Result<Option<Decision>, UnknownLease>;

    fn handle(&mut self, msg: ConfirmHold, _: &mut Context<Self>) -> Self::Result {
        let (now, wall) = self.now();
        let r = self.engine.confirm_hold(msg.0, now, wall);
        if let Ok(Some(refused)) = &r {
            // Counted as admitted when the hold began; the caller is answered with this refusal.
            self.calls.admitted -= 1;
            self.count(truly_admitted(refused));
        }
        self.flush();
        r
    }
}

/// The tenant's state as JSON-ready data; `None` when it holds no state.
#[derive(Message, Clone)]
#[rtype(result = "Option<TenantSnapshot>")]
pub struct Snapshot;

/// The bucket layers a call would pass, without deciding it (see [`TenantEngine::layers_of`]).
#[derive(Message, Clone)]
#[rtype(result = "Vec<LayerState>")]
pub struct Layers(pub AdmitRequest);

impl Handler<Layers> for TenantActor {
    type Result = MessageResult<Layers>;

    fn handle(&mut self, msg: Layers, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        MessageResult(self.engine.layers_of(&msg.0, now))
    }
}

/// Report the calls answered since the last report now rather than at the next tick (a read of
/// `GET /v1/alerts`, see [`crate::telemetry::Telemetry::refresh_alerts`]).
#[derive(Message, Clone, Copy)]
#[rtype(result = "()")]
pub struct ReportCalls;

impl Handler<ReportCalls> for TenantActor {
    type Result = ();

    fn handle(&mut self, _: ReportCalls, _: &mut Context<Self>) {
        let calls = std::mem::take(&mut self.calls);
        if calls != CallCounts::default() {
            self.shared.telemetry.tenant_event(TenantEvent::Calls {
                tenant: self.engine.tenant().clone(),
                calls,
            });
        }
    }
}

/// The tenant's state worth keeping across a restart (see [`crate::engine::durable`]); `None` when
/// there is none.
#[derive(Message, Clone)]
#[rtype(result = "Option<TenantDurable>")]
pub struct ExportDurable;

impl Handler<ExportDurable> for TenantActor {
    type Result = Option<TenantDurable>;

    fn handle(&mut self, _: ExportDurable, _: &mut Context<Self>) -> Self::Result {
        if self.remote.is_some() {
            // The shared store keeps this state itself.
            return None;
        }
        let (now, wall) = self.now();
        let kept = self.engine.export_durable(now, wall);
        (!kept.is_empty()).then_some(kept)
    }
}

/// Takes back state kept from before a restart, before the tenant's first call.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct ImportDurable(pub Arc<TenantDurable>);

impl Handler<ImportDurable> for TenantActor {
    type Result = ();

    fn handle(&mut self, msg: ImportDurable, _: &mut Context<Self>) {
        let (now, wall) = self.now();
        self.engine.import_durable(&msg.0, now, wall);
    }
}

impl Handler<Snapshot> for TenantActor {
    type Result = ResponseActFuture<Self, Option<TenantSnapshot>>;

    fn handle(&mut self, _: Snapshot, _: &mut Context<Self>) -> Self::Result {
        if self.remote.is_some() {
            return self.snapshot_remote();
        }
        let (now, wall) = self.now();
        self.expire_due_leases(now, wall);
        let snap = self
            .engine
            .has_state(now, wall)
            .then(|| self.engine.snapshot(now, wall));
        Box::pin(actix::fut::ready(snap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, FakeClock};
    use crate::config::Config;
    use crate::telemetry::Telemetry;

    /// Sums the call counts of the tenant reports it receives.
    struct Reports(Arc<parking_lot::Mutex<Vec<CallCounts>>>);

    impl Actor for Reports {
        type Context = Context<Self>;

        fn started(&mut self, ctx: &mut Context<Self>) {
            ctx.set_mailbox_capacity(1024);
        }
    }

    impl Handler<crate::telemetry::Batch> for Reports {
        type Result = ();
        fn handle(&mut self, b: crate::telemetry::Batch, _: &mut Context<Self>) {
            for ev in b.0.iter() {
                if let crate::telemetry::Event::Tenant(t) = ev {
                    if let TenantEvent::Gauges { calls, .. } = &**t {
                        self.0.lock().push(*calls);
                    }
                }
            }
        }
    }

    #[test]
    fn the_tenant_report_counts_what_callers_were_answered() {
        actix::System::new().block_on(async {
            let clock = Arc::new(FakeClock::new(0));
            let cfg = Config::parse(
                "t.toml",
                "[limits.subject]\nrate = \"1/h\"\nburst = 2\n[limits.tenant]\nconcurrency = 1\n",
            )
            .unwrap();
            let reports = Arc::new(parking_lot::Mutex::new(Vec::new()));
            let sink = Reports(reports.clone()).start().recipient();
            let shared = Shared::new(
                cfg,
                clock.clone(),
                Telemetry::to_recipient(sink),
                vec![actix::Arbiter::current()],
            );
            let on = |subject: &str| AdmitRequest {
                subject: subject.into(),
                ..req()
            };
            // One admitted; a second call finds the tenant's only slot taken and, allowed no wait, is
            // shed at once.
            let first = shared.admit("acme", on("a"), clock.mono()).await.unwrap();
            let AdmitReply::Decided(d, _) = first else {
                panic!("decided at once")
            };
            let Verdict::Admitted(a) = d.verdict else {
                panic!("admitted")
            };
            let second = shared.admit("acme", on("b"), clock.mono()).await.unwrap();
            assert!(matches!(second, AdmitReply::Decided(ref d, _) if !d.is_admitted()));
            // A caller that went away during its hold is taken back off the admitted count.
            shared.tell_existing("acme", CancelLease(a.lease));
            for slot in 0..super::super::TICK_SLOTS {
                shared.tick_arbiter(0, slot);
            }
            // The tick and the report are messages: let the actors handle them.
            let mut total = CallCounts::default();
            for _ in 0..100 {
                actix::clock::sleep(Duration::from_millis(10)).await;
                for c in reports.lock().drain(..) {
                    total.admitted += c.admitted;
                    total.shed += c.shed;
                }
                if total != CallCounts::default() {
                    break;
                }
            }
            assert_eq!(
                total,
                CallCounts {
                    admitted: 0,
                    shed: 1
                }
            );
            // Nothing happened since: the next report counts nothing.
            for slot in 0..super::super::TICK_SLOTS {
                shared.tick_arbiter(0, slot);
            }
            actix::clock::sleep(Duration::from_millis(50)).await;
            let later = reports.lock().clone();
            assert!(!later.is_empty(), "every tick reports");
            assert!(later.iter().all(|c| *c == CallCounts::default()));
        });
    }

    #[test]
    fn each_tick_slot_reaches_its_share_of_the_actors_and_a_round_reaches_all() {
        actix::System::new().block_on(async {
            let clock = Arc::new(FakeClock::new(0));
            let reports = Arc::new(parking_lot::Mutex::new(Vec::new()));
            let sink = Reports(reports.clone()).start().recipient();
            let shared = Shared::new(
                Config::default(),
                clock.clone(),
                Telemetry::to_recipient(sink),
                vec![actix::Arbiter::current()],
            );
            let slots = super::super::TICK_SLOTS;
            let tenants: Vec<String> = (0..3 * slots).map(|t| format!("t{t}")).collect();
            for t in &tenants {
                shared.admit(t, req(), clock.mono()).await.unwrap();
            }
            let in_slot = |slot: u64| {
                tenants
                    .iter()
                    .filter(|t| Shared::tick_slot(t) == slot)
                    .count()
            };
            let settle = || actix::clock::sleep(Duration::from_millis(50));
            let slot = Shared::tick_slot(&tenants[0]);
            shared.tick_arbiter(0, slot);
            settle().await;
            assert!(in_slot(slot) >= 1);
            assert_eq!(
                reports.lock().len(),
                in_slot(slot),
                "exactly the slot's actors"
            );
            reports.lock().clear();
            for slot in slots..2 * slots {
                shared.tick_arbiter(0, slot);
            }
            settle().await;
            assert_eq!(
                reports.lock().len(),
                tenants.len(),
                "a round of slots ticks every actor once"
            );
            // Slots are spread: no slot holds more than a few times its share.
            assert!(
                (0..slots).all(|s| in_slot(s) <= 12),
                "{:?}",
                (0..slots).map(in_slot).collect::<Vec<_>>()
            );
        });
    }

    #[test]
    fn a_call_whose_caller_has_gone_before_its_turn_is_not_decided() {
        actix::System::new().block_on(async {
            let clock = Arc::new(FakeClock::new(0));
            let shared = Shared::new(
                Config::default(),
                clock.clone(),
                Telemetry::default(),
                vec![actix::Arbiter::current()],
            );
            // Start the actor, then post a call whose receiver is already gone.
            shared.admit("acme", req(), clock.mono()).await.unwrap();
            let (reply, answer) = oneshot::channel();
            drop(answer);
            let (_, addr) = shared.tenant_or_start("acme");
            addr.do_send(Admit {
                req: req(),
                sent: clock.mono(),
                reply,
            });
            actix::clock::sleep(Duration::from_millis(20)).await;
            let snapshot = shared.ask_existing("acme", Snapshot).await.unwrap();
            assert!(
                matches!(snapshot, Some(Some(s)) if s.leases == 1),
                "only the first call holds a lease"
            );
        });
    }

    fn req() -> AdmitRequest {
        AdmitRequest {
            subject: "s".into(),
            tool: "t".into(),
            upstream: None,
            cost: None,
            max_wait_ns: 0,
            returning: false,
            spend: None,
        }
    }

    #[test]
    fn admissions_past_the_mailbox_bound_are_refused_unsent_and_the_bound_frees_as_they_are_taken()
    {
        actix::System::new().block_on(async {
            let clock = Arc::new(FakeClock::new(0));
            let cfg = Config::parse("t.toml", "[overload]\nmailbox = 3\n").unwrap();
            let shared = Shared::new(
                cfg,
                clock.clone(),
                Telemetry::default(),
                vec![actix::Arbiter::current()],
            );
            let on = |s: &str| AdmitRequest {
                subject: s.into(),
                ..req()
            };
            // All five are sent before the actor (on this thread) takes any.
            let asks = (0..5).map(|i| shared.admit("acme", on(&format!("s{i}")), clock.mono()));
            let replies = futures_util::future::join_all(asks).await;
            let overloaded = replies
                .iter()
                .filter(|r| matches!(r, Err(super::super::AskError::Overloaded)))
                .count();
            let decided = replies
                .iter()
                .filter(|r| matches!(r, Ok(AdmitReply::Decided(d, _)) if d.is_admitted()))
                .count();
            assert_eq!((decided, overloaded), (3, 2));
            // Taken and answered: room for as many again.
            let asks = (0..3).map(|i| shared.admit("acme", on(&format!("t{i}")), clock.mono()));
            let replies = futures_util::future::join_all(asks).await;
            assert!(replies
                .iter()
                .all(|r| matches!(r, Ok(AdmitReply::Decided(..)))));
        });
    }

    #[test]
    fn an_admission_that_waited_too_long_in_the_mailbox_is_not_decided() {
        actix::System::new().block_on(async {
            let clock = Arc::new(FakeClock::new(0));
            clock.advance(Duration::from_secs(60));
            let shared = Shared::new(
                Config::default(),
                clock.clone(),
                Telemetry::default(),
                vec![actix::Arbiter::current()],
            );
            let limit = super::super::ASK_TIMEOUT.as_nanos() as u64;
            let now = clock.mono();

            let reply = shared.admit("acme", req(), now - limit - 1).await.unwrap();
            assert!(matches!(reply, AdmitReply::Late));
            // Nothing was spent: the tenant holds no state at all.
            let snapshot = shared.ask_existing("acme", Snapshot).await.unwrap();
            assert!(matches!(snapshot, Some(None)));

            let reply = shared.admit("acme", req(), now - limit).await.unwrap();
            assert!(matches!(reply, AdmitReply::Decided(ref d, ref t) if d.is_admitted() && &**t == "acme"));
            let snapshot = shared.ask_existing("acme", Snapshot).await.unwrap();
            assert!(matches!(snapshot, Some(Some(s)) if s.leases == 1));
        });
    }

    /// A tenant with one concurrency slot and a one-second lease TTL, on a fake clock, with no tick
    /// running: only the admission path can expire leases.
    fn one_slot() -> (Arc<FakeClock>, Arc<Shared>) {
        let clock = Arc::new(FakeClock::new(0));
        let cfg = Config::parse(
            "t.toml",
            "[server]\nlease_ttl = \"1s\"\n[limits.tenant]\nconcurrency = 1\n",
        )
        .unwrap();
        let shared = Shared::new(
            cfg,
            clock.clone(),
            Telemetry::default(),
            vec![actix::Arbiter::current()],
        );
        (clock, shared)
    }

    fn admitted(reply: &AdmitReply) -> bool {
        matches!(reply, AdmitReply::Decided(d, _) if d.is_admitted())
    }

    fn lease_of(reply: AdmitReply) -> u64 {
        match reply {
            AdmitReply::Decided(d, _) => match d.verdict {
                Verdict::Admitted(a) => a.lease,
                v => panic!("expected an admission, got {v:?}"),
            },
            _ => panic!("decided at once"),
        }
    }

    /// Posts a call allowed to wait (fake) 5 s, which must queue for the slot.
    async fn queue(shared: &Arc<Shared>, clock: &FakeClock) -> oneshot::Receiver<Decision> {
        let waiting = AdmitRequest {
            max_wait_ns: 5_000_000_000,
            ..req()
        };
        match shared.admit("acme", waiting, clock.mono()).await.unwrap() {
            AdmitReply::Queued { rx, .. } => rx,
            _ => panic!("expected to queue"),
        }
    }

    /// The queued call's decision, which must come within 3 (real) seconds, long before its wait
    /// ends.
    async fn decided_soon(rx: oneshot::Receiver<Decision>, why: &str) -> Decision {
        tokio::time::timeout(Duration::from_secs(3), rx)
            .await
            .expect(why)
            .unwrap()
    }

    #[test]
    fn a_lease_frees_its_slot_at_its_ttl_without_waiting_for_the_tick() {
        actix::System::new().block_on(async {
            let (clock, shared) = one_slot();
            let first = shared.admit("acme", req(), clock.mono()).await.unwrap();
            assert!(admitted(&first));
            clock.advance(Duration::from_millis(999));
            let early = shared.admit("acme", req(), clock.mono()).await.unwrap();
            assert!(!admitted(&early), "the slot is still held before the TTL");
            clock.advance(Duration::from_millis(1));
            let due = shared.admit("acme", req(), clock.mono()).await.unwrap();
            assert!(admitted(&due), "the expired lease gave its slot back");
            let snapshot = shared.ask_existing("acme", Snapshot).await.unwrap();
            assert!(matches!(snapshot, Some(Some(s)) if s.leases == 1 && s.inflight == 1));
        });
    }

    #[test]
    fn a_snapshot_does_not_show_leases_past_their_ttl() {
        actix::System::new().block_on(async {
            let (clock, shared) = one_slot();
            shared.admit("acme", req(), clock.mono()).await.unwrap();
            clock.advance(Duration::from_secs(1));
            let snapshot = shared.ask_existing("acme", Snapshot).await.unwrap();
            assert!(
                matches!(snapshot, Some(Some(ref s)) if s.leases == 0 && s.inflight == 0),
                "{snapshot:?}"
            );
        });
    }

    #[test]
    fn a_queued_call_gets_the_slot_when_the_lease_holding_it_expires() {
        actix::System::new().block_on(async {
            let (clock, shared) = one_slot();
            shared.admit("acme", req(), clock.mono()).await.unwrap();
            let rx = queue(&shared, &clock).await;
            // The lease is past its TTL on the fake clock; the actor's timer for it fires after the
            // same (real) second, well before the wait's end.
            clock.advance(Duration::from_millis(1500));
            let decision =
                decided_soon(rx, "decided when the lease expired, not at the wait's end").await;
            assert!(decision.is_admitted());
        });
    }

    #[test]
    fn a_released_lease_does_not_keep_a_queued_call_waiting_past_the_next_lease_end() {
        actix::System::new().block_on(async {
            let (clock, shared) = one_slot();
            // A lease released early leaves its end behind, before the end of the lease that holds
            // the slot when the next call queues.
            let first = lease_of(shared.admit("acme", req(), clock.mono()).await.unwrap());
            shared.tell_existing("acme", CancelLease(first));
            clock.advance(Duration::from_millis(500));
            assert!(admitted(
                &shared.admit("acme", req(), clock.mono()).await.unwrap()
            ));
            let rx = queue(&shared, &clock).await;
            // Past the released lease's end only: the timer finds nothing to free and arms itself
            // for the second lease's end, which has passed too by the time it fires.
            clock.advance(Duration::from_millis(700));
            actix::clock::sleep(Duration::from_millis(700)).await;
            clock.advance(Duration::from_millis(400));
            let decision = decided_soon(
                rx,
                "decided at the second lease's end, not at the wait's end",
            )
            .await;
            assert!(decision.is_admitted());
        });
    }

    #[test]
    fn a_lease_released_after_its_ttl_has_expired_whether_or_not_a_tick_came() {
        actix::System::new().block_on(async {
            let (clock, shared) = one_slot();
            let release = |id| Release {
                lease: id,
                info: crate::engine::ReleaseInfo {
                    outcome: crate::engine::Outcome::Ok,
                    upstream_status: None,
                    retry_after: None,
                    duration_ms: None,
                },
                settle: Default::default(),
            };
            let a = lease_of(shared.admit("acme", req(), clock.mono()).await.unwrap());
            clock.advance(Duration::from_millis(999));
            assert!(shared.ask("acme", release(a)).await.unwrap().is_ok());
            let b = lease_of(shared.admit("acme", req(), clock.mono()).await.unwrap());
            clock.advance(Duration::from_secs(1));
            assert!(shared.ask("acme", release(b)).await.unwrap().is_err());
            let snapshot = shared.ask_existing("acme", Snapshot).await.unwrap();
            assert!(matches!(snapshot, Some(Some(ref s)) if s.leases == 0 && s.inflight == 0));
        });
    }
}
