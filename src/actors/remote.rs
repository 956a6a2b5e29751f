//! A tenant actor whose state lives in the shared store (`[store] kind = "redis"`).
//!
//! The actor stays the unit of concurrency for its tenant in this replica: it plans each call with
//! its engine (synchronously), hands the call to the store and goes on with its mailbox; the store's
//! answer comes back to the actor ([`TenantActor::ask_store`]) and is turned into the decision there.
//! No handler waits on the network, and the calls of one tenant that are in flight together share the
//! store's multiplexed connections, pipelined.
//!
//! While the store does not answer, `on_error` decides: a 503 with a retry hint (`fail_closed`), an
//! admission checked against nothing (`fail_open`; its lease is this process's), or the in-memory
//! engine with every limit divided by `replicas` (`local_fallback`). The actor's `engine` is that
//! fallback engine; `planner` is the engine that plans for the store with the config as written.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::tenant::{truly_admitted, Admit, AdmitReply, ReleaseError, TenantActor};
use crate::clock::{Nanos, NS_PER_MS};
use crate::config::OnError;
use crate::engine::{
    Decision, ReleaseInfo, Released, RemoteAnswer, RemoteCall, RemoteOutcome, TenantEngine,
    TenantSnapshot, Verdict,
};
use crate::store::{RedisStore, Refund, StoreMode};
use crate::telemetry::names;

/// How often a call waiting for a concurrency slot asks the store again, at most and at least: a
/// slot freed by another replica is seen within the longer.
const BUSY_POLL_MIN: Duration = Duration::from_millis(10);
const BUSY_POLL_MAX: Duration = Duration::from_millis(100);

/// How often a replica records a subject it sees again in the tenant's subject index. The index
/// orders subjects by their last admission over the last day (for `/v1/tenants/{tenant}`), so a
/// minute's staleness does not change what it shows; recording every call cost three of the
/// script's commands per admission.
const INDEX_EVERY: Nanos = 60 * 1_000_000_000;

/// A tenant actor's part in a shared store.
pub struct Remote {
    pub(super) store: Arc<RedisStore>,
    /// Plans calls for the store and reads their answers, on the config as written.
    pub(super) planner: TenantEngine,
    /// Leases admitted unchecked while the store was down (`fail_open`), until their TTL.
    pub(super) detached: HashMap<u64, Nanos>,
    /// Calls handed to the store and not answered yet: the actor does not stop while any is.
    pub(super) in_store: u32,
    /// When this replica last recorded each subject in the store's subject index.
    indexed: HashMap<Arc<str>, Nanos>,
    /// When `indexed` was last cleared of entries older than [`INDEX_EVERY`].
    indexed_pruned: Nanos,
    /// The tenant's MCP tasks in flight, as the store counted them at this replica's last start or
    /// poll of one (for the gauge).
    pub(super) tasks: u64,
}

impl Remote {
    pub fn new(store: Arc<RedisStore>, planner: TenantEngine) -> Self {
        Remote {
            store,
            planner,
            detached: HashMap::new(),
            in_store: 0,
            indexed: HashMap::new(),
            indexed_pruned: 0,
            tasks: 0,
        }
    }

    /// Whether a call of `subject` should record it in the subject index: its first admission on
    /// this replica does, then one every [`INDEX_EVERY`].
    fn index_due(&self, subject: &str, now: Nanos) -> bool {
        self.indexed
            .get(subject)
            .is_none_or(|&at| now.saturating_sub(at) >= INDEX_EVERY)
    }

    /// Notes that an admission of `subject` recorded it in the index.
    fn indexed(&mut self, subject: &Arc<str>, now: Nanos) {
        if now.saturating_sub(self.indexed_pruned) >= INDEX_EVERY {
            self.indexed
                .retain(|_, at| now.saturating_sub(*at) < INDEX_EVERY);
            self.indexed_pruned = now;
        }
        self.indexed.insert(Arc::clone(subject), now);
    }
}

impl TenantActor {
    fn remote(&mut self) -> &mut Remote {
        self.remote.as_mut().expect("a remote tenant actor")
    }

    /// [`Admit`] for a tenant kept in the shared store.
    pub(super) fn admit_remote(&mut self, msg: Admit, ctx: &mut Context<Self>) {
        let (now, wall) = self.now();
        if now.saturating_sub(msg.sent) > super::ASK_TIMEOUT.as_nanos() as u64 {
            let _ = msg.reply.send(AdmitReply::Late);
            return;
        }
        if !self.remote().store.is_up() {
            return self.without_store(msg, now, wall, ctx);
        }
        match self.remote().planner.plan_remote(&msg.req, now) {
            Err(decided) => self.answer(msg.reply, decided),
            Ok(mut call) => {
                call.index = self.remote().index_due(&call.subject, now);
                let deadline = now.saturating_add(msg.req.max_wait_ns);
                self.ask_store(Arc::new(call), msg, now, deadline, ctx);
            }
        }
    }

