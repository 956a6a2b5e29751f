//! Budgets that span tenants: the global backstop bucket and the buckets and penalty boxes of upstreams
//! marked `shared = true` (one key for the whole upstream, whoever calls it).
//!
//! Every tenant actor checks these on every call, so they are lock-free atomics rather than state behind
//! a message hop: a hop to one actor per decision would put every tenant's calls through a single thread,
//! and the global layer would become the bottleneck it exists to protect against. The global actor owns
//! their lifecycle (it rebuilds the map and rescales the buckets on reload); the hot path only reads the
//! map through an `ArcSwap` and updates buckets with compare-and-swap.
//!
//! A shared upstream's penalty box is one, but not every tenant sits in it for as long. While the
//! upstream is contended, a 429 pauses each tenant in proportion to how far past its fair share it
//! is ([`SharedUpstream::pause_until`]): a loop far past its share waits out nearly all of the
//! Retry-After, a tenant within its share not at all. While it is not contended every caller is over
//! what the upstream takes, and every one waits it all out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use parking_lot::Mutex;

use super::adaptive::{self, ServedMeter, SreWindow};
use super::bucket::{AtomicBucket, Gcra};
use super::durable::{valid_multiplier, Instants, UpstreamDurable};
use super::probe::Probe;
use crate::clock::{Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::{Aimd, Config, Probing};

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
    /// What the tenant asked for, calls (cost units) per second.
    pub demand: f64,
}

impl Share {
    /// The part of the tenant's demand past its share, 0 to 1 (0 within its share): how much of a
    /// penalty it waits out.
    pub fn excess(&self) -> f64 {
        if !self.bottlenecked || self.demand <= 0.0 {
            return 0.0;
        }
        ((self.demand - self.rate) / self.demand).clamp(0.0, 1.0)
    }
}

/// What a shared upstream's answers taught: its probe schedule and what it served lately.
#[derive(Debug, Default)]
struct Learned {
    probe: Probe,
    served: ServedMeter,
}

/// One shared upstream's state.
#[derive(Debug)]
pub struct SharedUpstream {
    pub bucket: AtomicBucket,
    /// Monotonic instant until which the upstream is in the penalty box (0: not penalised).
    penalty_until: AtomicU64,
    /// When the 429 that set `penalty_until` arrived: a tenant's pause is its part of the span.
    penalty_from: AtomicU64,
    /// The fair shares when that 429 arrived: a tenant's part of the penalty is fixed then, so the
    /// retry hint it is given holds however the shares move meanwhile.
    penalty_shares: ArcSwap<HashMap<Arc<str>, Share>>,
    /// The last retry slot handed to a call its penalty box or adaptive throttle refused (see
    /// [`super::bucket::stagger`]).
    pub retry_stagger: AtomicU64,
    /// AIMD multiplier of the configured rate, as f64 bits.
    multiplier: AtomicU64,
    /// When the last 429 arrived.
    last_429: AtomicU64,
    /// The ceiling the 429s taught, its probes, and what the upstream served; every change of the
    /// multiplier is made under this lock, so a cut and a recovery never interleave.
    learned: Mutex<Learned>,
    /// When the multiplier next changes with time alone (a probe starts or ends): until then an
    /// admission reads the multiplier without taking the lock.
    next_change: AtomicU64,
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
            penalty_from: AtomicU64::new(0),
            penalty_shares: ArcSwap::from_pointee(HashMap::default()),
            retry_stagger: AtomicU64::new(0),
            multiplier: AtomicU64::new(1.0f64.to_bits()),
            last_429: AtomicU64::new(0),
            learned: Mutex::new(Learned::default()),
            next_change: AtomicU64::new(Nanos::MAX),
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

