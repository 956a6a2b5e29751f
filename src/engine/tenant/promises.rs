//! The promises behind retry hints that no single bucket makes: a concurrency slot expected to free
//! (see [`super::super::slots`]), and how promises of several layers combine into one hint.

use super::*;

/// Records a slot promise, keeping the promises in time order and at most [`slots::MAX_PROMISES`].
pub(super) fn insert_promise(promises: &mut Vec<SlotPromise>, p: SlotPromise) {
    if promises.len() < slots::MAX_PROMISES {
        let i = promises.partition_point(|q| q.at <= p.at);
        promises.insert(i, p);
    }
}

/// The later of two promises (booked if the later one is).
pub(super) fn later_promise(a: Promise, b: Promise) -> Promise {
    if b.wait() > a.wait() {
        b
    } else {
        a
    }
}

impl TenantEngine {
    /// The concurrency part of a retry hint: when a slot of the subject's and the tenant's
    /// concurrency limits is expected to be free for a call that cannot come back before
    /// `not_before`, recorded as a promise in each. The calendar (see [`super::slots`]) is laid out
    /// only when a limit binds: when its calls in flight and callers promised fill it, or
    /// (`refused`) when the call was just refused for want of a slot. Returns that time and whether
    /// the subject's limit is the one that binds; `None` without concurrency limits.
    pub(super) fn slot_promise(
        &mut self,
        r: &Resolved,
        now: Nanos,
        not_before: Nanos,
        refused: bool,
    ) -> Option<(Nanos, bool)> {
        let limits = &self.policy.limits;
        let (subject_cap, tenant_cap) = (limits.subject.concurrency, limits.tenant.concurrency);
        if subject_cap.is_none() && tenant_cap.is_none() {
            return None;
        }
        let run = self.run_times.estimate(&r.subject, &r.tool);
        let mut at = not_before.max(now);
        let mut subject_binds = false;
        if let Some(cap) = subject_cap {
            let inflight = self.subjects.get(&r.subject).map_or(0, |s| s.inflight);
            let mut promises = match self.subjects.get_mut(&r.subject) {
                Some(s) => std::mem::take(&mut s.extra_mut().slot_promises),
                None => Vec::new(),
            };
            slots::settle(&mut promises, now, false);
            let full = inflight as usize + promises.len() >= cap as usize;
            if (full || (refused && inflight >= cap)) && promises.len() < slots::MAX_PROMISES {
                let ends = self.lease_ends(Some(&r.subject));
                let queued = self.queued_runs(Some(&r.subject));
                let t = slots::next_slot(&ends, cap, &queued, &promises, run, now, at);
                subject_binds = inflight >= cap || t > at;
                at = t;
            }
            if let Some(s) = self.subjects.get_mut(&r.subject) {
                s.extra_mut().slot_promises = promises;
            }
        }
        if let Some(cap) = tenant_cap {
            let mut promises = std::mem::take(&mut self.slot_promises);
            slots::settle(&mut promises, now, false);
            let full = self.inflight as usize + promises.len() >= cap as usize;
            if (full || (refused && !subject_binds)) && promises.len() < slots::MAX_PROMISES {
                let ends = self.lease_ends(None);
                let queued = self.queued_runs(None);
                at = slots::next_slot(&ends, cap, &queued, &promises, run, now, at);
            }
            self.slot_promises = promises;
        }
        let promise = SlotPromise { at, run };
        if subject_cap.is_some() {
            if let Some(s) = self.subjects.get_mut(&r.subject) {
                insert_promise(&mut s.extra_mut().slot_promises, promise);
            }
        }
        if tenant_cap.is_some() {
            insert_promise(&mut self.slot_promises, promise);
        }
        Some((at, subject_binds))
    }

    /// The expected ends of the calls in flight (of `subject`, or of the whole tenant).
    pub(super) fn lease_ends(&self, subject: Option<&Arc<str>>) -> Vec<Nanos> {
        self.leases
            .iter()
            .filter(|(_, l)| l.slots && subject.is_none_or(|s| *s == l.subject))
            .map(|(_, l)| {
                let start = l.charge.as_ref().map_or(l.created, |c| c.hold_until);
                start.saturating_add(self.run_times.estimate(&l.subject, &l.tool))
            })
            .collect()
    }

    /// The expected runs of the calls queued for a slot (of `subject`, or all), in queue order.
    pub(super) fn queued_runs(&self, subject: Option<&Arc<str>>) -> Vec<u64> {
        self.waiters
            .iter()
            .filter(|w| subject.is_none_or(|s| *s == w.resolved.subject))
            .map(|w| {
                self.run_times
                    .estimate(&w.resolved.subject, &w.resolved.tool)
            })
            .collect()
    }

    /// A call took a concurrency slot: if a promised caller was due, this is taken to be it.
    pub(super) fn claim_slot_promise(&mut self, subject: &Arc<str>, now: Nanos) {
        if !self.slot_promises.is_empty() {
            slots::settle(&mut self.slot_promises, now, true);
        }
        if let Some(e) = self
            .subjects
            .get_mut(subject)
            .and_then(|s| s.extra.as_mut())
        {
            if !e.slot_promises.is_empty() {
                slots::settle(&mut e.slot_promises, now, true);
            }
        }
    }
}
