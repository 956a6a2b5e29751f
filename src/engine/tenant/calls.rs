//! What happens after admission: leases (release, cancellation of a held call with its refund, the
//! check at the end of a hold, expiry at the TTL) and the queue of calls waiting for a slot.

use super::*;

/// A live lease. Kept small: in a slab per tenant, one per call in flight, and when calls are not
/// released (a crashed MCP server), one more per admission until they expire, so every byte of it
/// is written and later read once per call, most often out of cache.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    /// The call, without its primary upstream (derived again from `upstreams` when needed).
    pub(super) subject: Arc<str>,
    pub(super) tool: Arc<str>,
    pub(super) upstreams: Box<[(Arc<str>, f64)]>,
    pub(super) cost: f64,
    /// Holds one subject and one tenant concurrency slot (false for shadow-mode stand-in leases).
    pub(super) slots: bool,
    /// The subject's metric label is `__other__` (past the label caps), not its name. A label is one
    /// of the two, so a flag stands for it, and a lease with its slot's number fits in 96 bytes (see
    /// the `lease_size` test).
    pub(super) label_folded: bool,
    /// Boxed: only held calls keep their charge, and it would double the size of every lease.
    pub(super) charge: Option<Box<Charge>>,
    pub(super) created: Nanos,
    pub(super) expires: Nanos,
}

impl Lease {
    pub(super) fn new(
        r: &Resolved,
        slots: bool,
        charge: Option<Box<Charge>>,
        now: Nanos,
        expires: Nanos,
    ) -> Self {
        Lease {
            subject: r.subject.clone(),
            tool: r.tool.clone(),
            upstreams: r.upstreams.as_slice().into(),
            cost: r.cost,
            slots,
            label_folded: r.label_folded(),
            charge,
            created: now,
            expires,
        }
    }

    /// The subject's metric label when the call was admitted; `labels` are the engine's.
    pub(super) fn subject_label(&self, labels: Option<&SubjectLabels>) -> Arc<str> {
        match (self.label_folded, labels) {
            (true, Some(l)) => l.other().clone(),
            _ => self.subject.clone(),
        }
    }