    /// Hands a planned call to the store; its answer is decided on the actor. A call waiting for a
    /// concurrency slot asks again until its deadline, then once more allowed no wait (refused then
    /// with the slot the store expects to free first).
    fn ask_store(
        &mut self,
        call: Arc<RemoteCall>,
        msg: Admit,
        first_asked: Nanos,
        deadline: Nanos,
        ctx: &mut Context<Self>,
    ) {
        let store = Arc::clone(&self.remote().store);
        let tenant = self.engine.tenant().clone();
        self.remote().in_store += 1;
        let asked = store.decide(tenant, Arc::clone(&call));
        ctx.spawn(asked.into_actor(self).map(move |answer, act, ctx| {
            act.remote().in_store -= 1;
            let (now, wall) = act.now();
            let answer = match answer {
                Ok(a) => a,
                // This call follows on_error; the store is marked down after repeated failures.
                Err(_) => return act.without_store(msg, now, wall, ctx),
            };
            if call.index && matches!(answer, RemoteAnswer::Admitted { .. }) {
                act.remote().indexed(&call.subject, now);
            }
            match act.remote().planner.interpret_remote(&call, answer) {
                RemoteOutcome::Decided(mut d) => {
                    // A call that asked again waited for a slot until now.
                    if let (Verdict::Admitted(a), true) = (&mut d.verdict, call.asked_again) {
                        a.queued_ns = now.saturating_sub(first_asked);
                    }
                    act.answer_remote(msg.reply, d);
                }
                RemoteOutcome::Busy(_) if msg.reply.is_closed() => {}
                RemoteOutcome::Busy(expected) => {
                    let left = deadline.saturating_sub(now);
                    let mut again = (*call).clone();
                    again.asked_again = true;
                    if left == 0 {
                        again.max_wait_us = 0.0;
                        return act.ask_store(Arc::new(again), msg, first_asked, deadline, ctx);
                    }
                    again.max_wait_us = left as f64 / 1e3;
                    let pause = Duration::from_nanos(expected)
                        .clamp(BUSY_POLL_MIN, BUSY_POLL_MAX)
                        .min(Duration::from_nanos(left));
                    ctx.run_later(pause, move |act, ctx| {
                        act.ask_store(Arc::new(again), msg, first_asked, deadline, ctx);
                    });
                }
            }
        }));
    }

    /// Answers a decision made on the store; an admission whose caller went away is given back.
    fn answer_remote(&mut self, reply: oneshot::Sender<AdmitReply>, d: Decision) {
        let admitted = truly_admitted(&d);
        let lease = match &d.verdict {
            Verdict::Admitted(a) => Some(a.lease),
            Verdict::Shed(_) => None,
        };
        match reply.send(AdmitReply::Decided(d, self.engine.tenant().clone())) {
            Ok(()) => self.count(admitted),
            Err(_) => {
                if let Some(lease) = lease {
                    self.release_in_store(lease, None, Refund::Always);
                }
            }
        }
    }

    /// Answers a decision made here (in memory).
    fn answer(&mut self, reply: oneshot::Sender<AdmitReply>, d: Decision) {
        let admitted = truly_admitted(&d);
        if reply
            .send(AdmitReply::Decided(d, self.engine.tenant().clone()))
            .is_ok()
        {
            self.count(admitted);
        }
    }

    /// Decides a call without the store, as `on_error` says.
    fn without_store(&mut self, msg: Admit, now: Nanos, wall: i64, ctx: &mut Context<Self>) {
        let mode = self.remote().store.mode();
        let mode = match mode {
            StoreMode::Shared | StoreMode::Memory => match self.remote().store.on_error() {
                OnError::FailClosed => StoreMode::FailClosed,
                OnError::FailOpen => StoreMode::FailOpen,
                OnError::LocalFallback => StoreMode::LocalFallback,
            },
            m => m,
        };
        metrics::counter!(names::STORE_FALLBACK, "mode" => mode.as_str()).increment(1);
        match mode {
            StoreMode::FailOpen => {
                let d = self.remote().planner.admit_unchecked(&msg.req);
                if let Verdict::Admitted(a) = &d.verdict {
                    let ttl = self.engine.config().server.lease_ttl.as_nanos() as u64;
                    let until = now.saturating_add(ttl);
                    self.remote().detached.insert(a.lease, until);
                }
                self.answer(msg.reply, d);
            }
            StoreMode::LocalFallback => {
                let reply = self.decide_here(&msg.req, now, wall, ctx);
                self.send_decided(msg.reply, reply);
            }
            _ => {
                let _ = msg.reply.send(AdmitReply::StoreDown);
            }
        }
    }

    /// Ends a lease in the store without waiting for the answer (a caller that went away, an edge
    /// admission).
    pub(super) fn release_in_store(&mut self, lease: u64, info: Option<ReleaseInfo>, how: Refund) {
        let store = Arc::clone(&self.remote().store);
        let tenant = self.engine.tenant().clone();
        actix::spawn(async move {
            let _ = store.release(tenant, lease, info, how).await;
        });
    }

