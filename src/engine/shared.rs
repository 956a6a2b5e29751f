//! Budgets that span tenants: the global backstop bucket and the buckets and penalty boxes of upstreams
//! marked `shared = true` (one key for the whole upstream, whoever calls it).
//!
//! Every tenant actor checks these on every call, so they are lock-free atomics rather than state behind
//! a message hop: a hop to one actor per decision would put every tenant's calls through a single thread,
//! and the global layer would become the bottleneck it exists to protect against. The global actor owns
//! their lifecycle (it rebuilds the map and rescales the buckets on reload); the hot path only reads the
//! map through an `ArcSwap` and updates buckets with compare-and-swap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use parking_lot::Mutex;

use super::adaptive::{self, SreWindow};
use super::bucket::{AtomicBucket, Gcra};
use super::durable::{valid_multiplier, Instants, UpstreamDurable};
use crate::clock::{Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::Config;

/// Looked up per admission by upstream and tenant name (shares), so with a fast hasher.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// How often fair shares are recomputed from demand reports.
pub const FAIR_SHARE_EVERY: Nanos = 250 * NS_PER_MS;
/// Demand reports older than this are ignored (the tenant went quiet).
const DEMAND_TTL: Nanos = 2 * NS_PER_SEC;

#[derive(Debug, Default)]
struct FairBoard {
    /// tenant -> (calls per second, weight, reported at)
    demands: HashMap<Arc<str>, (f64, f64, Nanos)>,
    computed_at: Option<Nanos>,
}

/// A tenant's part of a contended shared upstream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Calls (cost units) per second.
    pub rate: f64,
    /// The tenant wants more than its share (max-min fairness capped it). A tenant that wants less
    /// gets all it wants and is not limited beyond the shared budget itself.
    pub bottlenecked: bool,
}

/// One shared upstream's state.
#[derive(Debug)]
pub struct SharedUpstream {
    pub bucket: AtomicBucket,
    /// Monotonic instant until which the upstream is in the penalty box (0: not penalised).
    penalty_until: AtomicU64,
    /// The last retry slot handed to a call its penalty box or adaptive throttle refused (see
    /// [`super::bucket::stagger`]).
    pub retry_stagger: AtomicU64,
    /// AIMD multiplier of the configured rate, as f64 bits.
    multiplier: AtomicU64,
    /// When the last 429 arrived.
    last_429: AtomicU64,
    sre: Mutex<SreWindow>,
    fair: Mutex<FairBoard>,
    /// Each tenant's fair share, while the upstream is contended (empty otherwise).
    shares: ArcSwap<HashMap<Arc<str>, Share>>,
}

impl Default for SharedUpstream {
    fn default() -> Self {
        SharedUpstream {
            bucket: AtomicBucket::default(),
            penalty_until: AtomicU64::new(0),
            retry_stagger: AtomicU64::new(0),
            multiplier: AtomicU64::new(1.0f64.to_bits()),
            last_429: AtomicU64::new(0),
            sre: Mutex::new(SreWindow::default()),
            fair: Mutex::new(FairBoard::default()),
            shares: ArcSwap::from_pointee(HashMap::default()),
        }
    }
}

impl SharedUpstream {
    /// The AIMD multiplier of the configured rate (1 = full rate).
    pub fn multiplier(&self) -> f64 {
        f64::from_bits(self.multiplier.load(Ordering::Acquire))
    }

    pub fn last_429(&self) -> Nanos {
        self.last_429.load(Ordering::Acquire)
    }

    pub fn note_429(&self, now: Nanos) {
        self.last_429.fetch_max(now, Ordering::AcqRel);
    }

