//! The advice recorder: the [`Recording`] `GET /v1/advice` reads, kept by the metrics actor.
//!
//! It reads the batches of decision and release events the metrics actor already receives, on the
//! telemetry thread, in the same pass: recording adds nothing to an admission, and no mailbox,
//! wake-up or actor of its own to the telemetry thread (an actor of its own cost about 2 000
//! instructions per admission at a few hundred a second, mostly in handing it the batches;
//! docs/BENCHMARKS.md). Calls are dated when their batch arrives: within the 10 ms a worker
//! collects events before handing them over, well inside the one-second windows the method looks
//! at.

use std::sync::Arc;

use actix::prelude::*;

use super::metrics::MetricsActor;
use super::{DecisionKind, Event};
use crate::advice::recording::{Budget, Period, Seen};
use crate::advice::Recording;
use crate::clock::Clock;
use crate::config::AdviceConfig;

pub struct Recorder {
    recording: Recording,
    clock: Arc<dyn Clock>,
}

impl Recorder {
    pub fn new(cfg: &AdviceConfig, clock: Arc<dyn Clock>) -> Self {
        Recorder {
            recording: Recording::new(Budget::of(cfg), clock.mono()),
            clock,
        }
    }

    /// Records a batch's decisions and releases.
    pub fn record_batch(&mut self, events: &[Event]) {
        let now = self.clock.mono();
        for ev in events {
            match ev {
                Event::Decision(d) => self.recording.record(
                    &Seen {
                        tenant: &d.tenant,
                        subject: &d.subject,
                        tool: &d.tool,
                        upstream: d.upstream.as_deref(),
                        cost: d.cost,
                        lease: (d.kind != DecisionKind::Shed).then_some(d.lease),
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

/// Asks for the calls of the last `over_ms` milliseconds (at most what the recording covers);
/// `None` when nothing is recorded.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "Option<Period>")]
pub struct TakePeriod {
    pub over_ms: u64,
}

impl Handler<TakePeriod> for MetricsActor {
    type Result = MessageResult<TakePeriod>;

    fn handle(&mut self, m: TakePeriod, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.advice().map(|a| {
            let now = a.clock.mono();
            a.recording.period(m.over_ms, now)
        }))
    }
}

/// Applies a reloaded `[advice]` budget.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct SetBudget(pub AdviceConfig);

impl Handler<SetBudget> for MetricsActor {
    type Result = ();

    fn handle(&mut self, m: SetBudget, _: &mut Context<Self>) {
        if let Some(a) = self.advice() {
            let now = a.clock.mono();
            a.recording.set_budget(Budget::of(&m.0), now);
        }
    }
}
