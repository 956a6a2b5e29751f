//! The tenant actor's part in MCP tasks and renewals: a task's start (its lease made long-lived
//! and its first poll scheduled), each poll, and lease renewal. In memory mode the tenant's
//! engine decides; with a shared store the store does (see [`super::remote`]), so a task started
//! on one replica can be polled and renewed on any.

use std::sync::Arc;

use actix::prelude::*;

use super::TenantActor;
use crate::engine::poll::PollPolicy;
use crate::engine::PollAnswer;
use crate::store::StoreTask;

/// Why a task or a lease could not be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskError {
    /// Not a live lease (or, for a poll, not a task): never issued, released, or expired.
    Unknown,
    /// The shared store does not answer: whether the lease is live is not known now.
    Unavailable,
}

/// Make an admitted call's lease a task; answers its poll interval in milliseconds.
#[derive(Message, Clone)]
#[rtype(result = "Result<u64, TaskError>")]
pub struct StartTask(pub u64);

/// A `tasks/get` for the task of a lease.
#[derive(Message, Clone)]
#[rtype(result = "Result<PollAnswer, TaskError>")]
pub struct PollTask(pub u64);

/// Extend a lease by `ttl_ns` (or its own TTL); answers how long it now lives, in nanoseconds.
#[derive(Message, Clone)]
#[rtype(result = "Result<u64, TaskError>")]
pub struct Renew {
    pub lease: u64,
    pub ttl_ns: Option<u64>,
}

type Answer<T> = ResponseActFuture<TenantActor, Result<T, TaskError>>;

impl Handler<StartTask> for TenantActor {
    type Result = Answer<u64>;

    fn handle(&mut self, msg: StartTask, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        let here = self.engine.start_task(msg.0, now);
        match (&self.remote, here) {
            (Some(r), Err(_)) => {
                let cfg = r.planner.config();
                let ttl_ns = cfg.tasks.lease_ttl.as_nanos() as u64;
                let poll = PollPolicy::new(&cfg.tasks);
                let fut = Arc::clone(&r.store).start_task(
                    self.engine.tenant().clone(),
                    msg.0,
                    ttl_ns,
                    poll,
                );
                self.in_store(fut)
            }
            (_, here) => Box::pin(actix::fut::ready(here.map_err(|_| TaskError::Unknown))),
        }
    }
}

impl Handler<PollTask> for TenantActor {
    type Result = Answer<PollAnswer>;

    fn handle(&mut self, msg: PollTask, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        let here = self.engine.poll_task(msg.0, now);
        match (&self.remote, here) {
            (Some(r), Err(_)) => {
                let poll = PollPolicy::new(&r.planner.config().tasks);
                let fut = Arc::clone(&r.store).poll_task(self.engine.tenant().clone(), msg.0, poll);
                self.in_store(fut)
            }
            (_, here) => Box::pin(actix::fut::ready(here.map_err(|_| TaskError::Unknown))),
        }
    }
}

impl Handler<Renew> for TenantActor {
    type Result = Answer<u64>;

    fn handle(&mut self, msg: Renew, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        let here = self.engine.renew(msg.lease, msg.ttl_ns, now);
        match (&self.remote, here) {
            (Some(r), Err(_)) => {
                let default_ns = r.planner.config().server.lease_ttl.as_nanos() as u64;
                let fut = Arc::clone(&r.store).renew(
                    self.engine.tenant().clone(),
                    msg.lease,
                    msg.ttl_ns,
                    default_ns,
                );
                let fut = async move {
                    fut.await.map(|left| {
                        left.map(|answer| StoreTask {
                            answer,
                            in_flight: None,
                        })
                    })
                };
                self.in_store(fut)
            }
            (_, here) => Box::pin(actix::fut::ready(here.map_err(|_| TaskError::Unknown))),
        }
    }
}

impl TenantActor {
    /// Waits for the store's answer without holding the actor up, keeps the tenant's count of
    /// tasks in flight that it gave (for the gauge), and tells a store that did not answer from a
    /// lease it does not have.
    fn in_store<T: 'static>(
        &mut self,
        fut: impl std::future::Future<Output = Result<Option<StoreTask<T>>, crate::store::StoreError>>
            + 'static,
    ) -> Answer<T> {
        if let Some(r) = &mut self.remote {
            r.in_store += 1;
        }
        Box::pin(fut.into_actor(self).map(|out, act, _| {
            let remote = act.remote.as_mut();
            if let Some(r) = remote {
                r.in_store -= 1;
            }
            match out {
                Ok(Some(t)) => {
                    if let (Some(n), Some(r)) = (t.in_flight, act.remote.as_mut()) {
                        r.tasks = n;
                    }
                    Ok(t.answer)
                }
                Ok(None) => Err(TaskError::Unknown),
                Err(_) => Err(TaskError::Unavailable),
            }
        }))
    }
}
