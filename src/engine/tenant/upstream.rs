//! This tenant's view of each upstream: its per-tenant budget, penalty box, AIMD multiplier and adaptive
//! throttle (or the shared ones of a `shared = true` upstream), what a release or feedback reports about
//! the upstream, and the demand a tenant reports for a shared upstream's fair share.

use super::*;

/// How long a tenant counts its calls to a shared upstream before reporting its demand. A second is
/// long enough that a few calls bunched after a hold do not read as a loop.
pub(super) const DEMAND_WINDOW: Nanos = NS_PER_SEC;

/// This tenant's view of one upstream.
#[derive(Debug)]
pub(super) struct UpstreamState {
    /// The per-tenant budget (upstreams that are not shared).
    pub(super) bucket: Bucket,
    /// This tenant's fair-share sub-bucket of a contended shared upstream.
    pub(super) fair: Bucket,
    /// Per-tenant penalty box (upstreams that are not shared).
    pub(super) penalty_until: Nanos,
    /// The last retry slot handed to a call refused by the penalty box or the adaptive throttle
    /// (see [`stagger`]).
    pub(super) retry_stagger: Nanos,
    /// AIMD multiplier of the configured rate (upstreams that are not shared).
    pub(super) multiplier: f64,
    /// When the last 429 arrived; a cut is forgotten once no 429 came for the adaptive window.
    pub(super) last_429: Nanos,
    /// Adaptive-throttle window (upstreams that are not shared).
    pub(super) sre: SreWindow,
    /// Calls that named this (shared) upstream since `demand_since`, for fair-share demand reports.
    pub(super) demand: u64,
    pub(super) demand_since: Nanos,
    /// The last measured demand, calls (cost units) per second.
    pub(super) demand_rate: f64,
    /// Budget tokens per call to this (shared) upstream, averaged over recent calls: an answer the
    /// upstream served counts this much towards what it takes (see [`crate::engine::probe`]).
    pub(super) tokens_per_call: f64,
    /// This tenant's promise cursor on the shared bucket (see [`crate::engine::bucket::AtomicBucket`]).
    pub(super) shared_promised: Nanos,
}

impl Default for UpstreamState {
    fn default() -> Self {
        UpstreamState {
            bucket: Bucket::default(),
            fair: Bucket::default(),
            penalty_until: 0,
            retry_stagger: 0,
            multiplier: 1.0,
            last_429: 0,
            sre: SreWindow::default(),
            demand: 0,
            demand_since: 0,
            demand_rate: 0.0,
            tokens_per_call: 1.0,
            shared_promised: 0,
        }
    }
}

impl UpstreamState {
    pub(super) fn is_resting(&self, now: Nanos, sre_window: u64) -> bool {
        self.bucket.is_resting(now)
            && self.fair.is_resting(now)
            && self.shared_promised <= now
            && self.penalty_until <= now
            && (self.multiplier >= 1.0
                || now.saturating_sub(self.last_429) > forget_after(sre_window))
            && self.sre.is_idle(now, sre_window)
            && (self.demand == 0 || now.saturating_sub(self.demand_since) > 10 * NS_PER_SEC)
    }
}

impl TenantEngine {
    pub(super) fn upstream_mut(&mut self, name: &Arc<str>) -> &mut UpstreamState {
        self.upstreams.entry(name.clone()).or_default()
    }

    /// Forgets AIMD cuts on the call's upstreams that saw no 429 for the adaptive window: with no recent
    /// evidence the upstream is overloaded, the configured rate applies again. A shared upstream's
    /// rate follows its probe schedule instead, which may move with time alone.
    pub(super) fn settle_cuts(
        &mut self,
        r: &Resolved,
        configs: &[Option<&UpstreamConfig>],
        now: Nanos,
    ) {
        for ((up, _), cfg) in r.upstreams.iter().zip(configs) {
            let Some(cfg) = cfg else {
                continue;
            };
            let (forget, spec) = (forget_after(adaptive_window(cfg)), cfg.bucket);
            if cfg.shared {
                // A shared upstream's cut is not forgotten with time: its probes find the capacity
                // again (see `engine::probe`). A probe that starts or ends moves its rate here.
                if let (Some(s), Some(spec)) = (self.shared.upstream(up), spec) {
                    if let Some((old, new)) = s.tick(now) {
                        s.bucket
                            .rescale(now, &scaled(spec, old), &scaled(spec, new));
                    }
                }
            } else if let Some(u) = self.upstreams.get_mut(up) {
                if u.multiplier < 1.0 && now.saturating_sub(u.last_429) > forget {
                    if let Some(spec) = spec {
                        u.bucket
                            .rescale(now, &scaled(spec, u.multiplier), &scaled(spec, 1.0));
                    }
                    u.multiplier = 1.0;
                }
            }
        }
    }