    /// A release of a lease this actor may not hold in memory: the fallback engine's, an unchecked
    /// one, or the store's.
    pub(super) fn release_remote(
        &mut self,
        lease: u64,
        info: ReleaseInfo,
        settle: crate::engine::Settlement,
    ) -> ResponseActFuture<Self, Result<Released, ReleaseError>> {
        let (now, wall) = self.now();
        if let Ok(mut released) = self
            .engine
            .release_settled(lease, &info, &settle, now, wall)
        {
            let granted = std::mem::take(&mut released.granted);
            self.deliver(granted);
            return Box::pin(actix::fut::ready(Ok(released)));
        }
        if self
            .remote()
            .detached
            .remove(&lease)
            .is_some_and(|until| until > now)
        {
            let released = Released {
                subject: Arc::from(""),
                tool: Arc::from(""),
                upstream: None,
                penalty: None,
                granted: Vec::new(),
            };
            return Box::pin(actix::fut::ready(Ok(released)));
        }
        let store = Arc::clone(&self.remote().store);
        let tenant = self.engine.tenant().clone();
        self.remote().in_store += 1;
        let run = info.duration_ms.map(|ms| ms.saturating_mul(NS_PER_MS));
        let fut = store.release_settled(tenant, lease, Some(info), Refund::IfHeld, Some(settle));
        Box::pin(fut.into_actor(self).map(move |out, act, _| {
            act.remote().in_store -= 1;
            // A store that did not answer is not a verdict on the lease: it may still hold its
            // slots there, and the caller is told to try again rather than that it is gone.
            let r = out
                .map_err(|e| ReleaseError::StoreUnavailable(e.to_string()))?
                .ok_or(ReleaseError::Unknown)?;
            let label = |s: &str| -> Arc<str> { Arc::from(s) };
            if let Some(run) = run {
                act.remote().planner.note_run_time(&r.subject, &r.tool, run);
            }
            Ok(Released {
                subject: label(&r.subject),
                tool: label(&r.tool),
                upstream: r.upstream.as_deref().map(label),
                penalty: r.penalty,
                granted: Vec::new(),
            })
        }))
    }

    /// An upstream answer outside a lease: into the store, or into the fallback engine while the
    /// store is down.
    pub(super) fn feedback_remote(
        &mut self,
        upstream: Arc<str>,
        status: u16,
        retry_after: Option<Duration>,
    ) -> ResponseActFuture<Self, Option<Duration>> {
        let (now, _) = self.now();
        if !self.remote().store.is_up() {
            let p = self.engine.feedback(&upstream, status, retry_after, now);
            self.flush();
            return Box::pin(actix::fut::ready(p));
        }
        let report = self.remote().planner.upstream_report(&upstream);
        let store = Arc::clone(&self.remote().store);
        let tenant = self.engine.tenant().clone();
        self.remote().in_store += 1;
        let fut = store.report(tenant, report, status, retry_after);
        Box::pin(fut.into_actor(self).map(move |out, act, _| {
            act.remote().in_store -= 1;
            if let Ok(p) = out {
                p
            } else {
                let (now, _) = act.now();
                act.engine.feedback(&upstream, status, retry_after, now)
            }
        }))
    }

    /// The tenant's state as the store holds it; `None` when it holds none.
    pub(super) fn snapshot_remote(&mut self) -> ResponseActFuture<Self, Option<TenantSnapshot>> {
        Box::pin(self.snapshot_checked().map(|out, _, _| out.ok().flatten()))
    }

    /// The tenant's state as the store holds it, `None` when it holds none, or why the store did
    /// not say.
    fn snapshot_checked(
        &mut self,
    ) -> ResponseActFuture<Self, Result<Option<TenantSnapshot>, String>> {
        let plan = self.remote().planner.remote_snapshot_plan();
        let store = Arc::clone(&self.remote().store);
        self.remote().in_store += 1;
        let fut = store.snapshot(plan.clone());
        Box::pin(fut.into_actor(self).map(move |out, act, _| {
            act.remote().in_store -= 1;
            let state = out.map_err(|e| e.to_string())?;
            let snap = plan.render(&state);
            let idle = state.subjects.is_empty()
                && state.tenant_inflight == 0
                && snap.buckets.iter().all(|b| b.reset_ms == 0)
                && snap.penalties.is_empty();
            Ok((!idle).then_some(snap))
        }))
    }

    /// Forgets unchecked leases past their TTL.
    pub(super) fn expire_detached(&mut self, now: Nanos) {
        if let Some(r) = &mut self.remote {
            r.detached.retain(|_, until| *until > now);
        }
    }
}

/// A tenant's snapshot from the shared store, telling "holds no state" from "the store did not
/// answer" (`GET /v1/tenants/{tenant}` answers 404 for the one and 503 for the other).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Result<Option<TenantSnapshot>, String>")]
pub struct StoreSnapshot;

impl Handler<StoreSnapshot> for TenantActor {
    type Result = ResponseActFuture<Self, Result<Option<TenantSnapshot>, String>>;

    fn handle(&mut self, _: StoreSnapshot, _: &mut Context<Self>) -> Self::Result {
        if self.remote.is_none() {
            return Box::pin(actix::fut::ready(Err(
                "this tenant is not kept in a shared store".to_string(),
            )));
        }
        self.snapshot_checked()
    }
}
