//! The actor layer: where tenants live and how calls reach them.
//!
//! [`Shared`] is the daemon's state that every part reads: the current config (swapped atomically on
//! reload), the cross-tenant budgets, the clock and the telemetry handle. It also holds the tenant
//! registry: a sharded map from tenant name to the address of its [`TenantActor`], created on first use
//! on one of a fixed set of arbiters (chosen by hashing the tenant name) and removed by the actor itself
//! when it goes idle.
//!
//! The [`GlobalActor`] owns the global and shared-upstream budgets' lifecycle: it applies reloads to
//! them and reports their gauges. Decisions do not hop through it: those budgets are atomics every
//! tenant actor updates directly (see [`crate::engine::shared`] for why).

pub mod global;
pub mod tenant;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix::ArbiterHandle;
use arc_swap::ArcSwap;
use compact_str::CompactString;
use parking_lot::RwLock;

pub use global::GlobalActor;
pub use tenant::{
    Admit, AdmitReply, CancelLease, CancelWaiter, ConfirmHold, Feedback, Layers, Release, Snapshot,
    TenantActor, Tick, TICK,
};

use crate::clock::{Clock, Nanos};
use crate::config::Config;
use crate::engine::AdmitRequest;
use crate::engine::SharedBudgets;
use crate::telemetry::Telemetry;

/// Registry shards. Each holds four of the groups the tenant actors are ticked in ([`TICK_SLOTS`]).
const SHARDS: usize = 64;

/// Into how many groups the tenant actors of an arbiter are split for ticking: four per registry
/// shard, so that each tick (every [`TICK`] / `TICK_SLOTS`, 3.9 ms) is short. A tick expires the
/// leases of its tenants, and a server that stops releasing expires every lease it holds: with 64
/// groups, at 20 000 admissions/s, one group's tick held the worker for a few hundred microseconds.
/// A multiple of [`SHARDS`], so that a slot lies within one shard.
pub const TICK_SLOTS: u64 = 4 * SHARDS as u64;

/// How long an admission may wait in a tenant actor's mailbox before it is answered 503 instead of
/// decided (see [`AdmitReply::Late`]). There is no timer per request: a timer cost a registration and a
/// removal in the runtime's timer wheel on every call, and with the actor on the caller's own thread it
/// could only fire when the mailbox was that far behind, which the actor sees for itself.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(10);

/// A running tenant actor, as the registry knows it.
struct Entry {
    /// Tells this actor from a later one of the same tenant (see [`Shared::registry_remove`]).
    generation: u64,
    /// The arbiter it lives on.
    arbiter: usize,
    /// Its group for ticking ([`Shared::tick_slot`]), kept so that ticking does not hash names.
    tick_slot: u64,
    addr: Addr<TenantActor>,
}
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// State every part of the daemon shares. Cheap to reach through an `Arc`.
pub struct Shared {
    pub config: ArcSwap<Config>,
    pub budgets: Arc<SharedBudgets>,
    pub clock: Arc<dyn Clock>,
    pub telemetry: Telemetry,
    /// Per-process random seed (lease numbers, jitter).
    pub seed: u64,
    arbiters: Vec<ArbiterHandle>,
    /// Keyed by the tenant name stored inline (up to 24 bytes), so a lookup compares it without a
    /// further cache miss.
    shards: Vec<RwLock<HashMap<CompactString, Entry>>>,
    next_generation: AtomicU64,
}

/// Why a tenant actor could not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskError {
    /// The actor is too far behind to answer in time (overload); the call should be retried.
    Timeout,
    /// The actor kept stopping under us; should not happen more than once in a row.
    Unavailable,
}

impl Shared {
    pub fn new(
        config: Config,
        clock: Arc<dyn Clock>,
        telemetry: Telemetry,
        arbiters: Vec<ArbiterHandle>,
    ) -> Arc<Self> {
        assert!(!arbiters.is_empty(), "at least one arbiter");
        let budgets = Arc::new(SharedBudgets::new(&config));
        let seed = {
            let mut h = DefaultHasher::new();
            std::time::SystemTime::now().hash(&mut h);
            std::process::id().hash(&mut h);
            h.finish()
        };
        Arc::new(Shared {
            config: ArcSwap::from_pointee(config),
            budgets,
            clock,
            telemetry,
            seed,
            arbiters,
            shards: (0..SHARDS)
                .map(|_| RwLock::new(HashMap::default()))
                .collect(),
            next_generation: AtomicU64::new(1),
        })
    }

    /// Places a tenant: its registry shard (low bits) and its arbiter (high bits). Not keyed: the
    /// placement only spreads load, it guards nothing.
    fn hash(tenant: &str) -> u64 {
        use std::hash::BuildHasher;
        foldhash::fast::FixedState::with_seed(0x5eed).hash_one(tenant)
    }

    fn shard(&self, tenant: &str) -> &RwLock<HashMap<CompactString, Entry>> {
        &self.shards[(Self::hash(tenant) as usize) % SHARDS]
    }

