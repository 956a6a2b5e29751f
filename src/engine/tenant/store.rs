//! The state a decision reads and writes: taking, refunding, promising and peeking the call's tokens on
//! each bucket layer (local, shared-upstream and global), the tenant's and subjects' concurrency slots,
//! the daily quota counters, and the [`Charge`] that lets a held call's caller get everything back.

use super::*;

/// Tokens and quota a call took, kept until its hold is over so a caller that goes away gets them back.
#[derive(Debug, Clone, Default)]
pub(super) struct Charge {
    pub(super) cost: f64,
    /// The bucket layers it took from (with the upstream, for upstream layers). Refunds recompute the
    /// amount from the current rate and skip layers a reload removed, so a refund after a reload gives
    /// back exactly the tokens taken: never another layer's, never more.
    /// Inline: a call takes from a handful of layers, and this is built on every admission.
    pub(super) taken: SmallVec<[(Layer, Option<Arc<str>>); 5]>,
    pub(super) quota_day: i64,
    pub(super) quota_subject: bool,
    pub(super) quota_tenant: bool,
    /// When the call's hold ends; a cancellation after that refunds nothing (the call ran).
    pub(super) hold_until: Nanos,
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct QuotaCounter {
    pub(super) day: i64,
    pub(super) used: f64,
}

impl QuotaCounter {
    pub(super) fn used_on(&self, day: i64) -> f64 {
        if self.day == day {
            self.used
        } else {
            0.0
        }
    }
    pub(super) fn add(&mut self, day: i64, cost: f64) {
        if self.day != day {
            *self = QuotaCounter { day, used: 0.0 };
        }
        self.used += cost;
    }
    pub(super) fn refund(&mut self, day: i64, cost: f64) {
        if self.day == day {
            self.used = (self.used - cost).max(0.0);
        }
    }
    pub(super) fn is_resting(&self, day: i64) -> bool {
        self.used_on(day) <= 0.0
    }
}

impl TenantEngine {
    /// The fair-share sub-bucket applies when the tenant has a share and the call fits it.
    pub(super) fn fair_of(lp: &LayerPlan, tokens: f64) -> Option<Gcra> {
        lp.fair.filter(|f| !f.oversized(tokens))
    }

    /// Takes the call's tokens from one layer. Also returns the layer's state as the answer reports it
    /// (whole tokens left, nanoseconds until full), read from the buckets just taken from: reading it
    /// afterwards would look every bucket up a second time.
    pub(super) fn take_layer(
        &mut self,
        lp: &LayerPlan,
        r: &Resolved,
        now: Nanos,
        max_wait: u64,
    ) -> (Take, u64, u64) {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        let returning = self.returning;
        let local = |b: &mut Bucket, g: &Gcra, max_wait: u64| {
            let t = b.take_as(g, now, inc, max_wait, returning);
            (t, b.remaining(g, now), b.reset_ns(now))
        };
        match lp.layer {
            Layer::Subject => local(&mut self.subject_mut(r).bucket, &lp.g, max_wait),
            Layer::SubjectTool => local(self.subject_mut(r).tool_bucket(&r.tool), &lp.g, max_wait),
            Layer::Tenant => local(&mut self.tenant_bucket, &lp.g, max_wait),
            Layer::TenantUpstream => {
                let name = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                let Some(s) = &lp.shared else {
                    return local(&mut self.upstream_mut(&name).bucket, &lp.g, max_wait);
                };
                // Past its fair share a tenant is refused, never held: a hold would reserve shared
                // tokens ahead of time and make the tenants within their share wait behind it.
                let fair = Self::fair_of(lp, tokens);
                let mut fair_state = None;
                if let Some(f) = fair {
                    let u = self.upstream_mut(&name);
                    match u.fair.take(&f, now, f.increment(tokens), 0) {
                        short @ Take::Short { .. } => return (short, 0, 0),
                        Take::Ok { .. } => {
                            fair_state = Some((u.fair.remaining(&f, now), u.fair.reset_ns(now)));
                        }
                    }
                }
                // Nor is a call held into tokens promised to this tenant's refused callers.
                let cursor = self.upstreams.get(&name).map_or(0, |u| u.shared_promised);
                let in_order = returning || !s.bucket.promises_waiting(cursor, &lp.g, now, 0);
                let max_wait = if lp.hold_ok && in_order { max_wait } else { 0 };
                match s.bucket.take(&lp.g, now, inc, max_wait) {
                    ok @ Take::Ok { .. } => {
                        let (mut remaining, mut reset) =
                            (s.bucket.remaining(&lp.g, now), s.bucket.reset_ns(now));
                        if let Some((r2, t2)) = fair_state {
                            (remaining, reset) = (remaining.min(r2), reset.max(t2));
                        }
                        (ok, remaining, reset)
                    }
                    short => {
                        if let Some(f) = fair {
                            self.upstream_mut(&name).fair.refund(f.increment(tokens));
                        }
                        (short, 0, 0)
                    }
                }
            }
            Layer::Global => {
                let b = self.policy.global(&self.shared);
                let max_wait =
                    if !returning && b.promises_waiting(self.global_promised, &lp.g, now, 0) {
                        0
                    } else {
                        max_wait
                    };
                let t = b.take(&lp.g, now, inc, max_wait);
                (t, b.remaining(&lp.g, now), b.reset_ns(now))
            }
        }
    }