    /// Counts calls per shared upstream and reports the rate for the fair share every 250 ms.
    pub(super) fn note_demand(
        &mut self,
        r: &Resolved,
        configs: &[Option<&UpstreamConfig>],
        now: Nanos,
    ) {
        for ((up, units), cfg) in r.upstreams.iter().zip(configs) {
            let Some(spec) = cfg.filter(|c| c.shared).and_then(|c| c.bucket) else {
                continue;
            };
            let Some(s) = self.shared.upstream(up) else {
                continue;
            };
            let weight = self.policy.weight;
            let tokens = (r.cost * units).max(1e-9);
            let u = self.upstream_mut(up);
            u.tokens_per_call = 0.9 * u.tokens_per_call + 0.1 * tokens;
            if u.demand == 0 {
                u.demand_since = now;
            }
            u.demand += 1;
            let elapsed = now.saturating_sub(u.demand_since);
            if elapsed >= DEMAND_WINDOW {
                // The window opens at its first call, so n calls span n - 1 intervals.
                let rate = (u.demand - 1) as f64 * tokens / (elapsed as f64 / NS_PER_SEC as f64);
                u.demand = 0;
                // Smoothed, so one bunch of calls does not look like a loop.
                u.demand_rate = if u.demand_rate > 0.0 {
                    0.5 * u.demand_rate + 0.5 * rate
                } else {
                    rate
                };
                s.report_demand(
                    &self.tenant,
                    rate,
                    weight,
                    now,
                    spec.rate.per_sec * s.multiplier(),
                );
            }
        }
    }

    /// Until when this tenant's calls to `upstream` are paused. A shared upstream's penalty pauses
    /// each tenant by as much as it is past its fair share (see [`SharedUpstream::pause_until`]).
    pub(super) fn penalty_until(&self, upstream: &str) -> Nanos {
        if self.is_shared_upstream(Some(upstream)) {
            if let Some(s) = self.shared.upstream(upstream) {
                return s.pause_until(&self.tenant);
            }
        }
        self.upstreams.get(upstream).map_or(0, |u| u.penalty_until)
    }

    /// The longest penalty among the call's upstreams, as (upstream, nanoseconds left).
    pub(super) fn longest_penalty(&self, r: &Resolved, now: Nanos) -> Option<(Arc<str>, u64)> {
        r.upstreams
            .iter()
            .map(|(u, _)| (u, self.penalty_until(u).saturating_sub(now)))
            .filter(|(_, left)| *left > 0)
            .max_by_key(|(_, left)| *left)
            .map(|(u, left)| (u.clone(), left))
    }

    /// Refuses a call to an upstream in the penalty box. The hint is a promise about the whole path:
    /// the slot of the upstream's budget after the penalty ends (after the slots promised to calls
    /// refused earlier), and a concurrency slot then. An upstream without a budget spreads its
    /// refusals along the tenant's refill instead (see [`TenantEngine::upstream_slot`]).
    pub(super) fn penalty(&mut self, r: &Resolved, plan: &[LayerPlan], now: Nanos) -> Option<Shed> {
        let (up, left) = self.longest_penalty(r, now)?;
        let end = now.saturating_add(left);
        let mut promise: Option<Promise> = None;
        for lp in plan {
            if lp.layer == Layer::TenantUpstream && lp.upstream.as_ref() == Some(&up) {
                let p = self.promise_layer(lp, r, now, end);
                promise = Some(promise.map_or(p, |q| later_promise(q, p)));
            }
        }
        let mut wait = match promise {
            Some(Promise::Slot(w)) => w.max(left),
            Some(Promise::Booked(w)) => self.spread_booked(w.max(left)),
            None => {
                let shared = self
                    .shared
                    .upstream(&up)
                    .filter(|_| self.is_shared_upstream(Some(&up)));
                self.upstream_slot(r, &up, shared.as_deref(), now, left) - now
            }
        };
        if let Some((at, _)) = self.slot_promise(r, now, now.saturating_add(wait), false) {
            wait = at - now;
        }
        let mut shed = self.make_shed(r, Some(&up), Scope::UpstreamPenalty, wait);
        if matches!(promise, Some(Promise::Booked(_))) {
            shed.message.push_str(refusal::LONG_WAIT);
        }
        Some(shed)
    }

