//! What the engine shows of itself: the JSON snapshot of `/v1/tenants/{tenant}`, the telemetry gauges,
//! and whether its state is at rest (so the actor may prune or drop it).

use super::*;

/// The rate gauges of one per-tenant upstream budget.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamGauge {
    pub upstream: Arc<str>,
    pub effective_rate: f64,
    pub configured_rate: f64,
    pub throttle_probability: f64,
}

/// Per-tenant gauge values, sampled by the tenant actor.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TenantGauges {
    pub inflight: u32,
    pub waiting: usize,
    /// Tokens used / burst of the tenant bucket.
    pub tenant_utilization: f64,
    /// The most-used subject bucket of the tenant.
    pub subject_utilization: f64,
    /// The most-used per-tenant upstream bucket.
    pub upstream_utilization: f64,
    /// Seconds of penalty left per upstream (per-tenant penalties only).
    pub penalties: Vec<(Arc<str>, f64)>,
    /// (upstream, effective rate per second, adaptive throttle probability), per-tenant upstreams.
    pub upstream_rates: Vec<UpstreamGauge>,
    pub quota_used: Option<f64>,
    pub quota_limit: Option<f64>,
    /// MCP tasks in flight.
    pub tasks: u64,
    /// Per spend unit: (unit, spent today, the tenant's daily budget).
    pub spend: Vec<(Arc<str>, f64, Option<f64>)>,
    /// Spend settled since the previous report, per unit (for the spend counter).
    pub spend_settled: Vec<(Arc<str>, f64)>,
}

impl TenantGauges {
    /// What the tenant's daily budget of each unit has left today (below zero when overspent), with
    /// that budget; units without a `tenant_daily` budget are skipped. The one place this figure is
    /// worked out: the `admitd_spend_daily_remaining` gauge and the live view's `spend_left` read it.
    pub fn spend_daily_left(&self) -> impl Iterator<Item = (&Arc<str>, f64, f64)> {
        self.spend
            .iter()
            .filter_map(|(unit, spent, budget)| budget.map(|b| (unit, b - spent, b)))
    }
}

/// One spend unit as the tenant snapshot shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SpendSnapshot {
    pub unit: String,
    /// Reserved and settled today (UTC) by the whole tenant.
    pub day_spent: f64,
    pub tenant_daily: Option<f64>,
    /// What the tenant's daily budget has left (below zero when overspent).
    pub day_remaining: Option<f64>,
    pub subject_daily: Option<f64>,
    pub run: Option<f64>,
}