    /// Applies `f` to what was learned, under the lock, and puts the multiplier in force at `now`
    /// in place; returns (old, new).
    fn move_multiplier(&self, now: Nanos, f: impl FnOnce(&mut Learned)) -> (f64, f64) {
        let mut learned = self.learned.lock();
        let old = self.multiplier();
        f(&mut learned);
        let new = learned.probe.multiplier(now);
        self.multiplier.store(new.to_bits(), Ordering::Release);
        self.next_change
            .store(learned.probe.next_change(now), Ordering::Release);
        (old, new)
    }

    /// A 429 (a budget configured at `configured` per second): what the upstream served over the
    /// last seconds is its ceiling, or a probe above the ceiling failed (see [`Probe::refused`]).
    /// Returns (old, new) multiplier. A 429 during a running penalty answers a call sent before it
    /// started, and tells nothing new: the caller does not report it.
    pub fn aimd_refused(&self, configured: f64, a: &Aimd, p: &Probing, now: Nanos) -> (f64, f64) {
        self.move_multiplier(now, |l| {
            let served = l
                .served
                .rate(now)
                .filter(|_| configured > 0.0)
                .map(|r| r / configured);
            l.probe.refused(now, served, a, p);
        })
    }

    /// A healthy answer worth `units` of a budget configured at `configured` per second: counted as
    /// served, towards a running probe, and as a step back towards the hold (see
    /// [`Probe::served`]). Returns (old, new).
    pub fn aimd_served(
        &self,
        units: f64,
        configured: f64,
        a: &Aimd,
        p: &Probing,
        now: Nanos,
    ) -> (f64, f64) {
        self.move_multiplier(now, |l| {
            l.served.record(now, units);
            if configured > 0.0 {
                l.probe.served(now, units / configured, a, p);
            }
        })
    }

    /// The multiplier at `now`, when a probe started or ended since it was last put in place:
    /// (old, new), else `None`.
    pub fn tick(&self, now: Nanos) -> Option<(f64, f64)> {
        if now < self.next_change.load(Ordering::Acquire) {
            return None;
        }
        let (old, new) = self.move_multiplier(now, |_| {});
        (old != new).then_some((old, new))
    }

    /// The ceiling learned from the 429s, as a multiplier of the configured rate (1: none).
    pub fn ceiling(&self) -> f64 {
        self.learned.lock().probe.ceiling
    }

    /// The probe schedule as it stands (for tests and snapshots).
    pub fn probe(&self) -> Probe {
        self.learned.lock().probe.clone()
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
                            demand: claim.0,
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

    /// Extends the penalty to `until`, for a 429 that arrived at `now` (a shorter penalty never
    /// shortens a longer one).
    pub fn penalise(&self, now: Nanos, until: Nanos) {
        if self.penalty_until.fetch_max(until, Ordering::AcqRel) < until {
            self.penalty_from.store(now.min(until), Ordering::Release);
            self.penalty_shares.store(self.shares.load_full());
        }
    }

    /// Until when `tenant` is paused by the penalty, from the shares when the 429 that set it
    /// arrived. Contended, a tenant waits out its part of the penalty past its share
    /// ([`Share::excess`]): one within its share, or one that asked for too little to be counted
    /// yet, goes on. Not contended, the tenants together asked for no more than the budget and still
    /// got a 429: each is over what the upstream takes, and waits it all out.
    pub fn pause_until(&self, tenant: &str) -> Nanos {
        let until = self.penalty_until();
        if until == 0 {
            return 0;
        }
        let shares = self.penalty_shares.load();
        if shares.is_empty() {
            return until;
        }
        let Some(share) = shares.get(tenant) else {
            return 0;
        };
        let from = self.penalty_from.load(Ordering::Acquire).min(until);
        from + ((until - from) as f64 * share.excess()).round() as u64
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
                    window: if throttled {
                        sre.export(at, window)
                    } else {
                        Vec::new()
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
                u.penalise(at.now, until);
            }
            if let Some(m) = valid_multiplier(k.multiplier) {
                u.move_multiplier(at.now, |l| l.probe = Probe::holding(m, at.now, &c.probe));
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