    /// The hint for a call refused when every slot up to the promise horizon is promised: spread at
    /// random over the horizon that follows `first` (the first slot past it), so that such callers do
    /// not all come back at one instant. It is no promise; the text says the wait is long.
    pub(super) fn spread_booked(&mut self, first: u64) -> u64 {
        first.saturating_add(self.rng.below_or_eq(PROMISE_HORIZON))
    }

    /// Google SRE client-side throttling, per upstream the call spends.
    pub(super) fn adaptive(
        &mut self,
        r: &Resolved,
        configs: &[Option<&UpstreamConfig>],
        now: Nanos,
    ) -> Option<Shed> {
        for ((up, _), cfg) in r.upstreams.iter().zip(configs) {
            let Some(cfg) = cfg else {
                continue;
            };
            let Some(a) = cfg.adaptive else { continue };
            let window = a.window.as_nanos() as u64;
            let shared = if cfg.shared {
                self.shared.upstream(up)
            } else {
                None
            };
            let p = match &shared {
                Some(s) => s.sre_probability(now, window, a.k, a.min_requests),
                None => match self.upstreams.get_mut(up) {
                    Some(u) => u.sre.reject_probability(now, window, a.k, a.min_requests),
                    None => 0.0,
                },
            };
            if p > 0.0 && self.rng.unit() < p {
                match &shared {
                    Some(s) => s.sre_local_reject(now, window),
                    None => self.upstream_mut(up).sre.record_local_reject(now, window),
                }
                // The more the upstream rejects, the longer it takes to recover.
                let wait = adaptive_wait(p);
                let slot = self.upstream_slot(r, up, shared.as_deref(), now, wait);
                let mut shed = self.make_shed(r, Some(up), Scope::Adaptive, slot - now);
                shed.reason = format!(
                    "upstream is rejecting requests (throttling {:.0}% of calls)",
                    p * 100.0
                );
                return Some(shed);
            }
        }
        None
    }

    /// An upstream answer seen outside a lease. Returns the penalty started, if any.
    pub fn feedback(
        &mut self,
        upstream: &Arc<str>,
        status: u16,
        retry_after: Option<Duration>,
        now: Nanos,
    ) -> Option<Duration> {
        self.last_active = now;
        if status == 429 {
            let d = retry_after.unwrap_or(Duration::from_secs(1));
            self.upstream_rate_limited(upstream, d, now);
            Some(d)
        } else {
            let (accepted, healthy) = feedback_answer(status);
            self.upstream_answered(upstream, accepted, healthy, now);
            None
        }
    }

