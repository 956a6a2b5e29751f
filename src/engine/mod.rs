//! The pure admission engine: token buckets, concurrency, quotas, penalties and the decisions they make.
//!
//! Nothing in here knows about actors, HTTP or async runtimes. Time comes in as arguments (see
//! [`crate::clock`]), so every rule is tested with a fake clock, instantly and exactly.

pub mod adaptive;
pub mod bucket;
pub mod durable;
pub mod labels;
pub mod leases;
pub mod lint;
pub mod poll;
pub mod probe;
pub mod refusal;
pub mod rng;
pub mod shared;
pub mod slots;
pub mod spend;
pub mod tenant;
pub mod types;

pub use shared::SharedBudgets;
pub use tenant::{
    feedback_answer, AdmitRequest, AdmitResult, CallSpend, PollAnswer, ProbeReport, ReleaseInfo,
    Released, RemoteAdaptive, RemoteAnswer, RemoteCall, RemoteLayer, RemoteOutcome, RemotePenalty,
    RemoteQuota, RemoteScope, RemoteSlots, RemoteSnapshotPlan, RemoteSnapshotState, Settlement,
    StateKey, TenantEngine, TenantGauges, TenantSnapshot, UnknownLease, UpstreamReport,
};
pub use types::*;

#[cfg(test)]
mod durable_tests;
#[cfg(test)]
mod spend_tests;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod upstream_tests;
