//! The tenant engine's side of spend budgets (the ledger itself is [`crate::engine::spend`]): checking
//! a call's estimates against the tenant's budgets, the refusal a budget gives, and what a release
//! settles: the actual spend per unit, and the actual cost in cost units, which settles the rate
//! buckets and the daily quota the same way (a cache hit can cost nothing).

use super::*;
use crate::engine::spend::{Budgets, SpendBudget, SpendShort};

impl TenantEngine {
    fn spend_budgets(&self) -> Budgets<'_> {
        Budgets {
            units: &self.policy.cfg.spend.units,
            budgets: &self.policy.spend,
            names: &self.policy.spend_names,
        }
    }

    /// Whether a call's estimates fit every spend budget that applies, and if so what the answer
    /// reports per unit. Nothing is reserved: the reservation is made once every layer has passed.
    pub(super) fn spend_check(
        &mut self,
        subject: &str,
        sp: &ResolvedSpend,
        day: i64,
        now: Nanos,
    ) -> Result<crate::engine::spend::SpendViews, SpendShort> {
        let b = Budgets {
            units: &self.policy.cfg.spend.units,
            budgets: &self.policy.spend,
            names: &self.policy.spend_names,
        };
        self.spend
            .check(b, subject, sp.run.as_deref(), &sp.estimates, day, now)
    }

    /// The refusal of a spend budget: a run's never refills (not retryable, no wait); a daily one
    /// is retryable at the next UTC midnight.
    pub(super) fn spend_shed(&self, _r: &Resolved, short: &SpendShort, wall_ms: i64) -> Shed {
        self.spend_shed_after(short, ms_until_utc_midnight(wall_ms).max(1))
    }

    /// [`Self::spend_shed`], a daily budget's refusal retryable in `daily_wait_ms`.
    pub(super) fn spend_shed_after(&self, short: &SpendShort, daily_wait_ms: u64) -> Shed {
        let run = short.budget == SpendBudget::Run;
        let retry_after_ms = if run { 0 } else { daily_wait_ms };
        let units = &self.policy.cfg.spend.units;
        let message = match units.get(short.unit) {
            Some(u) => refusal::spend_message(u, short, retry_after_ms),
            None => refusal::message(
                Scope::Spend,
                retry_after_ms,
                &RefusalContext {
                    tool: "",
                    upstream: None,
                    shared_upstream: false,
                    cost: 0.0,
                    limit: 0.0,
                    account_wide: short.budget == SpendBudget::TenantDaily,
                },
            ),
        };
        let unit = self
            .spend_budgets()
            .names
            .get(short.unit)
            .cloned()
            .unwrap_or_else(|| Arc::from(""));
        Shed {
            scope: Scope::Spend,
            retry_after_ms,
            retryable: !run,
            reason: refusal::reason(Scope::Spend).to_string(),
            message,
            spend: Some(Box::new(SpendRefusal {
                unit,
                budget: short.budget,
                remaining: short.remaining,
            })),
        }
    }

    /// Settles a released lease's spend: the actual figures, or (`cancelled`) nothing at all.
    pub(super) fn settle_spend(
        &mut self,
        lease: u64,
        spent: &[(CompactString, f64)],
        cancelled: bool,
        now: Nanos,
        wall_ms: i64,
    ) {
        let units = &self.policy.cfg.spend.units;
        let actual: SmallVec<[(usize, f64); 2]> = spent
            .iter()
            .filter_map(|(name, x)| Some((units.iter().position(|u| u.name == *name)?, *x)))
            .collect();
        self.spend
            .settle(lease, &actual, cancelled, utc_day(wall_ms), now, units);
    }

    /// Settles a call's cost: `actual` cost units instead of the `estimated` ones it was admitted
    /// with. The difference goes back to every bucket layer and daily quota the call took from, or
    /// is charged on top (a bucket then refills later; a quota may go past its limit).
    pub(super) fn settle_cost(&mut self, r: &Resolved, actual: f64, now: Nanos, wall_ms: i64) {
        let diff = r.cost - actual;
        if diff == 0.0 || !diff.is_finite() {
            return;
        }
        let plan = self.plan(r);
        let day = utc_day(wall_ms);
        let delta = Resolved {
            cost: diff.abs(),
            ..r.clone()
        };
        let (subject_quota, tenant_quota) = (
            self.policy.limits.subject.daily_quota.is_some(),
            self.policy.limits.tenant.daily_quota.is_some(),
        );
        if diff > 0.0 {
            for lp in &plan {
                self.refund_layer(lp, &delta);
            }
            if subject_quota {
                self.subject_mut(r).extra_mut().quota.refund(day, diff);
            }
            if tenant_quota {
                self.quota.refund(day, diff);
            }
        } else {
            // Charged on top, whatever the bucket holds: the call has already run.
            let returning = std::mem::replace(&mut self.returning, true);
            for lp in &plan {
                self.take_layer(lp, &delta, now, u64::MAX);
            }
            self.returning = returning;
            if subject_quota {
                self.subject_mut(r).extra_mut().quota.add(day, -diff);
            }
            if tenant_quota {
                self.quota.add(day, -diff);
            }
        }
    }

    /// Settled spend per unit name since the last call, for the spend counter.
    pub fn take_settled_spend(&mut self) -> Vec<(Arc<str>, f64)> {
        let settled = self.spend.take_settled();
        settled
            .iter()
            .enumerate()
            .filter(|(_, x)| **x > 0.0)
            .filter_map(|(i, x)| Some((self.policy.spend_names.get(i)?.clone(), *x)))
            .collect()
    }

    /// What each unit's tenant budget has spent and has left today: (unit, spent, daily budget).
    pub fn spend_today(&self, wall_ms: i64) -> Vec<(Arc<str>, f64, Option<f64>)> {
        let spent = self.spend.tenant_spent(utc_day(wall_ms));
        self.policy
            .spend_names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let used = spent.get(i).copied().unwrap_or(0.0);
                let budget = self.policy.spend.get(i).and_then(|b| b.tenant_daily);
                (name.clone(), used, budget)
            })
            .collect()
    }
}
