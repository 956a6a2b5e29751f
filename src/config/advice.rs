//! `[advice]`: how much of the traffic admitd decides it keeps for `GET /v1/advice` (see
//! [`crate::advice`]). Plumbing rather than policy: it changes nothing about how a call is decided,
//! only how long a stretch of traffic the advice can look back on and how much memory that takes.

use std::time::Duration;

use serde::Deserialize;

use super::raw::S;
use super::validate::Validator;
use super::ConfigError;

/// `[advice]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdviceConfig {
    /// Whether the calls are recorded at all (read at start; needs `[telemetry] enabled`).
    pub enabled: bool,
    /// The longest period an advice can look back on.
    pub keep: Duration,
    /// Calls kept at most (32 bytes each): under heavy traffic this, not `keep`, bounds the period.
    pub max_calls: usize,
    /// Distinct (tenant, subject) keys named at most; further subjects fold into `__other__`.
    pub max_subjects: usize,
}

impl Default for AdviceConfig {
    fn default() -> Self {
        AdviceConfig {
            enabled: true,
            keep: Duration::from_secs(3600),
            max_calls: 500_000,
            max_subjects: 10_000,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdvice {
    enabled: Option<S<bool>>,
    keep: Option<S<String>>,
    max_calls: Option<S<i64>>,
    max_subjects: Option<S<i64>>,
}

impl Validator<'_> {
    /// `[advice]`, over the defaults in `out`.
    pub(super) fn advice(&self, a: RawAdvice, out: &mut AdviceConfig) -> Result<(), ConfigError> {
        if let Some(v) = a.enabled {
            out.enabled = *v.get_ref();
        }
        if let Some(v) = a.keep {
            out.keep = self.duration("advice.keep", &v, Duration::from_secs(7 * 24 * 3600))?;
            if out.keep < Duration::from_secs(1) {
                return self.err(v.span(), "advice.keep must be at least 1s");
            }
        }
        if let Some(v) = a.max_calls {
            out.max_calls = self.count("advice.max_calls", &v, 1_000, 50_000_000)? as usize;
        }
        if let Some(v) = a.max_subjects {
            out.max_subjects = self.count("advice.max_subjects", &v, 10, 10_000_000)? as usize;
        }
        Ok(())
    }
}
