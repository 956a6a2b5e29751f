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
mod remote;
mod tasks;
pub mod tenant;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix::ArbiterHandle;
use arc_swap::ArcSwap;
use compact_str::CompactString;
use parking_lot::RwLock;

pub use global::GlobalActor;
pub use remote::StoreSnapshot;
pub use tasks::{PollTask, Renew, StartTask, TaskError};
pub use tenant::{
    Admit, AdmitReply, CancelLease, CancelWaiter, ConfirmHold, EndEdgeLease, ExportDurable,
    Feedback, ImportDurable, Layers, Release, ReleaseError, ReportCalls, Snapshot, TenantActor,
    Tick, TICK,
};

use crate::clock::{Clock, Nanos};
use crate::config::Config;
use crate::engine::AdmitRequest;
use crate::engine::SharedBudgets;
use crate::store::Store;
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

/// A running tenant actor, as the registry knows it: its name and everything a call reads in one
/// cache line, so that finding a tenant's actor costs one line of the registry: a name stored beside
/// the entry instead of inside it would make most entries straddle two lines.
#[repr(align(64))]
struct Entry {
    /// The tenant's name, inline up to 24 bytes, so a lookup compares it without a further miss.
    name: CompactString,
    /// Tells this actor from a later one of the same tenant (see [`Shared::registry_remove`]). 32
    /// bits: two actors of one tenant would have to start 2^32 actors apart to be confused.
    generation: u32,
    /// The arbiter it lives on (at most 256 workers).
    arbiter: u16,
    /// Its group for ticking ([`Shared::tick_slot`]), kept so that ticking does not hash names.
    tick_slot: u16,
    /// Admissions sent to the actor and not yet taken from its mailbox, bounded by `[overload]
    /// mailbox` (see [`Shared::admit`]). Shared with the actor, which counts them down.
    mailbox: Arc<AtomicU32>,
    addr: Addr<TenantActor>,
}

/// One registry shard: entries found by [`Shared::table_hash`].
type Table = hashbrown::HashTable<Entry>;

/// State every part of the daemon shares. Cheap to reach through an `Arc`.
pub struct Shared {
    pub config: ArcSwap<Config>,
    /// The config the process started with: where it listens, its worker count and its span
    /// exporter are these until a restart, whatever a reload says.
    pub started: Arc<Config>,
    pub budgets: Arc<SharedBudgets>,
    pub clock: Arc<dyn Clock>,
    pub telemetry: Telemetry,
    /// Per-process random seed (lease numbers, jitter).
    pub seed: u64,
    arbiters: Vec<ArbiterHandle>,
    shards: Vec<RwLock<Table>>,
    next_generation: AtomicU64,
    /// Set once shutdown starts: new admissions are refused and `/readyz` answers 503.
    stopping: AtomicBool,
    /// Where admission state lives (set once at start, before any tenant; memory until then).
    store: std::sync::OnceLock<Store>,
    /// `local_fallback`'s config (every limit divided by the replicas) for the config it was made
    /// from, and its cross-tenant budgets.
    fallback: parking_lot::Mutex<Option<(Arc<Config>, Arc<Config>)>>,
    fallback_budgets: std::sync::OnceLock<Arc<SharedBudgets>>,
}

