//! The advice sink: the telemetry actor that keeps the [`Recording`] `GET /v1/advice` reads.
//!
//! It receives the same batches of decision and release events as the metrics actor, on the
//! telemetry thread, so recording adds nothing to an admission but one more `try_send` per batch
//! (a full mailbox drops the batch and counts it, as for every sink). Calls are dated when their
//! batch arrives: within the 10 ms a worker collects events before handing them over, which is
//! well inside the one-second windows the method looks at.

use std::sync::Arc;

use actix::prelude::*;

use super::{Batch, Event};
use crate::advice::recording::{Budget, Period, Seen};
use crate::advice::Recording;
use crate::clock::Clock;
use crate::config::AdviceConfig;

pub struct AdviceActor {
    recording: Recording,
    clock: Arc<dyn Clock>,
}

impl AdviceActor {
    pub fn new(cfg: &AdviceConfig, clock: Arc<dyn Clock>) -> Self {
        AdviceActor {
            recording: Recording::new(Budget::of(cfg), clock.mono()),
            clock,
        }
    }
}

impl Actor for AdviceActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(super::MAILBOX);
    }
}

impl Handler<Batch> for AdviceActor {
    type Result = ();

    fn handle(&mut self, batch: Batch, _: &mut Context<Self>) {
        let now = self.clock.mono();
        for ev in batch.0.iter() {
            match ev {
                Event::Decision(d) => self.recording.record(
                    &Seen {
                        tenant: &d.tenant,
                        subject: &d.subject,
                        tool: &d.tool,
                        upstream: d.upstream.as_deref(),
                        cost: d.cost,
                        lease: (d.kind != super::DecisionKind::Shed).then_some(d.lease),
                    },
                    now,
                ),
                Event::Release(r) => {
                    self.recording
                        .release(&r.tenant, r.lease, r.duration_ms, now);
                }
                Event::Feedback(_) | Event::Tenant(_) => {}
            }
        }
    }
}

impl Handler<super::Settle> for AdviceActor {
    type Result = ();

    fn handle(&mut self, _: super::Settle, _: &mut Context<Self>) {}
}

/// Asks for the calls of the last `over_ms` milliseconds (at most what the recording covers).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Period")]
pub struct TakePeriod {
    pub over_ms: u64,
}

impl Handler<TakePeriod> for AdviceActor {
    type Result = MessageResult<TakePeriod>;

    fn handle(&mut self, m: TakePeriod, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.recording.period(m.over_ms, self.clock.mono()))
    }
}

/// Applies a reloaded `[advice]` budget.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct SetBudget(pub AdviceConfig);

impl Handler<SetBudget> for AdviceActor {
    type Result = ();

    fn handle(&mut self, m: SetBudget, _: &mut Context<Self>) {
        self.recording
            .set_budget(Budget::of(&m.0), self.clock.mono());
    }
}