    pub(super) fn refund_layer(&mut self, lp: &LayerPlan, r: &Resolved) {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        match lp.layer {
            Layer::Subject => self.subject_mut(r).bucket.refund(inc),
            Layer::SubjectTool => self.subject_mut(r).tool_bucket(&r.tool).refund(inc),
            Layer::Tenant => self.tenant_bucket.refund(inc),
            Layer::TenantUpstream => {
                let name = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                match &lp.shared {
                    Some(s) => {
                        s.bucket.refund(inc);
                        if let Some(f) = Self::fair_of(lp, tokens) {
                            self.upstream_mut(&name).fair.refund(f.increment(tokens));
                        }
                    }
                    None => self.upstream_mut(&name).bucket.refund(inc),
                }
            }
            Layer::Global => self.policy.global(&self.shared).refund(inc),
        }
    }

    /// Promises a call refused on this layer, that cannot come back before `not_before` (0: at
    /// once), the layer's next slot after those promised earlier.
    pub(super) fn promise_layer(
        &mut self,
        lp: &LayerPlan,
        r: &Resolved,
        now: Nanos,
        not_before: Nanos,
    ) -> Promise {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        let nb = not_before;
        match lp.layer {
            Layer::Subject => self.subject_mut(r).bucket.promise(&lp.g, now, nb, inc),
            Layer::SubjectTool => self
                .subject_mut(r)
                .tool_bucket(&r.tool)
                .promise(&lp.g, now, nb, inc),
            Layer::Tenant => self.tenant_bucket.promise(&lp.g, now, nb, inc),
            Layer::TenantUpstream => {
                let name = lp.upstream.clone().unwrap_or_else(|| Arc::from(""));
                match &lp.shared {
                    Some(s) => {
                        let at = now.max(nb);
                        let fair = match Self::fair_of(lp, tokens) {
                            Some(f) => {
                                let u = self.upstream_mut(&name);
                                if u.fair.peek(&f, at, f.increment(tokens)) > 0 {
                                    u.fair.promise(&f, now, nb, f.increment(tokens))
                                } else {
                                    Promise::Slot(at - now)
                                }
                            }
                            None => Promise::Slot(at - now),
                        };
                        let shared = if s.bucket.peek(&lp.g, at, inc) > 0 {
                            let mut cursor = self.upstream_mut(&name).shared_promised;
                            let p = s.bucket.promise(&mut cursor, &lp.g, now, nb, inc);
                            self.upstream_mut(&name).shared_promised = cursor;
                            p
                        } else {
                            Promise::Slot(at - now)
                        };
                        later_promise(fair, shared)
                    }
                    None => self.upstream_mut(&name).bucket.promise(&lp.g, now, nb, inc),
                }
            }
            Layer::Global => self.policy.global(&self.shared).promise(
                &mut self.global_promised,
                &lp.g,
                now,
                nb,
                inc,
            ),
        }
    }