    /// The call as it was resolved when admitted; `labels` are the engine's.
    pub(super) fn resolved(&self, labels: Option<&SubjectLabels>) -> Resolved {
        let upstreams = self.upstreams.to_vec();
        Resolved {
            subject: self.subject.clone(),
            subject_label: self.subject_label(labels),
            tool: self.tool.clone(),
            upstream: primary_upstream(&upstreams),
            upstreams,
            cost: self.cost,
            spend: None,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Waiter {
    pub(super) id: u64,
    pub(super) resolved: Resolved,
    pub(super) enqueued: Nanos,
    pub(super) deadline: Nanos,
}

impl TenantEngine {
    /// Ends a lease: frees its slot, records how long it was held, and feeds what the upstream said into
    /// the penalty box, the AIMD rate and the adaptive throttle.
    pub fn release(
        &mut self,
        lease: u64,
        info: &ReleaseInfo,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Released, UnknownLease> {
        self.release_settled(lease, info, &Settlement::default(), now, wall_ms)
    }

    /// [`TenantEngine::release`] with what the call actually spent: its spend per unit and its
    /// cost in cost units (see [`Settlement`]).
    pub fn release_settled(
        &mut self,
        lease: u64,
        info: &ReleaseInfo,
        settle: &Settlement,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Released, UnknownLease> {
        self.last_active = now;
        let l = self.leases.remove(lease).ok_or(UnknownLease)?;
        let cancelled = info.outcome == Outcome::Cancelled;
        self.settle_spend(lease, &settle.spent, cancelled, now, wall_ms);
        // A shadow-mode stand-in lease (no slots) took nothing to settle.
        if let (Some(cost), true) = (settle.cost, l.slots) {
            let r = l.resolved(self.labels.as_deref());
            self.settle_cost(&r, cost, now, wall_ms);
        }
        if l.slots {
            self.free_slots(&l.subject, now);
            // What frees a slot is the release: the run the server reports, or the time the slot
            // was really held (the report, plus the round trips), whichever is longer.
            let start = l.charge.as_ref().map_or(l.created, |c| c.hold_until);
            let held = now.saturating_sub(start);
            let reported = info
                .duration_ms
                .map_or(0, |ms| ms.saturating_mul(NS_PER_MS));
            self.run_times
                .record(&l.subject, &l.tool, held.max(reported));
        }
        let mut penalty = None;
        if info.rate_limited() && !l.upstreams.is_empty() {
            let d = info.retry_after.unwrap_or(Duration::from_secs(1));
            for (up, _) in &l.upstreams {
                self.upstream_rate_limited(up, d, now);
            }
            penalty = Some(d);
        } else if info.reports_answer() {
            for (up, _) in &l.upstreams {
                self.upstream_answered(up, info.accepted(), info.healthy(), now);
            }
        }
        let mut granted = std::mem::take(&mut self.pending);
        granted.extend(self.grant_waiting(now, wall_ms));
        Ok(Released {
            upstream: primary_upstream(&l.upstreams),
            subject: l.subject,
            tool: l.tool,
            penalty,
            granted,
        })
    }

    pub(super) fn end_lease(
        &mut self,
        lease: u64,
        refund: bool,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Vec<(u64, Decision)>, UnknownLease> {
        let l = self.leases.remove(lease).ok_or(UnknownLease)?;
        self.settle_spend(lease, &[], refund, now, wall_ms);
        if let Some(charge) = l.charge.as_ref().filter(|_| refund) {
            let r = l.resolved(self.labels.as_deref());
            let plan = self.plan(&r);
            self.undo_charge(&r, &plan, charge);
        }
        if l.slots {
            self.free_slots(&l.subject, now);
        }
        Ok(self.grant_waiting(now, wall_ms))
    }

    /// Gives back everything a held call took, because its caller went away before the hold ended.
    /// Returns the decisions of queued calls that got the freed slot.
    pub fn cancel_lease(
        &mut self,
        lease: u64,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Vec<(u64, Decision)>, UnknownLease> {
        let refund = self
            .leases
            .get(lease)
            .and_then(|l| l.charge.as_ref())
            .is_some_and(|c| now < c.hold_until);
        self.end_lease(lease, refund, now, wall_ms)
    }

    /// Checks a held call once its hold is over: if one of its upstreams went into the penalty box
    /// meanwhile, the call is shed with the upstream's wait (and everything it took is given back)
    /// instead of being sent to discover the 429 itself. `Ok(None)`: go ahead.
    pub fn confirm_hold(
        &mut self,
        lease: u64,
        now: Nanos,
        wall_ms: i64,
    ) -> Result<Option<Decision>, UnknownLease> {
        let l = self.leases.get(lease).ok_or(UnknownLease)?;
        let r = l.resolved(self.labels.as_deref());
        if self.longest_penalty(&r, now).is_none() {
            return Ok(None);
        }
        // Its tokens go back before it is promised a slot, so that they can be part of it.
        let granted = self.end_lease(lease, true, now, wall_ms)?;
        self.pending.extend(granted);
        let plan = self.plan(&r);
        let Some(shed) = self.penalty(&r, &plan, now) else {
            return Ok(None);
        };
        Ok(Some(self.refuse(r, &plan, shed, now)))
    }

    /// Removes a queued call whose caller went away. Returns false when it was not queued (any more).
    pub fn cancel_waiter(&mut self, waiter: u64) -> bool {
        match self.waiters.iter().position(|w| w.id == waiter) {
            Some(i) => {
                self.waiters.remove(i);
                true
            }
            None => false,
        }
    }

    /// Decisions made outside the usual return paths (calls queued for an upstream that a feedback or
    /// a hold check put in the penalty box). The actor collects them after every message.
    pub fn drain_decisions(&mut self) -> Vec<(u64, Decision)> {
        std::mem::take(&mut self.pending)
    }

    /// Hands free slots to queued calls, oldest first, deciding each; drops the ones past their deadline.
    /// Called after every release, and by the actor after a reload that may have raised a limit.
    pub fn grant_waiting(&mut self, now: Nanos, wall_ms: i64) -> Vec<(u64, Decision)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.waiters.len() && self.tenant_slot_free() {
            if self.waiters[i].deadline <= now {
                if let Some(w) = self.waiters.remove(i) {
                    let d = self.waiter_timed_out(w.resolved, now);
                    out.push((w.id, d));
                }
                continue;
            }
            if !self.slots_free(&self.waiters[i].resolved.subject) {
                i += 1;
                continue;
            }
            let Some(w) = self.waiters.remove(i) else {
                break;
            };
            let plan = self.plan(&w.resolved);
            // The release that freed this slot may have started a penalty on the waiter's upstream.
            if let Some(shed) = self.penalty(&w.resolved, &plan, now) {
                let d = self.refuse(w.resolved, &plan, shed, now);
                out.push((w.id, d));
                continue;
            }
            self.take_slots(&w.resolved);
            let d = self.after_slots(
                w.resolved,
                &plan,
                now,
                wall_ms,
                w.deadline - now,
                now - w.enqueued,
            );
            out.push((w.id, d));
        }
        out
    }

    pub(super) fn waiter_timed_out(&mut self, r: Resolved, now: Nanos) -> Decision {
        let plan = self.plan(&r);
        let shed = self.concurrency_shed(&r, now);
        self.refuse(r, &plan, shed, now)
    }

    /// Refuses every queued call whose deadline has passed.
    pub fn expire_waiters(&mut self, now: Nanos) -> Vec<(u64, Decision)> {
        let mut out = Vec::new();
        while let Some(i) = self.waiters.iter().position(|w| w.deadline <= now) {
            if let Some(w) = self.waiters.remove(i) {
                let d = self.waiter_timed_out(w.resolved, now);
                out.push((w.id, d));
            }
        }
        out
    }

    /// The earliest deadline among queued calls.
    pub fn next_waiter_deadline(&self) -> Option<Nanos> {
        self.waiters.iter().map(|w| w.deadline).min()
    }

    /// Whether `lease` is held and past its TTL (expired, though not yet reaped).
    pub fn lease_past_ttl(&self, lease: u64, now: Nanos) -> bool {
        self.leases.get(lease).is_some_and(|l| l.expires <= now)
    }

    /// When the next lease may expire (`None` when no lease is held): [`TenantEngine::expire_leases`]
    /// has nothing to do before then.
    pub fn next_lease_expiry(&self) -> Option<Nanos> {
        (self.next_expiry != Nanos::MAX).then_some(self.next_expiry)
    }

    /// Expires leases past their TTL, freeing their slots. Returns the expired leases' (subject, tool,
    /// upstream) and the decisions of queued calls that got a slot.
    pub fn expire_leases(
        &mut self,
        now: Nanos,
        wall_ms: i64,
    ) -> (Vec<ExpiredLease>, Vec<(u64, Decision)>) {
        let mut expired = Vec::new();
        let granted = self.expire_leases_into(now, wall_ms, &mut expired);
        (expired, granted)
    }

    /// [`TenantEngine::expire_leases`], appending the expired leases to `expired`.
    pub(super) fn expire_leases_into(
        &mut self,
        now: Nanos,
        wall_ms: i64,
        expired: &mut Vec<ExpiredLease>,
    ) -> Vec<(u64, Decision)> {
        let before = expired.len();
        while let Some((at, id)) = self.expiries.peek() {
            if at > now {
                break;
            }
            self.expiries.pop();
            if self.leases.get(id).is_some_and(|l| l.expires == at) {
                if let Some(l) = self.leases.remove(id) {
                    // An expired lease's estimate stands as spent.
                    self.settle_spend(id, &[], false, now, wall_ms);
                    if l.slots {
                        self.free_slots(&l.subject, now);
                        let label = l.subject_label(self.labels.as_deref());
                        expired.push((label, l.tool, primary_upstream(&l.upstreams)));
                    }
                }
            }
        }
        // Leases released early leave stale heap entries behind; rebuild when they dominate.
        if self.expiries.len() > 64 && self.expiries.len() > 4 * self.leases.len() {
            self.expiries
                .rebuild(self.leases.iter().map(|(id, l)| (l.expires, id)));
        }
        self.next_expiry = self.expiries.peek().map_or(Nanos::MAX, |(at, _)| at);
        if expired.len() == before {
            Vec::new()
        } else {
            self.grant_waiting(now, wall_ms)
        }
    }
}
