//! Deciding a call before any state is touched: resolving its names, cost and upstreams from the
//! config, and the bucket layers it passes with each layer's shape ([`LayerPlan`]), from the tenant's
//! [`Policy`] (one config generation). Also whether a cost can ever fit the path (`oversized`).

use super::*;

/// The upstream a call spends most of (the first of those it spends most of): it names the call in
/// metrics and texts.
pub(super) fn primary_upstream(upstreams: &[(Arc<str>, f64)]) -> Option<Arc<str>> {
    upstreams
        .iter()
        .fold(None::<&(Arc<str>, f64)>, |best, u| match best {
            Some(b) if b.1 >= u.1 => Some(b),
            _ => Some(u),
        })
        .map(|u| u.0.clone())
}

/// One bucket layer as it applies to one call.
#[derive(Clone)]
pub(super) struct LayerPlan {
    pub(super) layer: Layer,
    pub(super) g: Gcra,
    /// Tokens this call takes from the layer per unit of cost (upstream amplification; 1 elsewhere).
    pub(super) units: f64,
    pub(super) upstream: Option<Arc<str>>,
    pub(super) shared: Option<Arc<SharedUpstream>>,
    /// This tenant's fair share of a contended shared upstream.
    pub(super) fair: Option<Gcra>,
    /// The AIMD multiplier applied to the configured rate (upstream layers).
    pub(super) multiplier: f64,
    /// Whether the call may be held on this layer. A tenant that wants more of a shared upstream than
    /// its fair share (or, uncontended, than the whole budget) is refused rather than held: its holds
    /// would reserve the shared budget ahead of the tenants that stay within their share.
    pub(super) hold_ok: bool,
}

impl LayerPlan {
    pub(super) fn simple(layer: Layer, g: Gcra) -> Self {
        LayerPlan {
            layer,
            g,
            units: 1.0,
            upstream: None,
            shared: None,
            fair: None,
            multiplier: 1.0,
            hold_ok: true,
        }
    }

    pub(super) fn same_layer(&self, layer: Layer, upstream: Option<&Arc<str>>) -> bool {
        self.layer == layer && self.upstream.as_ref() == upstream
    }
}

/// How long an AIMD cut is remembered without a new 429: the adaptive window (2 minutes by default).
pub(super) fn forget_after(sre_window: u64) -> u64 {
    if sre_window == 0 {
        120 * NS_PER_SEC
    } else {
        sre_window
    }
}

/// An upstream's adaptive-throttle window in nanoseconds (0 when adaptive throttling is off).
pub(super) fn adaptive_window(cfg: &UpstreamConfig) -> u64 {
    cfg.adaptive.map_or(0, |a| a.window.as_nanos() as u64)
}

/// A budget's shape at an AIMD multiplier.
pub(super) fn scaled(spec: BucketSpec, m: f64) -> Gcra {
    Gcra::new(BucketSpec::new(spec.rate.per_sec * m, spec.burst))
}

/// Whether a plan spends more than one upstream (each upstream layer is then named after its upstream).
pub(super) fn several_upstreams(plan: &[LayerPlan]) -> bool {
    plan.iter()
        .filter(|lp| lp.layer == Layer::TenantUpstream)
        .count()
        > 1
}

/// The tenant's policy, resolved from one config generation.
#[derive(Debug, Clone)]
pub(super) struct Policy {
    pub(super) cfg: Arc<Config>,
    pub(super) limits: TenantLimits,
    pub(super) weight: f64,
    pub(super) subject_g: Gcra,
    pub(super) tenant_g: Gcra,
    pub(super) global_g: Gcra,
    /// The global bucket of the tenant's plan, when the plan overrides `[limits.global]`; else the
    /// tenant passes the shared one.
    pub(super) plan_global: Option<Arc<AtomicBucket>>,
    /// Each spend unit's budgets for this tenant (its plan's applied), by unit index.
    pub(super) spend: Vec<crate::config::SpendBudgets>,
    /// Each spend unit's name, shared by every answer that names it.
    pub(super) spend_names: Vec<Arc<str>>,
}

