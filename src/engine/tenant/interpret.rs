//! Turning the state's answer into a decision: the refusal of each scope with its retry hint (staggered
//! so refused callers do not come back together), the text the model reads, the layer states the rate
//! limit headers report, and shadow mode's admission carrying the refusal enforce mode would give.

use super::*;

/// How a layer is reported, given its bucket's state.
pub(super) fn layer_state(
    lp: &LayerPlan,
    several_upstreams: bool,
    remaining: u64,
    reset_ns: u64,
) -> LayerState {
    let name = match (&lp.upstream, several_upstreams) {
        (Some(up), true) => std::borrow::Cow::Owned(format!("tenant_upstream:{up}")),
        _ => std::borrow::Cow::Borrowed(lp.layer.as_str()),
    };
    LayerState {
        layer: lp.layer,
        name,
        burst: lp.g.burst,
        window_secs: lp.g.window_secs(),
        remaining,
        reset_ns,
    }
}

impl TenantEngine {
    /// The bucket layers a call would pass and their state now, without deciding it or spending
    /// anything: for the rate-limit headers of a request refused before it was decided.
    pub fn layers_of(&mut self, req: &AdmitRequest, now: Nanos) -> Vec<LayerState> {
        let r = self.resolve(req);
        let plan = self.plan(&r);
        self.layer_states(&plan, &r, now)
    }

    pub(super) fn layer_states(
        &self,
        plan: &[LayerPlan],
        r: &Resolved,
        now: Nanos,
    ) -> Vec<LayerState> {
        let several = several_upstreams(plan);
        plan.iter()
            .map(|lp| {
                let (remaining, reset_ns, _) = self.peek_layer(lp, r, now);
                layer_state(lp, several, remaining, reset_ns)
            })
            .collect()
    }

    /// The refusal of a call whose cost is more than some layer or daily quota can ever hold. Its
    /// text names the largest cost that fits every one of them, not the first one the call
    /// overflows: a model told "the limit is 100" that retries with 99 must not be refused again by
    /// a burst of 30.
    pub(super) fn oversized(&self, r: &Resolved, plan: &[LayerPlan]) -> Option<Shed> {
        let limit = self.oversized_limit(r, plan)?;
        let cx = self.refusal_cx(r, r.upstream.as_deref(), limit);
        Some(Shed {
            scope: Scope::Oversized,
            retry_after_ms: 0,
            retryable: false,
            reason: refusal::reason(Scope::Oversized).to_string(),
            message: refusal::message(Scope::Oversized, 0, &cx),
            spend: None,
        })
    }

