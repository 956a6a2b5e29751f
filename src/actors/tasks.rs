//! The tenant actor's part in MCP tasks and renewals: a task's start (its lease made long-lived
//! and its first poll scheduled), each poll, and lease renewal. In memory mode the tenant's
//! engine decides; with a shared store the store does (see [`super::remote`]), so a task started
//! on one replica can be polled and renewed on any.

use actix::prelude::*;

use super::TenantActor;
use crate::engine::{PollAnswer, UnknownLease};

/// Make an admitted call's lease a task; answers its poll interval in milliseconds.
#[derive(Message, Clone)]
#[rtype(result = "Result<u64, UnknownLease>")]
pub struct StartTask(pub u64);

/// A `tasks/get` for the task of a lease.
#[derive(Message, Clone)]
#[rtype(result = "Result<PollAnswer, UnknownLease>")]
pub struct PollTask(pub u64);

/// Extend a lease by `ttl_ns` (or its own TTL); answers how long it now lives, in nanoseconds.
#[derive(Message, Clone)]
#[rtype(result = "Result<u64, UnknownLease>")]
pub struct Renew {
    pub lease: u64,
    pub ttl_ns: Option<u64>,
}

impl Handler<StartTask> for TenantActor {
    type Result = ResponseActFuture<Self, Result<u64, UnknownLease>>;

    fn handle(&mut self, msg: StartTask, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        let here = self.engine.start_task(msg.0, now);
        if here.is_err() && self.remote.is_some() {
            return self.start_task_remote(msg.0);
        }
        Box::pin(actix::fut::ready(here))
    }
}

impl Handler<PollTask> for TenantActor {
    type Result = ResponseActFuture<Self, Result<PollAnswer, UnknownLease>>;

    fn handle(&mut self, msg: PollTask, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        let here = self.engine.poll_task(msg.0, now);
        if here.is_err() && self.remote.is_some() {
            return self.poll_task_remote(msg.0);
        }
        Box::pin(actix::fut::ready(here))
    }
}

impl Handler<Renew> for TenantActor {
    type Result = ResponseActFuture<Self, Result<u64, UnknownLease>>;

    fn handle(&mut self, msg: Renew, _: &mut Context<Self>) -> Self::Result {
        let (now, _) = self.now();
        let here = self.engine.renew(msg.lease, msg.ttl_ns, now);
        if here.is_err() && self.remote.is_some() {
            return self.renew_remote(msg.lease, msg.ttl_ns);
        }
        Box::pin(actix::fut::ready(here))
    }
}