impl Policy {
    pub(super) fn new(cfg: Arc<Config>, tenant: &str, shared: &SharedBudgets) -> Self {
        let limits = cfg.tenant_limits(tenant);
        let (plan, global) = cfg.tenant_global(tenant);
        Policy {
            subject_g: Gcra::new(limits.subject.bucket),
            tenant_g: Gcra::new(limits.tenant.bucket),
            global_g: Gcra::new(global),
            plan_global: plan.map(|p| shared.plan_global(p)),
            weight: cfg.tenant_weight(tenant),
            spend: cfg
                .spend
                .budgets(cfg.tenants.get(tenant).and_then(|t| t.plan.as_deref())),
            spend_names: cfg
                .spend
                .units
                .iter()
                .map(|u| Arc::from(u.name.as_str()))
                .collect(),
            limits,
            cfg,
        }
    }

    /// The global bucket this tenant's calls pass.
    pub(super) fn global<'a>(&'a self, shared: &'a SharedBudgets) -> &'a AtomicBucket {
        self.plan_global.as_deref().unwrap_or(&shared.global)
    }

    pub(super) fn upstream(&self, name: &str) -> Option<&UpstreamConfig> {
        self.cfg.upstreams.get(name)
    }
}

/// The config of each upstream a call spends, in the order of [`Resolved::upstreams`] (`None` for a
/// name the config does not know). Looked up once per call: the decision's steps each need it.
pub(super) type UpstreamConfigs<'a> = SmallVec<[Option<&'a UpstreamConfig>; 2]>;

pub(super) fn upstream_configs<'a>(cfg: &'a Config, r: &Resolved) -> UpstreamConfigs<'a> {
    r.upstreams
        .iter()
        .map(|(up, _)| cfg.upstreams.get(&**up))
        .collect()
}

/// A call's estimate per unit: its own (`spend` in the request), else its tool's, else the unit's.
/// A unit the config does not know (it changed since the request was checked) is ignored.
fn resolve_spend(cfg: &Config, req: &AdmitRequest) -> Box<ResolvedSpend> {
    let own = req.spend.as_deref();
    let estimates = cfg
        .spend
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| {
            own.and_then(|o| o.estimates.iter().find(|(n, _)| *n == u.name))
                .map(|(_, x)| *x)
                .or_else(|| cfg.spend.tool_estimate(&req.tool, i))
                .unwrap_or(u.estimate)
        })
        .collect();
    let run = own.and_then(|o| o.run.clone());
    Box::new(ResolvedSpend { run, estimates })
}

impl TenantEngine {
    /// Applies tool defaults: upstreams (the request's, else the tool's), then cost.
    pub fn resolve(&mut self, req: &AdmitRequest) -> Resolved {
        let cfg = Arc::clone(&self.policy.cfg);
        let tool = cfg.tools.get(&*req.tool);
        let upstreams: Vec<(Arc<str>, f64)> = match &req.upstream {
            Some(u) => {
                let units = tool
                    .and_then(|t| t.upstreams.iter().find(|(n, _)| **n == **u))
                    .map_or(1.0, |x| x.1);
                vec![(intern(u), units)]
            }
            None => tool.map_or_else(Vec::new, |t| {
                t.upstreams.iter().map(|(n, x)| (intern(n), *x)).collect()
            }),
        };
        let upstream = primary_upstream(&upstreams);
        let cost = req
            .cost
            .or_else(|| tool.and_then(|t| t.cost))
            .unwrap_or(1.0);
        let (subject, subject_label) = self.subject_names(&req.subject);
        // Looked at only when spend units are configured: without them a call carries no spend.
        let spend = (!cfg.spend.is_empty()).then(|| resolve_spend(&cfg, req));
        Resolved {
            subject,
            subject_label,
            tool: intern(&req.tool),
            upstream,
            upstreams,
            cost,
            spend,
        }
    }

    pub(super) fn plan(&self, r: &Resolved) -> Vec<LayerPlan> {
        let configs = upstream_configs(&self.policy.cfg, r);
        self.plan_for(r, &configs)
    }

