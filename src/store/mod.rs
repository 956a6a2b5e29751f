//! Where admission state lives: in each process (the embedded default, `[store] kind = "memory"`), or
//! in a store that several replicas share (`kind = "redis"`), so that a fleet enforces one budget.
//!
//! The seam between the engine and a store is data. In memory, a tenant's actor owns its
//! [`crate::engine::TenantEngine`], whose `store.rs` reads and writes the state in place. With a
//! shared store, the same engine plans the call ([`crate::engine::TenantEngine::plan_remote`]: the
//! layers, their shapes and the state each reads, as [`crate::engine::StateKey`]s), the store checks
//! and spends all of it at once on its own clock ([`redis::RedisStore::decide`], one script call),
//! and the engine turns the answer into the decision ([`crate::engine::TenantEngine::interpret_remote`]).
//! The rules of a decision (which layers, in which order, what a refusal says and promises) are
//! written once, in the engine; a store implements the primitive state changes (GCRA take with
//! hold and promise, refund, leases with a TTL, counters per UTC day, penalty deadlines, AIMD and
//! adaptive windows). docs/architecture.md draws the path of one call.

mod error;
pub mod keys;
mod lane;
pub mod redis;
mod spec;
mod tasks;

pub use self::error::StoreError;
pub use self::redis::{RedisStore, Refund, StoreReleased};
pub use self::tasks::StoreTask;

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