/// Why a tenant actor could not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskError {
    /// The actor is too far behind to answer in time (overload); the call should be retried.
    Timeout,
    /// The actor kept stopping under us; should not happen more than once in a row.
    Unavailable,
    /// The actor's mailbox holds `[overload] mailbox` admissions already: refused at once, unsent.
    Overloaded,
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
        let started = Arc::new(config);
        Arc::new(Shared {
            config: ArcSwap::new(Arc::clone(&started)),
            started,
            budgets,
            clock,
            telemetry,
            seed,
            arbiters,
            shards: (0..SHARDS).map(|_| RwLock::new(Table::new())).collect(),
            next_generation: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            store: std::sync::OnceLock::new(),
            fallback: parking_lot::Mutex::new(None),
            fallback_budgets: std::sync::OnceLock::new(),
        })
    }

    /// Where admission state lives.
    pub fn store(&self) -> &Store {
        self.store.get().unwrap_or(Store::MEMORY)
    }

    /// Makes admissions use `store` (once, before the first tenant starts).
    pub fn set_store(&self, store: Store) {
        let _ = self.store.set(store);
    }

    /// The config `local_fallback` enforces while the shared store does not answer (each limit
    /// divided by `[store] replicas`), made once per config generation, and its cross-tenant budgets.
    pub fn local_fallback(&self, cfg: &Arc<Config>) -> (Arc<Config>, Arc<SharedBudgets>) {
        let mut cached = self.fallback.lock();
        let scaled = match &*cached {
            Some((base, scaled)) if Arc::ptr_eq(base, cfg) => Arc::clone(scaled),
            _ => {
                let scaled = Arc::new(cfg.divided(cfg.store.replicas));
                *cached = Some((Arc::clone(cfg), Arc::clone(&scaled)));
                scaled
            }
        };
        let budgets = self
            .fallback_budgets
            .get_or_init(|| Arc::new(SharedBudgets::new(&scaled)))
            .clone();
        (scaled, budgets)
    }

    /// Whether shutdown has started.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Starts shutdown: from now on admissions are refused and `/readyz` answers 503.
    pub fn start_stopping(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Places a tenant: its registry shard (low bits) and its arbiter (high bits). Not keyed: the
    /// placement only spreads load, it guards nothing.
    fn hash(tenant: &str) -> u64 {
        use std::hash::BuildHasher;
        foldhash::fast::FixedState::with_seed(0x5eed).hash_one(tenant)
    }

    /// The tenant's shard and its hash within the shard.
    fn shard(&self, tenant: &str) -> (&RwLock<Table>, u64) {
        let h = Self::hash(tenant);
        (&self.shards[(h as usize) % SHARDS], Self::table_hash(h))
    }

    /// The hash a shard's table files a tenant under: the placement hash without the bits that chose
    /// the shard (the same in every entry of a shard), mixed so the table's own low and high bits
    /// both vary.
    fn table_hash(placement: u64) -> u64 {
        (placement >> 6).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// The entry of `tenant` in a shard's table, given its [`Shared::table_hash`].
    fn find<'t>(table: &'t Table, hash: u64, tenant: &str) -> Option<&'t Entry> {
        table.find(hash, |e| e.name == tenant)
    }

    /// The tenant's actor, started on its arbiter if it is not running: its generation and address.
    pub fn tenant_or_start(self: &Arc<Self>, tenant: &str) -> (u64, Addr<TenantActor>) {
        let (shard, hash) = self.shard(tenant);
        if let Some(e) = Self::find(&shard.read(), hash, tenant) {
            return (u64::from(e.generation), e.addr.clone());
        }
        let mut map = shard.write();
        if let Some(e) = Self::find(&map, hash, tenant) {
            return (u64::from(e.generation), e.addr.clone());
        }
        let name: Arc<str> = Arc::from(tenant);
        let generation = u64::from(self.next_generation.fetch_add(1, Ordering::Relaxed) as u32);
        let mailbox = Arc::new(AtomicU32::new(0));
        let counted = mailbox.clone();
        let index = (Self::hash(tenant) >> 32) as usize % self.arbiters.len();
        let arbiter = &self.arbiters[index];
        let shared = Arc::clone(self);
        let n = name.clone();
        let addr = TenantActor::start_in_arbiter(arbiter, move |_| {
            TenantActor::new(n, shared, generation).with_mailbox_count(counted)
        });
        map.insert_unique(
            hash,
            Entry {
                name: CompactString::from(tenant),
                generation: generation as u32,
                arbiter: index as u16,
                tick_slot: Self::tick_slot(tenant) as u16,
                mailbox,
                addr: addr.clone(),
            },
            |e| Self::table_hash(Self::hash(&e.name)),
        );
        (generation, addr)
    }

    /// Removes a tenant's entry if it is still the given generation of actor.
    pub(crate) fn registry_remove(&self, tenant: &str, generation: u64) {
        let (shard, hash) = self.shard(tenant);
        let mut map = shard.write();
        if let Ok(e) = map.find_entry(hash, |e| {
            e.name == tenant && u64::from(e.generation) == generation
        }) {
            e.remove();
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
        for e in shard.read().iter() {
            if e.arbiter as usize == index && u64::from(e.tick_slot) == slot {
                e.addr.do_send(Tick);
            }
        }
    }

    /// The tick slot of a tenant's actor: the low bits of its placement hash, whose lowest bits
    /// (modulo [`SHARDS`]) are its registry shard.
    pub(crate) fn tick_slot(tenant: &str) -> u64 {
        Self::hash(tenant) % TICK_SLOTS
    }

    /// The addresses of every live tenant actor (for writing the state file).
    pub fn tenant_actors(&self) -> Vec<Addr<TenantActor>> {
        self.shards
            .iter()
            .flat_map(|s| s.read().iter().map(|e| e.addr.clone()).collect::<Vec<_>>())
            .collect()
    }

    /// Number of live tenant actors.
    pub fn tenant_count(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// Hands the tenant's registry entry (its actor started if needed) to `post`; returns the actor's
    /// generation and what `post` returned.
    fn with_entry<R>(self: &Arc<Self>, tenant: &str, post: impl FnOnce(&Entry) -> R) -> (u64, R) {
        let (shard, hash) = self.shard(tenant);
        loop {
            if let Some(e) = Self::find(&shard.read(), hash, tenant) {
                return (u64::from(e.generation), post(e));
            }
            self.tenant_or_start(tenant);
        }
    }

    /// Hands the tenant's actor (started if needed) to `post`; returns the actor's generation and what
    /// `post` returned. A running actor is reached while the registry is read, so its address is not
    /// cloned.
    fn with_actor<R>(
        self: &Arc<Self>,
        tenant: &str,
        post: impl FnOnce(&Addr<TenantActor>) -> R,
    ) -> (u64, R) {
        let (shard, hash) = self.shard(tenant);
        let map = shard.read();
        if let Some(e) = Self::find(&map, hash, tenant) {
            (u64::from(e.generation), post(&e.addr))
        } else {
            drop(map);
            let (generation, addr) = self.tenant_or_start(tenant);
            (generation, post(&addr))
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
            let limit = self.config.load().overload.mailbox as u32;
            let (generation, sent) = self.with_entry(tenant, |e| {
                // Counted before it is sent and counted down as the actor takes it, so the count
                // never runs below the mailbox's true length.
                if e.mailbox.fetch_add(1, Ordering::AcqRel) >= limit {
                    e.mailbox.fetch_sub(1, Ordering::AcqRel);
                    return false;
                }
                e.addr.do_send(msg);
                true
            });
            if !sent {
                return Err(AskError::Overloaded);
            }
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
        let (shard, hash) = self.shard(tenant);
        let Some(answer) = Self::find(&shard.read(), hash, tenant).map(|e| e.addr.send(msg)) else {
            return Ok(None);
        };
        match answer.await {
            Ok(r) => Ok(Some(r)),
            Err(MailboxError::Timeout) => Err(AskError::Timeout),
            Err(MailboxError::Closed) => Ok(None),
        }
    }

    /// Has every running tenant actor report the calls it answered since its last report
    /// ([`ReportCalls`]); resolves once each has.
    pub async fn report_calls(&self) {
        let asked: Vec<_> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.read()
                    .iter()
                    .map(|e| e.addr.send(ReportCalls))
                    .collect::<Vec<_>>()
            })
            .collect();
        futures_util::future::join_all(asked).await;
    }

    /// Fire-and-forget to a running actor.
    pub fn tell_existing<M>(&self, tenant: &str, msg: M)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        TenantActor: Handler<M>,
    {
        let (shard, hash) = self.shard(tenant);
        if let Some(e) = Self::find(&shard.read(), hash, tenant) {
            e.addr.do_send(msg);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;

    #[test]
    fn a_registry_entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Entry>(), 64);
        assert_eq!(std::mem::align_of::<Entry>(), 64);
    }

    #[test]
    fn the_registry_finds_every_tenant_and_removes_only_the_actor_it_is_told() {
        actix::System::new().block_on(async {
            let shared = Shared::new(
                Config::default(),
                Arc::new(FakeClock::new(0)),
                Telemetry::default(),
                vec![actix::Arbiter::current()],
            );
            // Many tenants per shard, with names short and long (inline and not).
            let tenants: Vec<String> = (0..2000)
                .map(|i| match i % 2 {
                    0 => format!("t{i}"),
                    _ => format!("a-tenant-name-longer-than-twenty-four-bytes-{i}"),
                })
                .collect();
            let generations: Vec<u64> = tenants
                .iter()
                .map(|t| shared.tenant_or_start(t).0)
                .collect();
            assert_eq!(shared.tenant_count(), tenants.len());
            for (t, g) in tenants.iter().zip(&generations) {
                assert_eq!(
                    shared.tenant_or_start(t).0,
                    *g,
                    "{t} found, not started again"
                );
            }
            // A stale generation removes nothing; the current one removes that tenant only.
            shared.registry_remove(&tenants[7], generations[7] + 1);
            assert_eq!(shared.tenant_count(), tenants.len());
            shared.registry_remove(&tenants[7], generations[7]);
            assert_eq!(shared.tenant_count(), tenants.len() - 1);
            assert_eq!(shared.tenant_or_start(&tenants[8]).0, generations[8]);
            let again = shared.tenant_or_start(&tenants[7]).0;
            assert!(again > *generations.iter().max().unwrap(), "a new actor");
            assert_eq!(shared.tenant_count(), tenants.len());
        });
    }
}