    /// (remaining whole tokens, ns until full, shortfall of this call) without changing anything.
    pub(super) fn peek_layer(&self, lp: &LayerPlan, r: &Resolved, now: Nanos) -> (u64, u64, u64) {
        let tokens = r.cost * lp.units;
        let inc = lp.g.increment(tokens);
        let local = |g: &Gcra, inc: u64, b: Option<&Bucket>| {
            let b = b.copied().unwrap_or_default();
            (b.remaining(g, now), b.reset_ns(now), b.peek(g, now, inc))
        };
        match lp.layer {
            Layer::Subject => local(&lp.g, inc, self.subjects.get(&r.subject).map(|s| &s.bucket)),
            Layer::SubjectTool => local(
                &lp.g,
                inc,
                self.subjects
                    .get(&r.subject)
                    .and_then(|s| s.tools().iter().find(|(t, _)| *t == r.tool).map(|(_, b)| b)),
            ),
            Layer::Tenant => local(&lp.g, inc, Some(&self.tenant_bucket)),
            Layer::TenantUpstream => {
                let state = lp.upstream.as_ref().and_then(|u| self.upstreams.get(u));
                match &lp.shared {
                    Some(s) => {
                        let mut out = (
                            s.bucket.remaining(&lp.g, now),
                            s.bucket.reset_ns(now),
                            s.bucket.peek(&lp.g, now, inc),
                        );
                        if let Some(f) = Self::fair_of(lp, tokens) {
                            let (r2, t2, sh2) =
                                local(&f, f.increment(tokens), state.map(|u| &u.fair));
                            out = (out.0.min(r2), out.1.max(t2), out.2.max(sh2));
                        }
                        out
                    }
                    None => local(&lp.g, inc, state.map(|u| &u.bucket)),
                }
            }
            Layer::Global => {
                let b = self.policy.global(&self.shared);
                (
                    b.remaining(&lp.g, now),
                    b.reset_ns(now),
                    b.peek(&lp.g, now, inc),
                )
            }
        }
    }

    pub(super) fn slots_free(&self, subject: &Arc<str>) -> bool {
        let l = &self.policy.limits;
        let subj = self.subjects.get(subject).map_or(0, |s| s.inflight);
        l.subject.concurrency.is_none_or(|c| subj < c)
            && l.tenant.concurrency.is_none_or(|c| self.inflight < c)
    }

    pub(super) fn tenant_slot_free(&self) -> bool {
        self.policy
            .limits
            .tenant
            .concurrency
            .is_none_or(|c| self.inflight < c)
    }

    /// [`Self::slots_free`] and [`Self::take_slots`] with one lookup of the subject.
    pub(super) fn take_slots_if_free(&mut self, r: &Resolved) -> bool {
        if !self.tenant_slot_free() {
            return false;
        }
        let cap = self.policy.limits.subject.concurrency;
        let s = self.subject_mut(r);
        if cap.is_some_and(|c| s.inflight >= c) {
            return false;
        }
        s.inflight += 1;
        self.inflight += 1;
        true
    }

    /// For a call that found no free slot: expires the leases past their TTL, if any is, and takes a
    /// slot if that freed one. The tick expires leases once a second; this frees a slot at its
    /// lease's TTL, not up to a second later, and costs nothing while slots are free. Queued calls
    /// come first: the slots freed go to them (their decisions wait in `pending`), and this call gets
    /// one only if any is left.
    pub(super) fn take_expired_slots(&mut self, r: &Resolved, now: Nanos, wall_ms: i64) -> bool {
        if self.next_expiry > now {
            return false;
        }
        let mut expired = std::mem::take(&mut self.expired);
        let granted = self.expire_leases_into(now, wall_ms, &mut expired);
        self.expired = expired;
        self.pending.extend(granted);
        self.take_slots_if_free(r)
    }

    /// Leases expired by admissions since the last call (see [`TenantEngine::take_expired_slots`]).
    pub fn take_expired(&mut self) -> Vec<ExpiredLease> {
        std::mem::take(&mut self.expired)
    }

    pub(super) fn take_slots(&mut self, r: &Resolved) {
        self.subject_mut(r).inflight += 1;
        self.inflight += 1;
    }

    pub(super) fn free_slots(&mut self, subject: &Arc<str>, now: Nanos) {
        if let Some(s) = self.subjects.get_mut(subject) {
            s.inflight = s.inflight.saturating_sub(1);
            s.keep_until_s = whole_secs(now).saturating_add(KEEP_SUBJECT_SECS);
        }
        self.inflight = self.inflight.saturating_sub(1);
    }

    pub(super) fn undo_charge(&mut self, r: &Resolved, plan: &[LayerPlan], charge: &Charge) {
        let r = Resolved {
            cost: charge.cost,
            ..r.clone()
        };
        for lp in plan {
            if charge
                .taken
                .iter()
                .any(|(l, u)| lp.same_layer(*l, u.as_ref()))
            {
                self.refund_layer(lp, &r);
            }
        }
        if charge.quota_subject {
            self.subject_mut(&r)
                .extra_mut()
                .quota
                .refund(charge.quota_day, charge.cost);
        }
        if charge.quota_tenant {
            self.quota.refund(charge.quota_day, charge.cost);
        }
    }
}
