//! The global actor: owner of the cross-tenant budgets' lifecycle and of config reloads.
//!
//! Reloads go through this one actor so two of them (an HTTP reload and a SIGHUP at once) are applied in
//! order, each rescaling the global and shared-upstream buckets from the config it replaces. It also
//! samples the cross-tenant gauges once a second. It is deliberately *not* on the decision path.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::Shared;
use crate::clock::NS_PER_SEC;
use crate::config::Config;
use crate::engine::bucket::Gcra;
use crate::telemetry::TenantEvent;

pub struct GlobalActor {
    shared: Arc<Shared>,
}

impl GlobalActor {
    pub fn new(shared: Arc<Shared>) -> Self {
        GlobalActor { shared }
    }
}

impl GlobalActor {
    /// Reports the cross-tenant gauges: live tenant actors, global bucket use, shared penalties.
    fn sample(&self) {
        let now = self.shared.clock.mono();
        let cfg = self.shared.config.load();
        let g = Gcra::new(cfg.limits.global.bucket);
        let missing = self.shared.budgets.global.reset_ns(now) as f64 / g.t;
        let shared_rates = self
            .shared
            .budgets
            .upstream_names()
            .into_iter()
            .filter_map(|(name, u)| {
                let c = cfg.upstreams.get(&*name)?;
                let rate = c.bucket?.rate.per_sec * u.multiplier();
                let p = c.adaptive.map_or(0.0, |a| {
                    let (r, acc) = u.sre_totals(now, a.window.as_nanos() as u64);
                    if r < a.min_requests {
                        0.0
                    } else {
                        crate::engine::adaptive::throttle_probability(r, acc, a.k)
                    }
                });
                Some((name, rate, p))
            })
            .collect();
        let shared_penalties = self
            .shared
            .budgets
            .upstream_names()
            .into_iter()
            .filter(|(_, u)| u.penalty_until() > now)
            .map(|(name, u)| (name, (u.penalty_until() - now) as f64 / NS_PER_SEC as f64))
            .collect();
        self.shared.telemetry.tenant_event(TenantEvent::Global {
            tenants: self.shared.tenant_count(),
            global_utilization: (missing / g.burst).clamp(0.0, 1.0),
            shared_penalties,
            shared_rates,
        });
    }
}

impl Actor for GlobalActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Duration::from_secs(1), |act, _| act.sample());
    }
}

/// Swap in a new, already validated config.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Reconfigure(pub Config);

impl Handler<Reconfigure> for GlobalActor {
    type Result = ();

    fn handle(&mut self, msg: Reconfigure, _: &mut Context<Self>) {
        let now = self.shared.clock.mono();
        let old = self.shared.config.load_full();
        self.shared.budgets.reconfigure(&old, &msg.0, now);
        self.shared.telemetry.reconfigure(&msg.0);
        self.shared.config.store(Arc::new(msg.0));
    }
}
