//! A tenant engine's kept state in and out (see [`crate::engine::durable`] for what is kept and
//! why). A child of the engine's module so that it reads the engine's own fields, not copies of them.

use std::sync::Arc;

use super::{adaptive_window, QuotaCounter, SubjectState, TenantEngine, UpstreamState};
use crate::clock::{utc_day, Nanos};
use crate::engine::adaptive::SreWindow;
use crate::engine::durable::{
    valid_multiplier, Instants, QuotaUse, SubjectDurable, TenantDurable, UpstreamDurable,
};

impl TenantEngine {
    /// What this tenant would lose in a restart: today's quota use, and the penalties, AIMD cuts and
    /// throttle windows of the upstreams it does not share with other tenants.
    pub fn export_durable(&self, now: Nanos, wall_ms: i64) -> TenantDurable {
        let at = Instants { now, wall_ms };
        let day = utc_day(wall_ms);
        let quota = |q: &QuotaCounter| {
            let used = q.used_on(day);
            (used > 0.0).then_some(QuotaUse { day, used })
        };
        let mut subjects: Vec<SubjectDurable> = self
            .subjects
            .values()
            .filter_map(|s| {
                let q = quota(&s.extra.as_ref()?.quota)?;
                Some(SubjectDurable {
                    subject: s.name.to_string(),
                    quota: q,
                })
            })
            .collect();
        subjects.sort_by(|a, b| a.subject.cmp(&b.subject));
        let mut upstreams: Vec<UpstreamDurable> = self
            .upstreams
            .iter()
            .filter_map(|(name, u)| {
                let cfg = self.policy.upstream(name)?;
                if cfg.shared {
                    return None;
                }
                let window = adaptive_window(cfg);
                let penalised = u.penalty_until > now;
                let cut = u.multiplier < 1.0;
                let sre = window > 0 && !u.sre.is_idle(now, window);
                (penalised || cut || sre).then(|| UpstreamDurable {
                    upstream: name.to_string(),
                    penalty_until_ms: penalised.then(|| at.to_wall(u.penalty_until)),
                    multiplier: u.multiplier,
                    last_429_ms: (u.last_429 > 0).then(|| at.to_wall(u.last_429)),
                    window: if sre {
                        u.sre.export(at, window)
                    } else {
                        Vec::new()
                    },
                })
            })
            .collect();
        upstreams.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        let units = &self.policy.cfg.spend.units;
        TenantDurable {
            tenant: self.tenant.to_string(),
            quota: quota(&self.quota),
            subjects,
            upstreams,
            spend: if units.is_empty() {
                Default::default()
            } else {
                self.spend.export(units, now, day)
            },
        }
    }

    /// Takes back what [`TenantEngine::export_durable`] wrote, on this process's clock: a quota of
    /// another day, a penalty that has ended and window slots that have left the window are
    /// dropped, and so are upstreams the config no longer has or now shares.
    pub fn import_durable(&mut self, d: &TenantDurable, now: Nanos, wall_ms: i64) {
        let at = Instants { now, wall_ms };
        let day = utc_day(wall_ms);
        self.last_active = now;
        self.spend
            .restore(&d.spend, &self.policy.cfg.spend.units, now, day);
        if let Some(used) = d.quota.and_then(|q| q.today(wall_ms)) {
            self.quota = QuotaCounter { day, used };
        }
        for s in &d.subjects {
            let Some(used) = s.quota.today(wall_ms) else {
                continue;
            };
            // Its metric label is decided again at its first call (a folded label under a
            // generation no caps have is looked at again).
            let state = self.subjects.get_or_insert_with(&s.subject, || {
                SubjectState::new(Arc::from(s.subject.as_str()), true, u64::MAX)
            });
            state.extra_mut().quota = QuotaCounter { day, used };
        }
        for u in &d.upstreams {
            let Some(cfg) = self.policy.upstream(&u.upstream).filter(|c| !c.shared) else {
                continue;
            };
            let window = adaptive_window(cfg);
            let restored = UpstreamState {
                penalty_until: at.penalty(u.penalty_until_ms).unwrap_or(0),
                multiplier: valid_multiplier(u.multiplier).unwrap_or(1.0),
                last_429: u.last_429_ms.map_or(0, |t| at.to_mono(t)),
                sre: match window {
                    0 => SreWindow::default(),
                    w => SreWindow::import(&u.window, at, w),
                },
                ..UpstreamState::default()
            };
            let name: Arc<str> = Arc::from(u.upstream.as_str());
            self.upstreams.insert(name, restored);
        }
    }
}
