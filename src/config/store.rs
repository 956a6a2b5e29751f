//! `[store]`: where admission state lives. `memory` (the default) keeps it in this process; `redis`
//! keeps it in a Redis (or Redis Cluster) that several replicas share (see `crate::store`). The
//! section's keys are those of the wire contract's shared-store extension, each checked with a
//! `FILE:LINE` error.
//!
//! This file owns the section's raw shape, its validated model ([`StoreConfig`]) and its checks.

use std::time::Duration;

use serde::Deserialize;
use toml::Spanned as S;

use super::validate::Validator;
use super::ConfigError;

/// `[store]` as the file has it.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) kind: Option<S<String>>,
    pub(super) url: Option<S<String>>,
    pub(super) cluster: Option<S<bool>>,
    pub(super) key_prefix: Option<S<String>>,
    pub(super) pool_size: Option<S<i64>>,
    pub(super) timeout: Option<S<String>>,
    pub(super) on_error: Option<S<String>>,
    pub(super) replicas: Option<S<i64>>,
    pub(super) slice: Option<S<String>>,
}

/// Which store holds the admission state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreKind {
    #[default]
    Memory,
    Redis,
}

/// What an admission does while the shared store does not answer (within `timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// Refuse with a retry hint (503, `store_unavailable`).
    #[default]
    FailClosed,
    /// Admit, counted (`admitd_store_fallback_decisions_total{mode="fail_open"}`).
    FailOpen,
    /// Enforce every limit divided by `replicas` in this process until the store answers again.
    LocalFallback,
}

impl OnError {
    pub fn as_str(self) -> &'static str {
        match self {
            OnError::FailClosed => "fail_closed",
            OnError::FailOpen => "fail_open",
            OnError::LocalFallback => "local_fallback",
        }
    }
}

/// `[store]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// `redis://` or `rediss://` (TLS), with `user:password@` when the server wants them. With
    /// `cluster`, a comma-separated list of seed nodes.
    pub url: Option<String>,
    pub cluster: bool,
    /// Every key admitd writes starts with this, so several fleets can share one Redis.
    pub key_prefix: String,
    /// Multiplexed connections per process (each carries many calls at once).
    pub pool_size: usize,
    /// The longest an admission waits on the store before `on_error` applies.
    pub timeout: Duration,
    pub on_error: OnError,
    /// How many replicas share the store: `local_fallback` enforces each limit divided by this.
    pub replicas: u32,
    /// On a cluster: how much of its own rate each replica leases ahead from the global bucket
    /// (see `store::slices`); zero decides every call on the bucket's shard.
    pub slice: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            kind: StoreKind::Memory,
            url: None,
            cluster: false,
            key_prefix: "admitd".to_string(),
            pool_size: 2,
            timeout: Duration::from_millis(50),
            on_error: OnError::FailClosed,
            replicas: 1,
            slice: Duration::from_millis(100),
        }
    }
}

impl StoreConfig {
    /// The seed URLs (one unless `cluster`).
    pub fn urls(&self) -> Vec<String> {
        self.url
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(|u| u.trim().to_string())
            .filter(|u| !u.is_empty())
            .collect()
    }
}

