//! Configs that parse but cannot work as meant, found by asking the engine itself.
//!
//! A tool whose configured cost is more than a bucket or daily quota on its path can ever hold is
//! refused as `oversized` on every call, for every tenant on those limits: a config error that no
//! key on its own reveals (the cost sits in `[tools.*]`, the burst it overflows in `[limits.*]`, a
//! plan or an upstream). `admitd check` reports it as a warning. Rather than repeat the engine's
//! layer rules here, each tool's call is put to the engine's own oversized check
//! ([`TenantEngine::never_fits`]), for the default limits and for a tenant of each plan in use.

use std::collections::BTreeMap;
use std::sync::Arc;

use compact_str::CompactString;

use super::refusal::trim_number;
use super::{AdmitRequest, SharedBudgets, TenantEngine};
use crate::config::Config;

/// One tool that can never be admitted with its configured cost.
#[derive(Debug, Clone, PartialEq)]
pub struct NeverFits {
    pub tool: String,
    /// The plan of the tenants it fails for; `None` for tenants on the default limits.
    pub plan: Option<String>,
    pub cost: f64,
    /// The largest cost every bucket and quota on its path holds (what its refusal names).
    pub limit: f64,
}

/// The tools whose configured cost never fits, by tool and plan.
pub fn never_fitting_tools(cfg: &Arc<Config>) -> Vec<NeverFits> {
    // A tenant stands for each plan in use (its first by name), and one named in no `[tenants.*]`
    // for the default limits, which every unnamed tenant gets.
    let mut plans: BTreeMap<&str, &str> = BTreeMap::new();
    let mut tenants: Vec<_> = cfg.tenants.iter().collect();
    tenants.sort_by(|a, b| a.0.cmp(b.0));
    for (name, t) in tenants {
        if let Some(p) = &t.plan {
            plans.entry(p.as_str()).or_insert(name.as_str());
        }
    }
    let mut stand_ins: Vec<(Option<&str>, &str)> = vec![(None, unplanned_name(cfg))];
    stand_ins.extend(plans.into_iter().map(|(p, t)| (Some(p), t)));

    let mut tools: Vec<_> = cfg.tools.keys().collect();
    tools.sort();
    let shared = Arc::new(SharedBudgets::new(cfg));
    let mut found = Vec::new();
    for (plan, tenant) in stand_ins {
        let mut engine = TenantEngine::new(Arc::from(tenant), cfg.clone(), shared.clone(), 1);
        for tool in &tools {
            let req = AdmitRequest {
                subject: CompactString::const_new("check"),
                tool: CompactString::from(tool.as_str()),
                upstream: None,
                cost: None,
                max_wait_ns: 0,
                returning: false,
                spend: None,
            };
            if let Some((cost, limit)) = engine.never_fits(&req) {
                found.push(NeverFits {
                    tool: tool.to_string(),
                    plan: plan.map(str::to_string),
                    cost,
                    limit,
                });
            }
        }
    }
    found
}

impl NeverFits {
    /// The warning `admitd check` prints.
    pub fn warning(&self) -> String {
        let whom = match &self.plan {
            Some(p) => format!("for tenants on plan \"{p}\""),
            None => "for tenants on the default limits".to_string(),
        };
        format!(
            "warning: tools.{} costs {}, more than the {} a bucket or quota on its path can hold: \
             every call to it is refused as oversized {whom}",
            self.tool,
            trim_number(self.cost),
            trim_number(self.limit)
        )
    }
}

/// A tenant name that no `[tenants.*]` entry uses, so the default limits apply to it.
fn unplanned_name(cfg: &Config) -> &'static str {
    ["check", "check-0", "check-1", "check-2"]
        .into_iter()
        .find(|n| !cfg.tenants.contains_key(*n))
        .unwrap_or("check-unplanned-tenant-name")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lint(toml: &str) -> Vec<NeverFits> {
        never_fitting_tools(&Arc::new(Config::parse("test.toml", toml).unwrap()))
    }

    /// The wire contract's own example: get_sales costs 20 and its tool bucket holds 5.
    #[test]
    fn a_tool_costing_more_than_a_bucket_on_its_path_is_found() {
        let found = lint(
            "[tools.get_sales]\ncost = 20\nupstream = \"warehouse\"\nrate = \"5/min\"\nburst = 5\n\
             [upstreams.warehouse]\nrate = \"20/s\"\nburst = 20\n[tools.search]\ncost = 2\n",
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].tool, "get_sales");
        assert_eq!(found[0].plan, None);
        assert_eq!(found[0].cost, 20.0);
        assert_eq!(found[0].limit, 5.0);
        assert_eq!(
            found[0].warning(),
            "warning: tools.get_sales costs 20, more than the 5 a bucket or quota on its path can hold: \
             every call to it is refused as oversized for tenants on the default limits"
        );
    }

    #[test]
    fn plans_are_checked_through_a_tenant_on_them_and_shadow_mode_too() {
        let toml =
            "[server]\nmode = \"shadow\"\n[plans.free.subject]\nrate = \"30/min\"\nburst = 5\n\
                    [plans.unused.subject]\nburst = 1\n[tenants.globex]\nplan = \"free\"\n\
                    [tools.export]\ncost = 8\n";
        let found = lint(toml);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].plan.as_deref(), Some("free"));
        assert_eq!(found[0].limit, 5.0);
        // A daily quota on the path counts as well.
        let found = lint("[limits.subject]\ndaily_quota = 10\n[tools.bulk]\ncost = 11\n");
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!((found[0].cost, found[0].limit), (11.0, 10.0));
    }

    #[test]
    fn tools_that_fit_are_not_reported() {
        assert!(lint("[tools.a]\ncost = 20\n[tools.b]\n").is_empty());
        assert!(lint("").is_empty());
    }
}
