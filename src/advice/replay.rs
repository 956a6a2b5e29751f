//! The replay: a period's calls decided again against a config, through the real engine.
//!
//! Each recorded call is admitted at its recorded time by a fresh [`TenantEngine`] per tenant (and
//! one set of cross-tenant budgets), in shadow mode, so a call that would be refused spends nothing
//! and is counted, exactly as shadow mode predicts enforce mode; a released call is released at its
//! recorded end, freeing its concurrency slot. What the replay cannot know it leaves out: the state
//! the buckets and daily quotas were in when the period began (they start full), and what the
//! upstreams answered (no penalties). Calls whose subject was folded into `__other__` are not
//! replayed: they are many subjects, and one bucket would wrongly hold them all.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use serde::Serialize;

use super::recording::{Period, OTHER};
use crate::clock::{Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::{Config, Mode};
use crate::engine::{
    AdmitRequest, AdmitResult, Outcome, ReleaseInfo, SharedBudgets, TenantEngine, Verdict,
};

/// A subject the replay would have refused, and how often.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WouldShed {
    pub tenant: String,
    pub subject: String,
    pub calls: u64,
    pub shed: u64,
}

/// Subjects listed at most, most refused first.
pub const MAX_LISTED: usize = 100;

/// Where the replay's clock starts: any time after the engine's zero.
const ORIGIN: Nanos = 3600 * NS_PER_SEC;

/// Replays `period` against `cfg`; `wall_end_ms` is the wall-clock time the period ended (daily
/// quotas count by UTC day). Returns every subject with at least one refusal, most refused first.
pub fn replay(period: &Period, cfg: &Config, wall_end_ms: i64) -> Vec<WouldShed> {
    let mut shadow = cfg.clone();
    shadow.server.mode = Mode::Shadow;
    let cfg = Arc::new(shadow);
    let shared = Arc::new(SharedBudgets::new(&cfg));
    let max_wait = u64::try_from(cfg.server.max_wait.as_nanos()).unwrap_or(u64::MAX);
    let other = period
        .names
        .iter()
        .position(|n| n == OTHER)
        .map(|i| i as u32);
    let wall_start = wall_end_ms.saturating_sub(i64::try_from(period.over_ms).unwrap_or(0));

    let mut engines: HashMap<u32, TenantEngine> = HashMap::new();
    let mut counts: HashMap<(u32, u32), (u64, u64)> = HashMap::new();
    // Releases due: (when, tenant, lease).
    let mut due: BinaryHeap<Reverse<(Nanos, u32, u64)>> = BinaryHeap::new();
    let ok = ReleaseInfo {
        outcome: Outcome::Ok,
        upstream_status: None,
        retry_after: None,
        duration_ms: None,
    };
    for c in &period.calls {
        if Some(c.subject()) == other {
            continue;
        }
        let now = ORIGIN + c.at_ms() * NS_PER_MS;
        let wall = |at: Nanos| wall_start + i64::try_from((at - ORIGIN) / NS_PER_MS).unwrap_or(0);
        while let Some(&Reverse((at, tenant, lease))) = due.peek() {
            if at > now {
                break;
            }
            due.pop();
            if let Some(e) = engines.get_mut(&tenant) {
                let _ = e.release(lease, &ok, at, wall(at));
            }
        }
        let engine = engines.entry(c.tenant()).or_insert_with(|| {
            TenantEngine::new(
                Arc::from(period.name(c.tenant())),
                Arc::clone(&cfg),
                Arc::clone(&shared),
                u64::from(c.tenant()),
            )
        });
        let req = AdmitRequest {
            subject: period.name(c.subject()).into(),
            tool: period.name(c.tool()).into(),
            upstream: c.upstream().map(|u| period.name(u).into()),
            cost: Some(c.cost()),
            max_wait_ns: max_wait,
            returning: false,
            spend: None,
        };
        let refused = match engine.admit(&req, now, wall(now)) {
            AdmitResult::Decided(d) => match d.verdict {
                Verdict::Admitted(a) => {
                    if let Some(held) = c.held_ms() {
                        due.push(Reverse((
                            now + u64::from(held) * NS_PER_MS,
                            c.tenant(),
                            a.lease,
                        )));
                    }
                    a.would_shed.is_some()
                }
                Verdict::Shed(_) => true,
            },
            // Shadow mode queues nothing; were it to, the call waited rather than being refused.
            AdmitResult::Queued { .. } => false,
        };
        let n = counts.entry((c.tenant(), c.subject())).or_default();
        n.0 += 1;
        n.1 += u64::from(refused);
    }
    let mut out: Vec<WouldShed> = counts
        .into_iter()
        .filter(|(_, (_, shed))| *shed > 0)
        .map(|((t, s), (calls, shed))| WouldShed {
            tenant: period.name(t).to_string(),
            subject: period.name(s).to_string(),
            calls,
            shed,
        })
        .collect();
    out.sort_by(|a, b| {
        b.shed
            .cmp(&a.shed)
            .then_with(|| a.tenant.cmp(&b.tenant))
            .then_with(|| a.subject.cmp(&b.subject))
    });
    out
}