impl Validator<'_> {
    /// `[store]`, over the defaults in `out`.
    pub(super) fn store(&self, s: RawStore, out: &mut StoreConfig) -> Result<(), ConfigError> {
        if let Some(v) = &s.kind {
            out.kind = match v.get_ref().as_str() {
                "memory" => StoreKind::Memory,
                "redis" => StoreKind::Redis,
                other => {
                    return self.err(
                        v.span(),
                        format!("store.kind must be \"memory\" or \"redis\", not {other:?}"),
                    )
                }
            };
        }
        if let Some(v) = &s.cluster {
            out.cluster = *v.get_ref();
        }
        if let Some(v) = &s.url {
            let urls: Vec<&str> = v.get_ref().split(',').map(str::trim).collect();
            if !out.cluster && urls.len() > 1 {
                return self.err(
                    v.span(),
                    "store.url lists several nodes: set store.cluster = true for Redis Cluster",
                );
            }
            for u in &urls {
                let scheme_ok = u.starts_with("redis://") || u.starts_with("rediss://");
                let host = u.split_once("://").map_or("", |(_, rest)| rest);
                let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
                if !scheme_ok || host.is_empty() || host.starts_with('/') {
                    return self.err(
                        v.span(),
                        format!(
                            "store.url: {u:?} is not a URL such as \"redis://127.0.0.1:6379\" (or rediss:// for TLS)"
                        ),
                    );
                }
            }
            out.url = Some(v.get_ref().clone());
        }
        if let Some(v) = &s.key_prefix {
            let p = v.get_ref();
            if p.is_empty()
                || p.len() > 64
                || !p
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
            {
                return self.err(
                    v.span(),
                    format!(
                        "store.key_prefix must be 1 to 64 letters, digits, '_', '-', '.' or ':', not {p:?}"
                    ),
                );
            }
            out.key_prefix = p.clone();
        }
        if let Some(v) = &s.pool_size {
            out.pool_size = self.count("store.pool_size", v, 1, 64)? as usize;
        }
        if let Some(v) = &s.timeout {
            out.timeout = self.duration("store.timeout", v, Duration::from_secs(10))?;
            if out.timeout.is_zero() {
                return self.err(v.span(), "store.timeout must be longer than 0");
            }
        }
        if let Some(v) = &s.on_error {
            out.on_error = match v.get_ref().as_str() {
                "fail_closed" => OnError::FailClosed,
                "fail_open" => OnError::FailOpen,
                "local_fallback" => OnError::LocalFallback,
                other => {
                    return self.err(
                        v.span(),
                        format!(
                            "store.on_error must be \"fail_closed\", \"fail_open\" or \"local_fallback\", not {other:?}"
                        ),
                    )
                }
            };
        }
        if let Some(v) = &s.replicas {
            out.replicas = self.count("store.replicas", v, 1, 10_000)? as u32;
        }
        if let Some(v) = &s.slice {
            out.slice = self.duration("store.slice", v, Duration::from_secs(1))?;
        }
        if out.kind == StoreKind::Redis {
            let span = s.kind.as_ref().map_or(0..0, toml::Spanned::span);
            if out.url.is_none() {
                return self.err(span, "store.kind = \"redis\" needs store.url");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse("admitd.toml", text).map_err(|e| e.to_string())
    }

    #[test]
    fn the_default_store_is_memory_with_a_50ms_timeout_failing_closed() {
        let c = parse("").unwrap();
        assert_eq!(c.store, StoreConfig::default());
        assert_eq!(c.store.kind, StoreKind::Memory);
        assert_eq!(c.store.timeout, Duration::from_millis(50));
        assert_eq!(c.store.on_error, OnError::FailClosed);
    }

    #[test]
    fn a_redis_store_is_accepted_with_a_url() {
        let c = parse("[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:6390\"\n").unwrap();
        assert_eq!(c.store.kind, StoreKind::Redis);
        assert_eq!(c.store.urls(), vec!["redis://127.0.0.1:6390"]);
    }

    #[test]
    fn every_key_is_read() {
        let c = parse(
            "[store]\nkind = \"memory\"\nurl = \"rediss://u:p@a:1,rediss://b:2\"\ncluster = true\n\
             key_prefix = \"fleet-a\"\npool_size = 4\ntimeout = \"20ms\"\non_error = \"local_fallback\"\nreplicas = 3\n\
             slice = \"0s\"\n",
        )
        .unwrap();
        let s = c.store;
        assert_eq!(s.kind, StoreKind::Memory);
        assert!(s.cluster);
        assert_eq!(s.urls(), vec!["rediss://u:p@a:1", "rediss://b:2"]);
        assert_eq!(s.key_prefix, "fleet-a");
        assert_eq!(s.pool_size, 4);
        assert_eq!(s.timeout, Duration::from_millis(20));
        assert_eq!(s.on_error, OnError::LocalFallback);
        assert_eq!(s.replicas, 3);
        assert_eq!(s.slice, Duration::ZERO);
    }

    #[test]
    fn bad_values_name_their_line() {
        let cases = [
            (
                "[store]\nkind = \"etcd\"\n",
                "admitd.toml:2: store.kind must be",
            ),
            (
                "[store]\nurl = \"http://x:1\"\n",
                "admitd.toml:2: store.url",
            ),
            (
                "[store]\nurl = \"redis://a:1,redis://b:2\"\n",
                "admitd.toml:2: store.url lists several",
            ),
            (
                "\n[store]\n\ntimeout = \"0s\"\n",
                "admitd.toml:4: store.timeout must be longer",
            ),
            (
                "[store]\ntimeout = \"fast\"\n",
                "admitd.toml:2: store.timeout",
            ),
            (
                "[store]\non_error = \"ignore\"\n",
                "admitd.toml:2: store.on_error must be",
            ),
            (
                "[store]\nreplicas = 0\n",
                "admitd.toml:2: store.replicas must be",
            ),
            (
                "[store]\npool_size = 100\n",
                "admitd.toml:2: store.pool_size must be",
            ),
            ("[store]\nslice = \"2s\"\n", "admitd.toml:2: store.slice"),
            (
                "[store]\nkey_prefix = \"a b\"\n",
                "admitd.toml:2: store.key_prefix must be",
            ),
            (
                "[store]\nkind = \"redis\"\n",
                "admitd.toml:2: store.kind = \"redis\" needs store.url",
            ),
            ("[store]\nhost = \"x\"\n", "admitd.toml:2:"),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err();
            assert!(e.starts_with(want), "{text:?}: {e}");
        }
    }
}