    /// Applies `f` to the multiplier; returns (old, new).
    pub fn update_multiplier(&self, f: impl Fn(f64) -> f64) -> (f64, f64) {
        let old = self
            .multiplier
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(f(f64::from_bits(b)).to_bits())
            })
            .map(f64::from_bits)
            .unwrap_or(1.0);
        (old, f(old))
    }

    pub fn sre_record(&self, now: Nanos, window_ns: u64, accepted: bool) {
        self.sre.lock().record(now, window_ns, accepted);
    }

    pub fn sre_local_reject(&self, now: Nanos, window_ns: u64) {
        self.sre.lock().record_local_reject(now, window_ns);
    }

    pub fn sre_probability(&self, now: Nanos, window_ns: u64, k: f64, min_requests: u64) -> f64 {
        self.sre
            .lock()
            .reject_probability(now, window_ns, k, min_requests)
    }

    pub fn sre_totals(&self, now: Nanos, window_ns: u64) -> (u64, u64) {
        self.sre.lock().totals(now, window_ns)
    }

    /// A tenant's fair share, when the upstream is contended.
    pub fn share_of(&self, tenant: &str) -> Option<Share> {
        self.shares.load().get(tenant).copied()
    }

    /// Records a tenant's recent demand and, at most every [`FAIR_SHARE_EVERY`], recomputes everyone's
    /// max-min fair share of `capacity` (calls per second).
    pub fn report_demand(
        &self,
        tenant: &Arc<str>,
        rate: f64,
        weight: f64,
        now: Nanos,
        capacity: f64,
    ) {
        let mut board = self.fair.lock();
        board.demands.insert(tenant.clone(), (rate, weight, now));
        if board
            .computed_at
            .is_some_and(|at| now.saturating_sub(at) < FAIR_SHARE_EVERY)
        {
            return;
        }
        board.computed_at = Some(now);
        board
            .demands
            .retain(|_, d| now.saturating_sub(d.2) <= DEMAND_TTL && d.0 > 0.0);
        let names: Vec<Arc<str>> = board.demands.keys().cloned().collect();
        let claims: Vec<(f64, f64)> = names
            .iter()
            .map(|n| (board.demands[n].0, board.demands[n].1))
            .collect();
        let total: f64 = claims.iter().map(|c| c.0).sum();
        let shares = if total <= capacity {
            HashMap::default()
        } else {
            let fair = adaptive::max_min_fair(capacity, &claims);
            names
                .into_iter()
                .zip(claims.iter().zip(fair))
                .map(|(name, (claim, rate))| {
                    (
                        name,
                        Share {
                            rate,
                            bottlenecked: claim.0 > rate * (1.0 + 1e-9),
                        },
                    )
                })
                .collect()
        };
        self.shares.store(Arc::new(shares));
    }

    pub fn penalty_until(&self) -> Nanos {
        self.penalty_until.load(Ordering::Acquire)
    }

    /// Extends the penalty to `until` (a shorter penalty never shortens a longer one).
    pub fn penalise(&self, until: Nanos) {
        self.penalty_until.fetch_max(until, Ordering::AcqRel);
    }
}

/// Cross-tenant budgets.
#[derive(Debug)]
pub struct SharedBudgets {
    pub global: AtomicBucket,
    /// The global buckets of plans that override `[limits.global]`, each shared by the plan's
    /// tenants. Read when a tenant's policy is built, not per call: the policy keeps its bucket.
    plan_globals: Mutex<HashMap<Arc<str>, Arc<AtomicBucket>>>,
    upstreams: ArcSwap<HashMap<Arc<str>, Arc<SharedUpstream>>>,
}

impl SharedBudgets {
    pub fn new(cfg: &Config) -> Self {
        let s = SharedBudgets {
            global: AtomicBucket::default(),
            plan_globals: Mutex::default(),
            upstreams: ArcSwap::from_pointee(HashMap::default()),
        };
        s.rebuild_map(cfg);
        s
    }

    /// The global bucket of `plan` (one that overrides `[limits.global]`), created full on first use.
    pub fn plan_global(&self, plan: &str) -> Arc<AtomicBucket> {
        let mut map = self.plan_globals.lock();
        if let Some(b) = map.get(plan) {
            return b.clone();
        }
        let b = Arc::new(AtomicBucket::default());
        map.insert(Arc::from(plan), b.clone());
        b
    }

    /// The shared state of `upstream`, when it is configured `shared = true`.
    pub fn upstream(&self, upstream: &str) -> Option<Arc<SharedUpstream>> {
        self.upstreams.load().get(upstream).cloned()
    }

