//! Limits from observed traffic: what `GET /v1/advice` and `admitd advise` answer.
//!
//! This module owns the whole method as plain code driven by `now` (no actor, no I/O), so every
//! part is tested with a fake clock:
//! - [`recording`]: the calls admitd decided, 32 bytes each, in a fixed budget (`[advice]
//!   max_calls`, `max_subjects`, `keep`; the bound is spelled out in its doc). The metrics actor
//!   on the telemetry thread ([`crate::telemetry::advice`]) feeds it from the decision and release
//!   events that leave the admission path anyway, so recording costs the admission nothing it did
//!   not already do.
//! - [`method`]: the shape of each key's traffic and the limits proposed from percentiles across
//!   keys, each number with what it came from.
//! - [`replay`]: the period's calls decided again through the real engine, against the running
//!   config and against the proposal (`would_shed`).
//! - [`render`]: the running config file with the proposal written in, validated like `admitd
//!   check`.
//!
//! With a shared store every replica records only the calls it decided itself; a [`Period`] is
//! what it hands out (`?format=raw`) so that `admitd advise` can merge several replicas' periods
//! ([`Period::merge`]) and run the same method on the whole.

pub mod method;
pub mod recording;
pub mod render;
pub mod replay;

use std::collections::BTreeMap;

use serde::Serialize;

pub use method::{Method, Observed, Proposal};
pub use recording::{Period, PeriodCall, Recording};
pub use replay::WouldShed;

use crate::config::Config;

/// The answer of `GET /v1/advice`.
#[derive(Debug, Clone, Serialize)]
pub struct Advice {
    /// The period the advice covers, in seconds (at most what was asked for).
    pub over_s: f64,
    pub calls: u64,
    pub limits: Limits,
    pub observed: BTreeMap<String, Observed>,
    pub would_shed: WouldShedBoth,
    pub toml: String,
    /// What the reader should know about this advice (left-out calls, plans that override it).
    pub notes: Vec<String>,
}

/// `limits`: the proposal, by the config section it goes to.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject: Option<method::Proposed>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<method::Proposed>,
    pub tools: BTreeMap<String, method::Proposed>,
    pub upstreams: BTreeMap<String, method::Proposed>,
}

/// `would_shed`: the replay against the running config and against the proposal.
#[derive(Debug, Clone, Serialize)]
pub struct WouldShedBoth {
    pub current: Vec<WouldShed>,
    pub proposed: Vec<WouldShed>,
}

fn listed(mut v: Vec<WouldShed>, what: &str, notes: &mut Vec<String>) -> Vec<WouldShed> {
    if v.len() > replay::MAX_LISTED {
        notes.push(format!(
            "{} more subjects would be refused under the {what} config than are listed",
            v.len() - replay::MAX_LISTED
        ));
        v.truncate(replay::MAX_LISTED);
    }
    v
}

/// The advice for `period`, from a daemon running `cfg` read from `text` (the config file's text;
/// empty on built-in defaults). `wall_end_ms`: when the period ended, on the wall clock.
pub fn advise(
    period: &Period,
    cfg: &Config,
    text: &str,
    wall_end_ms: i64,
) -> Result<Advice, String> {
    let m = method::run(period, cfg);
    let toml = render::render(text, &m.proposal)?;
    let proposed = Config::parse("proposal", &toml).map_err(|e| e.to_string())?;
    let mut notes = Vec::new();
    if m.folded_calls > 0 {
        notes.push(format!(
            "{} calls came from subjects past [advice] max_subjects (folded into __other__): counted for their tenants, left out of the subjects' numbers and of the replay",
            m.folded_calls
        ));
    }
    let overridden: Vec<&str> = cfg
        .plans
        .iter()
        .filter(|(_, p)| p.subject != Default::default() || p.tenant != Default::default())
        .map(|(n, _)| n.as_str())
        .collect();
    if !overridden.is_empty() {
        let mut overridden = overridden;
        overridden.sort_unstable();
        notes.push(format!(
            "plans {} override [limits.*] keys for their tenants; the proposal leaves them as they are",
            overridden.join(", ")
        ));
    }
    if period.calls.is_empty() {
        notes.push("no calls in the period: nothing to propose, the config is unchanged".into());
    }
    let current = replay::replay(period, cfg, wall_end_ms);
    let under_proposal = replay::replay(period, &proposed, wall_end_ms);
    Ok(Advice {
        over_s: period.over_ms as f64 / 1000.0,
        calls: period.calls.len() as u64,
        limits: Limits {
            subject: m.proposal.subject,
            tenant: m.proposal.tenant,
            tools: m.proposal.tools,
            upstreams: m.proposal.upstreams,
        },
        observed: m.observed,
        would_shed: WouldShedBoth {
            current: listed(current, "current", &mut notes),
            proposed: listed(under_proposal, "proposed", &mut notes),
        },
        toml,
        notes,
    })
}

#[cfg(test)]
mod tests;
