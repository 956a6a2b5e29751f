//! Budgets that span tenants: the global backstop bucket and the buckets and penalty boxes of upstreams
//! marked `shared = true` (one key for the whole upstream, whoever calls it).
//!
//! Every tenant actor checks these on every call, so they are lock-free atomics rather than state behind
//! a message hop: a hop to one actor per decision would put every tenant's calls through a single thread,
//! and the global layer would become the bottleneck it exists to protect against. The global actor owns
//! their lifecycle (it rebuilds the map and rescales the buckets on reload); the hot path only reads the
//! map through an `ArcSwap` and updates buckets with compare-and-swap.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::bucket::{AtomicBucket, Gcra};
use crate::clock::Nanos;
use crate::config::Config;

/// One shared upstream's state.
#[derive(Debug, Default)]
pub struct SharedUpstream {
    pub bucket: AtomicBucket,
    /// Monotonic instant until which the upstream is in the penalty box (0: not penalised).
    penalty_until: AtomicU64,
}

impl SharedUpstream {
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
    upstreams: ArcSwap<HashMap<Arc<str>, Arc<SharedUpstream>>>,
}

impl SharedBudgets {
    pub fn new(cfg: &Config) -> Self {
        let s = SharedBudgets {
            global: AtomicBucket::default(),
            upstreams: ArcSwap::from_pointee(HashMap::new()),
        };
        s.rebuild_map(cfg);
        s
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
        for (name, up) in self.upstreams.load().iter() {
            let o = old.upstreams.get(&**name).and_then(|u| u.bucket);
            let n = new.upstreams.get(&**name).and_then(|u| u.bucket);
            if let (Some(o), Some(n)) = (o, n) {
                up.bucket.rescale(now, &Gcra::new(o), &Gcra::new(n));
            }
        }
        self.rebuild_map(new);
    }

    fn rebuild_map(&self, cfg: &Config) {
        let current = self.upstreams.load();
        let mut map = HashMap::new();
        for (name, u) in &cfg.upstreams {
            if u.shared {
                let entry = current.get(name.as_str()).cloned().unwrap_or_default();
                map.insert(Arc::from(name.as_str()), entry);
            }
        }
        self.upstreams.store(Arc::new(map));
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
