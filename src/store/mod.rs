//! Where admission state lives: in each process (the embedded default, `[store] kind = "memory"`), or
//! in a store that several replicas share (`kind = "redis"`), so that a fleet enforces one budget.
//!
//! The seam between the engine and a store is data. In memory, a tenant's actor owns its
//! [`crate::engine::TenantEngine`], whose `store.rs` reads and writes the state in place. With a
//! shared store, the same engine plans the call ([`crate::engine::TenantEngine::plan_remote`]: the
//! layers, their shapes and the state each reads, as [`crate::engine::StateKey`]s), the store checks
//! and spends all of it at once on its own clock ([`redis::RedisStore::decide`], one script call),
//! and the engine turns the answer into the decision ([`crate::engine::TenantEngine::interpret_remote`]).
//! Which layers a call passes, in which order and what a refusal says are decided in the engine
//! only. The rules that move state (GCRA with hold and promise cursor, the hint stagger and slot
//! margin, the adaptive window, AIMD, task polls) are written twice, in the engine and in
//! `admitd.lua`, with every constant defined once in the engine and written into the script
//! ([`script`]): docs/architecture.md lists each rule, and the parity test that holds the two
//! copies together. The actors and the API reach a store through [`Store`].

use std::sync::Arc;

mod answers;
mod cross;
mod error;
pub mod keys;
mod lane;
mod nodes;
mod pack;
pub mod redis;
pub mod script;
pub mod slices;
mod spec;
mod tasks;
mod wire;

pub use self::error::StoreError;
pub use self::redis::{RedisStore, Refund, StoreReleased};
pub use self::tasks::StoreTask;

/// Where this replica's admission state lives: the seam the actors and the API hold. Which store a
/// call talks to is a match on this, decided once at start (`[store] kind`); the hot path of either
/// store is a direct call, with no dynamic dispatch.
#[derive(Clone, Default)]
pub enum Store {
    /// In each tenant's actor (`kind = "memory"`): a decision is one synchronous call of its engine.
    #[default]
    Memory,
    /// In Redis, shared by every replica that points at it (`kind = "redis"`): the tenant's engine
    /// plans the call, the store checks and spends it, the engine reads the answer.
    Redis(Arc<RedisStore>),
}

impl Store {
    /// The in-memory store, for a reference that lives as long as the process.
    pub const MEMORY: &'static Store = &Store::Memory;

    /// Whether the state is shared with other replicas (a tenant's state may be there even though
    /// this replica never saw the tenant).
    pub fn is_shared(&self) -> bool {
        matches!(self, Store::Redis(_))
    }

    /// For `/readyz` and the status page: whether the store answers, and what is known about it
    /// (`"memory"` for the in-memory store, which always answers).
    pub fn readiness(&self) -> (bool, serde_json::Value) {
        match self {
            Store::Memory => (true, serde_json::Value::String("memory".into())),
            Store::Redis(store) => store.readiness(),
        }
    }
}

/// How admissions are decided right now (the `mode` label of `admitd_store_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    /// In this process: the only store of `kind = "memory"`.
    Memory,
    /// On the shared store.
    Shared,
    /// The shared store does not answer: admissions are refused with a retry hint.
    FailClosed,
    /// The shared store does not answer: admissions are admitted unchecked.
    FailOpen,
    /// The shared store does not answer: each limit divided by `replicas` is enforced here.
    LocalFallback,
}

impl StoreMode {
    pub const ALL: [StoreMode; 5] = [
        StoreMode::Memory,
        StoreMode::Shared,
        StoreMode::FailClosed,
        StoreMode::FailOpen,
        StoreMode::LocalFallback,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StoreMode::Memory => "memory",
            StoreMode::Shared => "shared",
            StoreMode::FailClosed => "fail_closed",
            StoreMode::FailOpen => "fail_open",
            StoreMode::LocalFallback => "local_fallback",
        }
    }
}