    /// [`TenantEngine::plan`] with the call's upstream configs already looked up.
    pub(super) fn plan_for(
        &self,
        r: &Resolved,
        configs: &[Option<&UpstreamConfig>],
    ) -> Vec<LayerPlan> {
        let p = &self.policy;
        let mut v = Vec::with_capacity(4 + r.upstreams.len());
        v.push(LayerPlan::simple(Layer::Subject, p.subject_g));
        if let Some(b) = p.cfg.tools.get(&*r.tool).and_then(|t| t.bucket) {
            v.push(LayerPlan::simple(Layer::SubjectTool, Gcra::new(b)));
        }
        v.push(LayerPlan::simple(Layer::Tenant, p.tenant_g));
        for ((up, units), cfg) in r.upstreams.iter().zip(configs) {
            let Some(cfg) = cfg else { continue };
            let Some(spec) = cfg.bucket else { continue };
            let (shared, multiplier) = if cfg.shared {
                match self.shared.upstream(up) {
                    Some(s) => {
                        let m = s.multiplier();
                        (Some(s), m)
                    }
                    None => continue,
                }
            } else {
                (None, self.upstreams.get(up).map_or(1.0, |u| u.multiplier))
            };
            let capacity = spec.rate.per_sec * multiplier;
            // Only a tenant that wants more than its fair share is held to it (and never held on the
            // shared budget); one within its share is limited by the shared budget alone. Before any
            // share is known, a tenant that alone wants twice the whole budget is not held either.
            let share = shared.as_ref().and_then(|s| s.share_of(&self.tenant));
            let demand = self.upstreams.get(up).map_or(0.0, |u| u.demand_rate);
            let hold_ok = match (&shared, share) {
                (None, _) => true,
                (Some(_), Some(share)) => !share.bottlenecked,
                (Some(_), None) => demand <= 2.0 * capacity,
            };
            let fair = share.filter(|s| s.bottlenecked).map(|share| {
                let share = share.rate.max(capacity * 1e-3);
                Gcra::new(BucketSpec::new(
                    share,
                    (spec.burst * share / capacity).clamp(1.0, spec.burst),
                ))
            });
            v.push(LayerPlan {
                layer: Layer::TenantUpstream,
                g: scaled(spec, multiplier),
                units: *units,
                upstream: Some(up.clone()),
                shared,
                fair,
                multiplier,
                hold_ok,
            });
        }
        v.push(LayerPlan::simple(Layer::Global, p.global_g));
        v
    }

    pub(super) fn is_shared_upstream(&self, upstream: Option<&str>) -> bool {
        upstream
            .and_then(|u| self.policy.upstream(u))
            .is_some_and(|u| u.shared)
    }

    /// When the call's cost is more than some layer or quota on its path can ever hold: the largest
    /// cost that fits them all, which its refusal names.
    pub(super) fn oversized_limit(&self, r: &Resolved, plan: &[LayerPlan]) -> Option<f64> {
        let limits = &self.policy.limits;
        let quotas = [limits.subject.daily_quota, limits.tenant.daily_quota];
        let quotas = quotas.into_iter().flatten();
        let too_large = plan.iter().any(|lp| lp.g.oversized(r.cost * lp.units))
            || quotas.clone().any(|q| r.cost > q);
        too_large.then(|| {
            plan.iter()
                .map(|lp| lp.g.burst / lp.units)
                .chain(quotas)
                .fold(f64::INFINITY, f64::min)
        })
    }

    /// For a call that this tenant's config refuses as `oversized` whatever its state: its cost and
    /// the limit its refusal names (`admitd check`'s warning, see [`crate::engine::lint`]). Reads the
    /// config only; nothing is spent or recorded.
    pub fn never_fits(&mut self, req: &AdmitRequest) -> Option<(f64, f64)> {
        let r = self.resolve(req);
        let cfg = Arc::clone(&self.policy.cfg);
        let configs = upstream_configs(&cfg, &r);
        let plan = self.plan_for(&r, &configs);
        self.oversized_limit(&r, &plan).map(|limit| (r.cost, limit))
    }
}