    /// A 429 from `upstream`: penalty until its Retry-After, a multiplicative cut of its budget, a
    /// rejected request for the adaptive throttle, and an immediate refusal of the calls queued for it.
    /// A shared upstream's cut also learns its ceiling, once per penalty: a 429 that arrives while
    /// the penalty an earlier one started still runs answers a call sent before that one, and cuts
    /// nothing more.
    pub(super) fn upstream_rate_limited(&mut self, upstream: &Arc<str>, d: Duration, now: Nanos) {
        let until = now.saturating_add(d.as_nanos() as u64);
        let cfg = self.policy.upstream(upstream).cloned();
        let shared = cfg
            .as_ref()
            .filter(|c| c.shared)
            .and_then(|_| self.shared.upstream(upstream));
        let new_episode = shared.as_ref().is_none_or(|s| s.penalty_until() <= now);
        if let Some(s) = &shared {
            s.penalise(now, until)
        } else {
            let u = self.upstream_mut(upstream);
            u.penalty_until = u.penalty_until.max(until);
        }
        if let Some(cfg) = &cfg {
            if let Some(spec) = cfg.bucket {
                if let Some(s) = &shared {
                    s.note_429(now);
                    if new_episode {
                        let (old, new) =
                            s.aimd_refused(spec.rate.per_sec, &cfg.aimd, &cfg.probe, now);
                        s.bucket
                            .rescale(now, &scaled(spec, old), &scaled(spec, new));
                    }
                } else {
                    let u = self.upstream_mut(upstream);
                    u.last_429 = now;
                    let old = u.multiplier;
                    u.multiplier = aimd_cut(old, &cfg.aimd);
                    let new = u.multiplier;
                    u.bucket
                        .rescale(now, &scaled(spec, old), &scaled(spec, new));
                }
            }
            if let Some(a) = cfg.adaptive {
                let window = a.window.as_nanos() as u64;
                match &shared {
                    Some(s) => s.sre_record(now, window, false),
                    None => self.upstream_mut(upstream).sre.record(now, window, false),
                }
            }
        }
        // Calls queued for this upstream would only be granted into the penalty: refuse them now,
        // cheaply, with the time left on the penalty (which may be longer than this 429's own delay,
        // if another tenant's 429 started it). A zero Retry-After starts no penalty and sheds nothing.
        let left = self.penalty_until(upstream).saturating_sub(now);
        if left > 0 {
            let mut i = 0;
            while i < self.waiters.len() {
                if self.waiters[i]
                    .resolved
                    .upstreams
                    .iter()
                    .any(|(u, _)| u == upstream)
                {
                    if let Some(w) = self.waiters.remove(i) {
                        let plan = self.plan(&w.resolved);
                        let shed = self.make_shed(
                            &w.resolved,
                            Some(upstream),
                            Scope::UpstreamPenalty,
                            left,
                        );
                        let decision = self.refuse(w.resolved, &plan, shed, now);
                        self.pending.push((w.id, decision));
                    }
                } else {
                    i += 1;
                }
            }
        }
    }

    /// A non-429 answer from `upstream`: an accept for the adaptive throttle (unless overloaded) and,
    /// when healthy, an additive step back towards the configured rate.
    pub(super) fn upstream_answered(
        &mut self,
        upstream: &Arc<str>,
        accepted: bool,
        healthy: bool,
        now: Nanos,
    ) {
        let Some(cfg) = self.policy.upstream(upstream).cloned() else {
            return;
        };
        let shared = if cfg.shared {
            self.shared.upstream(upstream)
        } else {
            None
        };
        if let Some(a) = cfg.adaptive {
            let window = a.window.as_nanos() as u64;
            match &shared {
                Some(s) => s.sre_record(now, window, accepted),
                None => self
                    .upstream_mut(upstream)
                    .sre
                    .record(now, window, accepted),
            }
        }
        let Some(spec) = cfg.bucket.filter(|_| healthy) else {
            return;
        };
        match &shared {
            Some(s) => {
                // A healthy answer is a call the upstream served: it counts towards its ceiling.
                let units = self
                    .upstreams
                    .get(upstream)
                    .map_or(1.0, |u| u.tokens_per_call);
                let (old, new) =
                    s.aimd_served(units, spec.rate.per_sec, &cfg.aimd, &cfg.probe, now);
                if new != old {
                    s.bucket
                        .rescale(now, &scaled(spec, old), &scaled(spec, new));
                }
            }
            None => {
                if let Some(u) = self
                    .upstreams
                    .get_mut(upstream)
                    .filter(|u| u.multiplier < 1.0)
                {
                    let old = u.multiplier;
                    u.multiplier = aimd_recover(old, &cfg.aimd);
                    let new = u.multiplier;
                    u.bucket
                        .rescale(now, &scaled(spec, old), &scaled(spec, new));
                }
            }
        }
    }

    pub(super) fn sre_window(&self, upstream: &str) -> u64 {
        self.policy.upstream(upstream).map_or(0, adaptive_window)
    }
}