impl SpendSnapshot {
    /// A unit's day as the tenant's snapshot shows it: `spent` today against its `budgets`.
    pub fn of_day(unit: &str, spent: f64, budgets: &crate::config::SpendBudgets) -> Self {
        SpendSnapshot {
            unit: unit.to_string(),
            day_spent: spent,
            tenant_daily: budgets.tenant_daily,
            day_remaining: budgets.tenant_daily.map(|d| d - spent),
            subject_daily: budgets.subject_daily,
            run: budgets.run,
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BucketSnapshot {
    pub layer: &'static str,
    pub key: String,
    /// Whole tokens left now.
    pub tokens: u64,
    pub burst: f64,
    pub rate_per_sec: f64,
    pub reset_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SubjectSnapshot {
    pub subject: String,
    pub inflight: u32,
    pub quota_used: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PenaltySnapshot {
    pub upstream: String,
    pub shared: bool,
    pub retry_after_ms: u64,
}

/// An upstream's adaptive state as this tenant sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct UpstreamSnapshot {
    pub upstream: String,
    pub shared: bool,
    pub published_limit: Option<f64>,
    pub reserved_for_batch: Option<f64>,
    /// The budget's configured (or derived) rate per second.
    pub configured_rate: Option<f64>,
    /// The rate after AIMD cuts.
    pub effective_rate: Option<f64>,
    pub multiplier: f64,
    /// The adaptive throttle's current local refusal probability.
    pub throttle_probability: f64,
    /// Requests and accepts in the adaptive throttle's window.
    pub requests: u64,
    pub accepts: u64,
    /// This tenant's fair share (per second) of a contended shared upstream.
    pub fair_share: Option<f64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct QuotaSnapshot {
    /// Cost units the tenant spent today (UTC), when a tenant daily quota is set.
    pub day_used: f64,
    pub daily_quota: Option<f64>,
    pub subject_daily_quota: Option<f64>,
    pub resets_in_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantSnapshot {
    pub tenant: String,
    pub plan: Option<String>,
    pub mode: &'static str,
    pub inflight: u32,
    pub waiting: usize,
    pub leases: usize,
    pub quota: QuotaSnapshot,
    pub buckets: Vec<BucketSnapshot>,
    pub subjects: Vec<SubjectSnapshot>,
    pub penalties: Vec<PenaltySnapshot>,
    /// Effective rates, adaptive throttling and fair shares per upstream.
    pub upstreams: Vec<UpstreamSnapshot>,
    /// Spend per unit and its budgets (absent without `[spend.*]`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub spend: Vec<SpendSnapshot>,
    /// Agent runs whose spend is remembered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spend_runs: Option<usize>,
}

impl TenantEngine {
    /// Drops per-subject and per-upstream state that is back at its resting value.
    pub fn prune(&mut self, now: Nanos, wall_ms: i64) {
        let day = utc_day(wall_ms);
        let now_s = whole_secs(now);
        self.subjects
            .retain(|s| now_s < s.keep_until_s || !s.is_resting(now, day));
        let windows: HashMap<Arc<str>, u64> = self
            .upstreams
            .keys()
            .map(|k| (k.clone(), self.sre_window(k)))
            .collect();
        self.upstreams
            .retain(|k, u| !u.is_resting(now, windows.get(k).copied().unwrap_or(0)));
        if self.quota.is_resting(day) {
            self.quota = QuotaCounter::default();
        }
        self.spend
            .forget_idle_runs(now, &self.policy.cfg.spend.units);
    }

    /// True when nothing would be lost by dropping this engine.
    pub fn is_at_rest(&self, now: Nanos, wall_ms: i64) -> bool {
        let day = utc_day(wall_ms);
        self.leases.is_empty()
            && self.waiters.is_empty()
            && self.pending.is_empty()
            && self.inflight == 0
            && self.tenant_bucket.is_resting(now)
            && self.global_promised <= now
            && self.quota.is_resting(day)
            && self.spend.is_resting(day)
            && self.subjects.values().all(|s| s.is_resting(now, day))
            && self
                .upstreams
                .iter()
                .all(|(k, u)| u.is_resting(now, self.sre_window(k)))
    }

    pub fn last_active(&self) -> Nanos {
        self.last_active
    }

    pub fn inflight(&self) -> u32 {
        self.inflight
    }

    pub fn subject_count(&self) -> usize {
        self.subjects.len()
    }

    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// How this tenant sees `upstream` now: configured and effective rate, throttle, fair share.
    pub(super) fn upstream_view(&self, name: &Arc<str>, now: Nanos) -> Option<UpstreamSnapshot> {
        let cfg = self.policy.upstream(name)?;
        let window = adaptive_window(cfg);
        let k = cfg.adaptive.map_or(0.0, |a| a.k);
        let (multiplier, (requests, accepts), share) = if cfg.shared {
            let s = self.shared.upstream(name)?;
            let totals = if window > 0 {
                s.sre_totals(now, window)
            } else {
                (0, 0)
            };
            (s.multiplier(), totals, s.share_of(&self.tenant))
        } else {
            let u = self.upstreams.get(name);
            let totals = match u {
                Some(u) if window > 0 => u.sre.clone().totals(now, window),
                _ => (0, 0),
            };
            (u.map_or(1.0, |u| u.multiplier), totals, None)
        };
        let configured = cfg.bucket.map(|b| b.rate.per_sec);
        Some(UpstreamSnapshot {
            upstream: name.to_string(),
            shared: cfg.shared,
            published_limit: cfg.published_limit.map(|r| r.per_sec),
            reserved_for_batch: cfg.reserved_for_batch.map(|r| r.per_sec),
            configured_rate: configured,
            effective_rate: configured.map(|c| c * multiplier),
            multiplier,
            // What the throttle applies now: nothing below its minimum number of requests.
            throttle_probability: if k > 0.0
                && requests >= cfg.adaptive.map_or(0, |a| a.min_requests)
            {
                crate::engine::adaptive::throttle_probability(requests, accepts, k)
            } else {
                0.0
            },
            requests,
            accepts,
            fair_share: share.map(|s| s.rate),
        })
    }

    /// A JSON-ready picture of the tenant's state.
    pub fn snapshot(&self, now: Nanos, wall_ms: i64) -> TenantSnapshot {
        let p = &self.policy;
        let day = utc_day(wall_ms);
        let bucket = |layer: Layer, key: String, g: &Gcra, b: &Bucket| BucketSnapshot {
            layer: layer.as_str(),
            key,
            tokens: b.remaining(g, now),
            burst: g.burst,
            rate_per_sec: NS_PER_SEC as f64 / g.t,
            reset_ms: ceil_ms(b.reset_ns(now)),
        };
        let mut buckets = vec![bucket(
            Layer::Tenant,
            self.tenant.to_string(),
            &p.tenant_g,
            &self.tenant_bucket,
        )];
        let mut subjects: Vec<_> = self.subjects.values().collect();
        subjects.sort_by(|a, b| a.name.cmp(&b.name));
        let mut subject_snaps = Vec::new();
        for s in &subjects {
            let name = &s.name;
            buckets.push(bucket(
                Layer::Subject,
                name.to_string(),
                &p.subject_g,
                &s.bucket,
            ));
            for (tool, b) in s.tools() {
                if let Some(spec) = p.cfg.tools.get(&**tool).and_then(|t| t.bucket) {
                    buckets.push(bucket(
                        Layer::SubjectTool,
                        format!("{name}/{tool}"),
                        &Gcra::new(spec),
                        b,
                    ));
                }
            }
            subject_snaps.push(SubjectSnapshot {
                subject: name.to_string(),
                inflight: s.inflight,
                quota_used: s.quota_used_on(day),
            });
        }
        let mut penalties = Vec::new();
        let mut upstreams = Vec::new();
        let mut ups: Vec<_> = self.upstreams.iter().collect();
        ups.sort_by(|a, b| a.0.cmp(b.0));
        for (name, u) in ups {
            let shared = self.is_shared_upstream(Some(name));
            if let Some(spec) = p.upstream(name).and_then(|x| x.bucket) {
                if !shared {
                    buckets.push(bucket(
                        Layer::TenantUpstream,
                        name.to_string(),
                        &scaled(spec, u.multiplier),
                        &u.bucket,
                    ));
                }
            }
            if u.penalty_until > now && !shared {
                penalties.push(PenaltySnapshot {
                    upstream: name.to_string(),
                    shared: false,
                    retry_after_ms: ceil_ms(u.penalty_until - now),
                });
            }
            if !shared {
                upstreams.extend(self.upstream_view(name, now));
            }
        }
        for (name, s) in self.shared.upstream_names() {
            if s.penalty_until() > now {
                penalties.push(PenaltySnapshot {
                    upstream: name.to_string(),
                    shared: true,
                    retry_after_ms: ceil_ms(s.penalty_until() - now),
                });
            }
            upstreams.extend(self.upstream_view(&name, now));
        }
        TenantSnapshot {
            tenant: self.tenant.to_string(),
            plan: p
                .cfg
                .tenants
                .get(&*self.tenant)
                .and_then(|t| t.plan.clone()),
            mode: p.cfg.server.mode.as_str(),
            inflight: self.inflight,
            waiting: self.waiters.len(),
            leases: self.leases.len(),
            quota: QuotaSnapshot {
                day_used: self.quota.used_on(day),
                daily_quota: p.limits.tenant.daily_quota,
                subject_daily_quota: p.limits.subject.daily_quota,
                resets_in_ms: ms_until_utc_midnight(wall_ms),
            },
            buckets,
            subjects: subject_snaps,
            penalties,
            upstreams,
            spend: self
                .spend_today(wall_ms)
                .into_iter()
                .zip(&p.spend)
                .map(|((unit, spent, _), b)| SpendSnapshot::of_day(&unit, spent, b))
                .collect(),
            spend_runs: (!p.spend.is_empty()).then(|| self.spend.live_runs()),
        }
    }

    /// Gauges for telemetry: in-flight calls, how full each bucket layer is, penalties, quota and the
    /// effective rate and throttle of each per-tenant upstream.
    pub fn gauges(&self, now: Nanos, wall_ms: i64) -> TenantGauges {
        let p = &self.policy;
        let used = |g: &Gcra, b: &Bucket| {
            let missing = b.reset_ns(now) as f64 / g.t;
            (missing / g.burst).clamp(0.0, 1.0)
        };
        let subject = self
            .subjects
            .values()
            .map(|s| used(&p.subject_g, &s.bucket))
            .fold(0.0, f64::max);
        let mut upstream = 0.0f64;
        let mut penalties = Vec::new();
        let mut rates = Vec::new();
        for (name, u) in &self.upstreams {
            if self.is_shared_upstream(Some(name)) {
                continue;
            }
            if let Some(spec) = p.upstream(name).and_then(|c| c.bucket) {
                upstream = upstream.max(used(&scaled(spec, u.multiplier), &u.bucket));
            }
            if u.penalty_until > now {
                penalties.push((
                    name.clone(),
                    (u.penalty_until - now) as f64 / NS_PER_SEC as f64,
                ));
            }
            if let Some(v) = self.upstream_view(name, now) {
                if let (Some(effective_rate), Some(configured_rate)) =
                    (v.effective_rate, v.configured_rate)
                {
                    rates.push(UpstreamGauge {
                        upstream: name.clone(),
                        effective_rate,
                        configured_rate,
                        throttle_probability: v.throttle_probability,
                    });
                }
            }
        }
        let day = utc_day(wall_ms);
        TenantGauges {
            inflight: self.inflight,
            waiting: self.waiters.len(),
            tenant_utilization: used(&p.tenant_g, &self.tenant_bucket),
            subject_utilization: subject,
            upstream_utilization: upstream,
            penalties,
            upstream_rates: rates,
            quota_used: p.limits.tenant.daily_quota.map(|_| self.quota.used_on(day)),
            quota_limit: p.limits.tenant.daily_quota,
            tasks: self.tasks_live(now),
            spend: self.spend_today(wall_ms),
            spend_settled: Vec::new(),
        }
    }

    pub fn has_state(&self, now: Nanos, wall_ms: i64) -> bool {
        !self.is_at_rest(now, wall_ms) || !self.subjects.is_empty()
    }
}