    pub(super) fn refusal_cx<'a>(
        &self,
        r: &'a Resolved,
        upstream: Option<&'a str>,
        limit: f64,
    ) -> RefusalContext<'a> {
        RefusalContext {
            tool: &r.tool,
            upstream,
            shared_upstream: self.is_shared_upstream(upstream),
            cost: r.cost,
            limit,
            account_wide: false,
        }
    }

    pub(super) fn make_shed(
        &mut self,
        r: &Resolved,
        upstream: Option<&str>,
        scope: Scope,
        wait_ns: u64,
    ) -> Shed {
        self.shed_by(r, upstream, scope, wait_ns, false)
    }

    /// A refusal by a limit that is the whole account's (`account_wide`) or this agent's: the text
    /// says whose, so the model knows whether its own calls are the cause.
    pub(super) fn shed_by(
        &mut self,
        r: &Resolved,
        upstream: Option<&str>,
        scope: Scope,
        wait_ns: u64,
        account_wide: bool,
    ) -> Shed {
        self.shed_jittered(r, upstream, scope, wait_ns, account_wide, true)
    }

    /// [`Self::shed_by`], with the jitter left out when `jitter` is false: for a hint that is
    /// already one caller's own slot, where a later arrival would push every slot after it.
    pub(super) fn shed_jittered(
        &mut self,
        r: &Resolved,
        upstream: Option<&str>,
        scope: Scope,
        wait_ns: u64,
        account_wide: bool,
        jitter: bool,
    ) -> Shed {
        // A little jitter (up to 5% of the wait, at most 100 ms) keeps callers told the same moment from
        // arriving in the same millisecond; it only ever adds, so nobody is told to come back early.
        // A daily quota resets at one fixed instant for everyone: no jitter there.
        // It never crosses into the next whole second, so the wait in the text and the Retry-After
        // header stays what the limiter (or the upstream) said.
        let jitter = if scope == Scope::DailyQuota || !jitter {
            0
        } else {
            let to_next_second = wait_ns.div_ceil(NS_PER_SEC) * NS_PER_SEC - wait_ns;
            self.rng.below_or_eq(
                (wait_ns / 20)
                    .min(100 * NS_PER_MS)
                    .min(to_next_second.saturating_sub(NS_PER_MS)),
            )
        };
        let retry_after_ms = ceil_ms(wait_ns.saturating_add(jitter)).max(1);
        let cx = RefusalContext {
            account_wide,
            ..self.refusal_cx(r, upstream, 0.0)
        };
        Shed {
            scope,
            retry_after_ms,
            retryable: true,
            reason: refusal::reason(scope).to_string(),
            message: refusal::message(scope, retry_after_ms, &cx),
            spend: None,
        }
    }

    /// The retry slot of a call refused on account of upstream `up` (its penalty box or its adaptive
    /// throttle) that must wait `wait` ns at least: the first call refused is told `now + wait`, each
    /// next one a refill step of the upstream's budget later (of the tenant's, when the upstream has
    /// none), so the calls that wait as told reach the recovering upstream one by one instead of all
    /// at once. The spread covers at most `wait` itself (at least a second) and then starts over.
    pub(super) fn upstream_slot(
        &mut self,
        r: &Resolved,
        up: &Arc<str>,
        shared: Option<&SharedUpstream>,
        now: Nanos,
        wait: u64,
    ) -> Nanos {
        let base = now.saturating_add(wait);
        let step = self.retry_step(r, up, shared);
        let window = stagger_window(wait);
        match shared {
            Some(s) => stagger_atomic(&s.retry_stagger, base, step, window),
            None => stagger(&mut self.upstream_mut(up).retry_stagger, base, step, window),
        }
    }

    /// The time the budget a call refused on account of `up` will spend there takes to refill that
    /// call's tokens:
    /// the upstream's own (at its AIMD-cut rate; `shared` when the upstream is), else the tenant's;
    /// at least 1 ms.
    pub(super) fn retry_step(
        &self,
        r: &Resolved,
        up: &Arc<str>,
        shared: Option<&SharedUpstream>,
    ) -> u64 {
        let units = r
            .upstreams
            .iter()
            .find(|(u, _)| u == up)
            .map_or(1.0, |(_, x)| *x);
        let bucket = self.policy.upstream(up).and_then(|c| c.bucket);
        let rate = match bucket {
            Some(b) => {
                let m = match shared {
                    Some(s) => s.multiplier(),
                    None => self.upstreams.get(up).map_or(1.0, |u| u.multiplier),
                };
                b.rate.per_sec * m
            }
            None => self.policy.limits.tenant.bucket.rate.per_sec,
        };
        let secs = r.cost * units / rate;
        if secs.is_finite() {
            ((secs * NS_PER_SEC as f64) as u64).clamp(NS_PER_MS, PROMISE_HORIZON)
        } else {
            PROMISE_HORIZON
        }
    }

    /// Refuses a call for want of a concurrency slot, promising it the slot expected to free for it
    /// (see [`TenantEngine::slot_promise`]).
    pub(super) fn concurrency_shed(&mut self, r: &Resolved, now: Nanos) -> Shed {
        let (at, subject_binds) = self
            .slot_promise(r, now, now, true)
            .unwrap_or((now.saturating_add(slots::DEFAULT_RUN_NS), false));
        let upstream = r.upstream.clone();
        // The slot is this caller's own, after the ones promised before it: no jitter, which
        // would make it late for the call promised the slot after it.
        self.shed_jittered(
            r,
            upstream.as_deref(),
            Scope::Concurrency,
            at - now,
            !subject_binds,
            false,
        )
    }

    /// Turns a refusal into the decision: a shed in enforce mode; in shadow mode an admission that spends
    /// nothing and carries the refusal enforce mode would have given.
    pub(super) fn refuse(
        &mut self,
        r: Resolved,
        plan: &[LayerPlan],
        shed: Shed,
        now: Nanos,
    ) -> Decision {
        let layers = self.layer_states(plan, &r, now);
        let verdict = match self.policy.cfg.server.mode {
            Mode::Enforce => Verdict::Shed(shed),
            Mode::Shadow => {
                let expires =
                    now.saturating_add(self.policy.cfg.server.lease_ttl.as_nanos() as u64);
                let lease = self
                    .leases
                    .insert(Lease::new(&r, false, None, now, expires));
                self.expiries.push(expires, lease);
                self.next_expiry = self.next_expiry.min(expires);
                Verdict::Admitted(Admitted {
                    lease,
                    hold_ns: 0,
                    queued_ns: 0,
                    mode: Mode::Shadow,
                    would_shed: Some(shed),
                    unchecked: false,
                    spend: None,
                })
            }
        };
        Decision {
            verdict,
            resolved: r,
            layers,
        }
    }
}