    /// The tenant's actor, started on its arbiter if it is not running: its generation and address.
    pub fn tenant_or_start(self: &Arc<Self>, tenant: &str) -> (u64, Addr<TenantActor>) {
        if let Some(e) = self.shard(tenant).read().get(tenant) {
            return (e.generation, e.addr.clone());
        }
        let mut map = self.shard(tenant).write();
        if let Some(e) = map.get(tenant) {
            return (e.generation, e.addr.clone());
        }
        let name: Arc<str> = Arc::from(tenant);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let index = (Self::hash(tenant) >> 32) as usize % self.arbiters.len();
        let arbiter = &self.arbiters[index];
        let shared = Arc::clone(self);
        let n = name.clone();
        let addr = TenantActor::start_in_arbiter(arbiter, move |_| {
            TenantActor::new(n, shared, generation)
        });
        map.insert(
            CompactString::from(tenant),
            Entry {
                generation,
                arbiter: index,
                tick_slot: Self::tick_slot(tenant),
                addr: addr.clone(),
            },
        );
        (generation, addr)
    }

    /// Removes a tenant's entry if it is still the given generation of actor.
    pub(crate) fn registry_remove(&self, tenant: &str, generation: u64) {
        let mut map = self.shard(tenant).write();
        if map.get(tenant).is_some_and(|e| e.generation == generation) {
            map.remove(tenant);
        }
    }

    /// Sends [`Tick`] to the tenant actors living on arbiter `index` whose tick slot is `slot`
    /// (modulo [`TICK_SLOTS`]). Each arbiter runs a ticker that calls this every [`TICK`] /
    /// [`TICK_SLOTS`] with the next slot, so every actor ticks once per [`TICK`], the ticks of many
    /// tenants are spread over the second instead of stalling calls all at once, and each call reads
    /// one registry shard only (a slot lies within one), so ticking costs the same per tenant however
    /// many tenants there are.
    pub fn tick_arbiter(&self, index: usize, slot: u64) {
        let slot = slot % TICK_SLOTS;
        let shard = &self.shards[(slot % SHARDS as u64) as usize];
        for e in shard.read().values() {
            if e.arbiter == index && e.tick_slot == slot {
                e.addr.do_send(Tick);
            }
        }
    }

    /// The tick slot of a tenant's actor: the low bits of its placement hash, whose lowest bits
    /// (modulo [`SHARDS`]) are its registry shard.
    pub(crate) fn tick_slot(tenant: &str) -> u64 {
        Self::hash(tenant) % TICK_SLOTS
    }

    /// Number of live tenant actors.
    pub fn tenant_count(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// Hands the tenant's actor (started if needed) to `post`; returns the actor's generation and what
    /// `post` returned. A running actor is reached while the registry is read, so its address is not
    /// cloned.
    fn with_actor<R>(
        self: &Arc<Self>,
        tenant: &str,
        post: impl FnOnce(&Addr<TenantActor>) -> R,
    ) -> (u64, R) {
        let map = self.shard(tenant).read();
        match map.get(tenant) {
            Some(e) => (e.generation, post(&e.addr)),
            None => {
                drop(map);
                let (generation, addr) = self.tenant_or_start(tenant);
                (generation, post(&addr))
            }
        }
    }

    /// Asks the tenant's actor (starting it if needed) to admit a call, retrying on an actor that
    /// stopped before it answered, as [`Shared::ask`] does.
    pub async fn admit(
        self: &Arc<Self>,
        tenant: &str,
        req: AdmitRequest,
        sent: Nanos,
    ) -> Result<AdmitReply, AskError> {
        for _ in 0..4 {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let msg = Admit {
                req: req.clone(),
                sent,
                reply,
            };
            let (generation, ()) = self.with_actor(tenant, |a| a.do_send(msg));
            match answer.await {
                Ok(r) => return Ok(r),
                // The actor stopped with the call in its mailbox; make sure its entry is gone.
                Err(_) => self.registry_remove(tenant, generation),
            }
        }
        Err(AskError::Unavailable)
    }

    /// Sends `msg` to the tenant's actor (starting it if needed), retrying on an actor that stopped
    /// between lookup and delivery: it removed itself from the registry first, so the retry starts a
    /// fresh one. State is never lost this way because an actor only stops when its state is at rest.
    pub async fn ask<M>(self: &Arc<Self>, tenant: &str, msg: M) -> Result<M::Result, AskError>
    where
        M: Message + Send + Clone + 'static,
        M::Result: Send,
        TenantActor: Handler<M>,
    {
        for _ in 0..4 {
            let (generation, answer) = self.with_actor(tenant, |a| a.send(msg.clone()));
            match answer.await {
                Ok(r) => return Ok(r),
                Err(MailboxError::Timeout) => return Err(AskError::Timeout),
                // The actor stopped; make sure its stale entry is gone before retrying.
                Err(MailboxError::Closed) => self.registry_remove(tenant, generation),
            }
        }
        Err(AskError::Unavailable)
    }

    /// Like [`Shared::ask`] but only to a running actor: `Ok(None)` when the tenant has none.
    pub async fn ask_existing<M>(&self, tenant: &str, msg: M) -> Result<Option<M::Result>, AskError>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        TenantActor: Handler<M>,
    {
        let Some(answer) = self
            .shard(tenant)
            .read()
            .get(tenant)
            .map(|e| e.addr.send(msg))
        else {
            return Ok(None);
        };
        match answer.await {
            Ok(r) => Ok(Some(r)),
            Err(MailboxError::Timeout) => Err(AskError::Timeout),
            Err(MailboxError::Closed) => Ok(None),
        }
    }

    /// Fire-and-forget to a running actor.
    pub fn tell_existing<M>(&self, tenant: &str, msg: M)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        TenantActor: Handler<M>,
    {
        if let Some(e) = self.shard(tenant).read().get(tenant) {
            e.addr.do_send(msg);
        }
    }
}
