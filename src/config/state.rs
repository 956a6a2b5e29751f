//! `[state]`: the state file that keeps quotas, penalties and adaptive rates across restarts in
//! memory mode, and `[overload]`: the bounds that keep a flood from queueing without limit.
//!
//! Both are daemon plumbing rather than policy: they change nothing about how a call is decided,
//! only whether the daemon remembers across a restart and how much it takes on at once.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::raw::S;
use super::validate::Validator;
use super::ConfigError;

/// `[state]`.
#[derive(Debug, Clone, PartialEq)]
pub struct StateConfig {
    /// Where the state file lives; `None` (the default) keeps nothing across restarts.
    pub path: Option<PathBuf>,
    /// How often it is written (and once more on shutdown).
    pub interval: Duration,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            path: None,
            interval: Duration::from_secs(5),
        }
    }
}

/// `[overload]`.
#[derive(Debug, Clone, PartialEq)]
pub struct OverloadConfig {
    /// Admissions that may wait in one tenant actor's mailbox to be decided; past it, 503.
    pub mailbox: usize,
    /// Admissions held for capacity at once, over all tenants; past it, 503.
    pub max_held: usize,
    /// A connection that has not sent a request's complete headers this long after it began the
    /// request (or after it opened) is closed.
    pub header_timeout: Duration,
    /// A tenant's admissions being decided at once on one worker; its further calls wait their
    /// turn outside the worker's run queue (`api::gate`). 0: no gate.
    pub tenant_in_decision: usize,
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            mailbox: 1024,
            max_held: 10_000,
            header_timeout: Duration::from_secs(10),
            tenant_in_decision: 8,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawState {
    path: Option<S<String>>,
    interval: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOverload {
    mailbox: Option<S<i64>>,
    max_held: Option<S<i64>>,
    header_timeout: Option<S<String>>,
    tenant_in_decision: Option<S<i64>>,
}

impl Validator<'_> {
    /// `[state]`, over the defaults in `out`.
    pub(super) fn state(&self, s: RawState, out: &mut StateConfig) -> Result<(), ConfigError> {
        if let Some(v) = s.path {
            if v.get_ref().trim().is_empty() {
                return self.err(
                    v.span(),
                    "state.path must name a file (leave the key out to keep no state)",
                );
            }
            out.path = Some(PathBuf::from(v.get_ref()));
        }
        if let Some(v) = s.interval {
            out.interval = self.duration("state.interval", &v, Duration::from_secs(3600))?;
            if out.interval < Duration::from_millis(100) {
                return self.err(v.span(), "state.interval must be at least 100ms");
            }
        }
        Ok(())
    }

    /// `[overload]`, over the defaults in `out`.
    pub(super) fn overload(
        &self,
        o: RawOverload,
        out: &mut OverloadConfig,
    ) -> Result<(), ConfigError> {
        if let Some(v) = o.mailbox {
            out.mailbox = self.count("overload.mailbox", &v, 1, 1_000_000)? as usize;
        }
        if let Some(v) = o.max_held {
            out.max_held = self.count("overload.max_held", &v, 0, 10_000_000)? as usize;
        }
        if let Some(v) = o.tenant_in_decision {
            out.tenant_in_decision =
                self.count("overload.tenant_in_decision", &v, 0, 100_000)? as usize;
        }
        if let Some(v) = o.header_timeout {
            out.header_timeout =
                self.duration("overload.header_timeout", &v, Duration::from_secs(3600))?;
            if out.header_timeout < Duration::from_millis(100) {
                return self.err(v.span(), "overload.header_timeout must be at least 100ms");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    fn err(text: &str) -> String {
        Config::parse("cfg.toml", text).unwrap_err().to_string()
    }

    #[test]
    fn state_is_off_by_default_and_read_when_set() {
        let c = Config::default();
        assert_eq!(c.state, StateConfig::default());
        assert_eq!(c.state.path, None);
        let c = Config::parse(
            "cfg.toml",
            "[state]\npath = \"/var/lib/admitd/state\"\ninterval = \"2s\"\n",
        )
        .unwrap();
        assert_eq!(
            c.state.path.as_deref(),
            Some(std::path::Path::new("/var/lib/admitd/state"))
        );
        assert_eq!(c.state.interval, Duration::from_secs(2));
    }

    #[test]
    fn bad_state_and_overload_keys_name_their_line() {
        assert_eq!(
            err("[state]\npath = \"\"\n"),
            "cfg.toml:2: state.path must name a file (leave the key out to keep no state)"
        );
        assert_eq!(
            err("[state]\ninterval = \"10ms\"\n"),
            "cfg.toml:2: state.interval must be at least 100ms"
        );
        assert!(err("[state]\nfile = \"x\"\n").starts_with("cfg.toml:2: "));
        assert_eq!(
            err("[overload]\nmailbox = 0\n"),
            "cfg.toml:2: overload.mailbox must be a whole number from 1 to 1000000, not 0"
        );
        assert_eq!(
            err("\n[overload]\nheader_timeout = \"1ms\"\n"),
            "cfg.toml:3: overload.header_timeout must be at least 100ms"
        );
    }

    #[test]
    fn overload_bounds_are_read() {
        let c = Config::parse(
            "cfg.toml",
            "[overload]\nmailbox = 64\nmax_held = 5\nheader_timeout = \"2s\"\ntenant_in_decision = 0\n",
        )
        .unwrap();
        assert_eq!(
            c.overload,
            OverloadConfig {
                mailbox: 64,
                max_held: 5,
                header_timeout: Duration::from_secs(2),
                tenant_in_decision: 0,
            }
        );
        assert_eq!(Config::default().overload, OverloadConfig::default());
    }
}