    /// Applies a new config: rescales the global bucket and every shared upstream bucket kept, creates the
    /// new ones and drops those no longer shared.
    pub fn reconfigure(&self, old: &Config, new: &Config, now: Nanos) {
        let (og, ng) = (
            Gcra::new(old.limits.global.bucket),
            Gcra::new(new.limits.global.bucket),
        );
        self.global.rescale(now, &og, &ng);
        // A plan's global bucket keeps what it has spent across a change of its limits, and is
        // dropped when the plan no longer overrides [limits.global] (its tenants pass that one again).
        self.plan_globals
            .lock()
            .retain(|plan, b| match new.plan_global(plan) {
                Some(n) => {
                    let o = old.plan_global(plan).unwrap_or(old.limits.global.bucket);
                    b.rescale(now, &Gcra::new(o), &Gcra::new(n));
                    true
                }
                None => false,
            });
        for (name, up) in self.upstreams.load().iter() {
            let o = old.upstreams.get(&**name).and_then(|u| u.bucket);
            let n = new.upstreams.get(&**name).and_then(|u| u.bucket);
            if let (Some(o), Some(n)) = (o, n) {
                let m = up.multiplier();
                let scale = |b: crate::config::BucketSpec| {
                    crate::config::BucketSpec::new(b.rate.per_sec * m, b.burst)
                };
                up.bucket
                    .rescale(now, &Gcra::new(scale(o)), &Gcra::new(scale(n)));
            }
        }
        self.rebuild_map(new);
    }

    fn rebuild_map(&self, cfg: &Config) {
        let current = self.upstreams.load();
        let mut map = HashMap::default();
        for (name, u) in &cfg.upstreams {
            if u.shared {
                let entry = current.get(name.as_str()).cloned().unwrap_or_default();
                map.insert(Arc::from(name.as_str()), entry);
            }
        }
        self.upstreams.store(Arc::new(map));
    }

    /// The penalties, AIMD cuts and throttle windows of the shared upstreams worth keeping across a
    /// restart (see [`super::durable`]), by name.
    pub fn export_durable(&self, cfg: &Config, at: Instants) -> Vec<UpstreamDurable> {
        self.upstream_names()
            .into_iter()
            .filter_map(|(name, u)| {
                let window = cfg
                    .upstreams
                    .get(&*name)?
                    .adaptive
                    .map_or(0, |a| a.window.as_nanos() as u64);
                let (penalty, m, last) = (u.penalty_until(), u.multiplier(), u.last_429());
                let sre = u.sre.lock();
                let throttled = window > 0 && !sre.is_idle(at.now, window);
                (penalty > at.now || m < 1.0 || throttled).then(|| UpstreamDurable {
                    upstream: name.to_string(),
                    penalty_until_ms: (penalty > at.now).then(|| at.to_wall(penalty)),
                    multiplier: m,
                    last_429_ms: (last > 0).then(|| at.to_wall(last)),
                    window: match throttled {
                        true => sre.export(at, window),
                        false => Vec::new(),
                    },
                })
            })
            .collect()
    }

    /// Takes back what [`SharedBudgets::export_durable`] wrote, for the upstreams the config still
    /// shares; a penalty that has ended and slots that left the window are dropped.
    pub fn import_durable(&self, cfg: &Config, kept: &[UpstreamDurable], at: Instants) {
        let map = self.upstreams.load();
        for k in kept {
            let (Some(u), Some(c)) = (map.get(k.upstream.as_str()), cfg.upstreams.get(&k.upstream))
            else {
                continue;
            };
            if let Some(until) = at.penalty(k.penalty_until_ms) {
                u.penalise(until);
            }
            if let Some(m) = valid_multiplier(k.multiplier) {
                u.multiplier.store(m.to_bits(), Ordering::Release);
            }
            if let Some(t) = k.last_429_ms {
                u.note_429(at.to_mono(t));
            }
            if let Some(a) = c.adaptive {
                *u.sre.lock() = SreWindow::import(&k.window, at, a.window.as_nanos() as u64);
            }
        }
    }

    /// Names and state of the shared upstreams, for snapshots.
    pub fn upstream_names(&self) -> Vec<(Arc<str>, Arc<SharedUpstream>)> {
        let mut v: Vec<_> = self
            .upstreams
            .load()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}
