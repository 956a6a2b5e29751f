//! `[tasks]`: long-running calls answered as MCP tasks (the Tasks extension's `CreateTaskResult`).
//!
//! A task's lease outlives a call's (the worker renews it while the work runs), and admitd hands out
//! the `pollIntervalMs` its client must keep to: these keys bound that interval and say how many
//! polls a tenant's tasks may make in all. They are policy like `[limits.*]`, and a reload applies
//! them to the next admission or poll.

use std::time::Duration;

use serde::Deserialize;

use super::raw::S;
use super::validate::Validator;
use super::ConfigError;

/// `[tasks]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TasksConfig {
    /// The shortest poll interval handed out.
    pub poll_interval: Duration,
    /// Polls per second that all of one tenant's tasks may make together.
    pub poll_rate: f64,
    /// The longest poll interval handed out, however many tasks are in flight.
    pub max_poll_interval: Duration,
    /// How long a task's lease lives unless renewed (calls keep `[server] lease_ttl`).
    pub lease_ttl: Duration,
}

impl Default for TasksConfig {
    fn default() -> Self {
        TasksConfig {
            poll_interval: Duration::from_secs(2),
            poll_rate: 5.0,
            max_poll_interval: Duration::from_secs(60),
            lease_ttl: Duration::from_secs(3600),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTasks {
    poll_interval: Option<S<String>>,
    poll_rate: Option<S<String>>,
    max_poll_interval: Option<S<String>>,
    lease_ttl: Option<S<String>>,
}

/// The shortest interval that makes sense to hand out: a client polls over the network.
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(100);

impl Validator<'_> {
    /// `[tasks]`, over the defaults in `out`.
    pub(super) fn tasks(&self, t: RawTasks, out: &mut TasksConfig) -> Result<(), ConfigError> {
        if let Some(v) = &t.poll_interval {
            out.poll_interval =
                self.duration("tasks.poll_interval", v, Duration::from_secs(3600))?;
            if out.poll_interval < MIN_POLL_INTERVAL {
                return self.err(v.span(), "tasks.poll_interval must be at least 100ms");
            }
        }
        if let Some(v) = &t.poll_rate {
            out.poll_rate = self.rate("tasks.poll_rate", v)?.per_sec;
        }
        if let Some(v) = &t.max_poll_interval {
            out.max_poll_interval =
                self.duration("tasks.max_poll_interval", v, Duration::from_secs(86_400))?;
        }
        if out.max_poll_interval < out.poll_interval {
            // Reported where the operator wrote the smaller one (or the larger, if only it is set).
            let span = t
                .max_poll_interval
                .as_ref()
                .or(t.poll_interval.as_ref())
                .map_or(0..0, S::span);
            return self.err(
                span,
                format!(
                    "tasks.max_poll_interval ({:?}) must be at least tasks.poll_interval ({:?})",
                    out.max_poll_interval, out.poll_interval
                ),
            );
        }
        if let Some(v) = &t.lease_ttl {
            out.lease_ttl = self.duration("tasks.lease_ttl", v, Duration::from_secs(7 * 86_400))?;
            if out.lease_ttl < Duration::from_secs(1) {
                return self.err(v.span(), "tasks.lease_ttl must be at least 1s");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn tasks(text: &str) -> Result<TasksConfig, String> {
        Config::parse("admitd.toml", text)
            .map(|c| c.tasks)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_defaults_are_the_contracts() {
        let t = tasks("").unwrap();
        assert_eq!(t.poll_interval, Duration::from_secs(2));
        assert_eq!(t.poll_rate, 5.0);
        assert_eq!(t.max_poll_interval, Duration::from_secs(60));
        assert_eq!(t.lease_ttl, Duration::from_secs(3600));
    }

    #[test]
    fn every_key_is_read() {
        let t = tasks(
            "[tasks]\npoll_interval = \"500ms\"\npoll_rate = \"2/s\"\nmax_poll_interval = \"30s\"\nlease_ttl = \"10m\"\n",
        )
        .unwrap();
        assert_eq!(t.poll_interval, Duration::from_millis(500));
        assert_eq!(t.poll_rate, 2.0);
        assert_eq!(t.max_poll_interval, Duration::from_secs(30));
        assert_eq!(t.lease_ttl, Duration::from_secs(600));
    }

    #[test]
    fn bad_values_are_refused_on_their_line() {
        for (text, want) in [
            (
                "[tasks]\n\npoll_rate = \"5/mins\"\n",
                "admitd.toml:3: tasks.poll_rate: invalid rate",
            ),
            (
                "[tasks]\npoll_interval = \"10ms\"\n",
                "admitd.toml:2: tasks.poll_interval must be at least 100ms",
            ),
            (
                "[tasks]\npoll_interval = \"5s\"\nmax_poll_interval = \"1s\"\n",
                "admitd.toml:3: tasks.max_poll_interval (1s) must be at least tasks.poll_interval (5s)",
            ),
            (
                "[tasks]\npoll_interval = \"2m\"\n",
                "admitd.toml:2: tasks.max_poll_interval (60s) must be at least tasks.poll_interval (120s)",
            ),
            (
                "[tasks]\nlease_ttl = \"0s\"\n",
                "admitd.toml:2: tasks.lease_ttl must be at least 1s",
            ),
            (
                "[tasks]\nlease_ttl = \"30d\"\n",
                "admitd.toml:2: tasks.lease_ttl: \"30d\" is longer than the maximum",
            ),
            ("[tasks]\npoll_every = \"1s\"\n", "admitd.toml:2: "),
        ] {
            let got = tasks(text).unwrap_err();
            assert!(got.starts_with(want), "{text:?}: {got}");
        }
    }
}
