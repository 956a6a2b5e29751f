//! MCP tasks and lease renewals in the shared store: a task's start, each poll and each renewal is
//! one script call (`task`, `poll`, `renew` in `admitd.lua`) on the tenant's shard, so a task
//! started on one replica is polled and renewed on any, against one schedule on the store's clock.

use std::sync::Arc;

use super::error::StoreError;
use super::redis::RedisStore;
use super::spec::{strings, task_spec};
use crate::engine::poll::PollPolicy;
use crate::engine::PollAnswer;

/// What the store answered, with the tenant's tasks in flight where it counted them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreTask<T> {
    pub answer: T,
    pub in_flight: Option<u64>,
}

fn number(parts: &[String], i: usize) -> Result<f64, StoreError> {
    parts
        .get(i)
        .and_then(|x| x.parse::<f64>().ok())
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| StoreError::Script(format!("unreadable task answer {parts:?}")))
}

impl RedisStore {
    async fn task_op(
        self: &Arc<Self>,
        op: &'static str,
        tenant: &str,
        lease: u64,
        ttl_us: Option<f64>,
        default_ttl_us: f64,
        poll: &PollPolicy,
    ) -> Result<Vec<String>, StoreError> {
        let spec = task_spec(&self.keys, tenant, lease, ttl_us, default_ttl_us, poll);
        let spec = serde_json::to_string(&spec).map_err(|e| StoreError::Script(e.to_string()))?;
        let route = self.keys.tenant_base(tenant);
        strings(self.invoke(&route, op, spec, String::new()).await?)
    }

    /// Makes a lease a task living `ttl_ns`; `None` when the lease is gone. Answers the first poll
    /// interval in milliseconds.
    pub async fn start_task(
        self: Arc<Self>,
        tenant: Arc<str>,
        lease: u64,
        ttl_ns: u64,
        poll: PollPolicy,
    ) -> Result<Option<StoreTask<u64>>, StoreError> {
        let ttl_us = ttl_ns as f64 / 1e3;
        let parts = self
            .task_op("task", &tenant, lease, Some(ttl_us), ttl_us, &poll)
            .await?;
        if parts.first().map(String::as_str) != Some("ok") {
            return Ok(None);
        }
        Ok(Some(StoreTask {
            answer: number(&parts, 1)? as u64,
            in_flight: Some(number(&parts, 2)? as u64),
        }))
    }

    /// Checks a task's poll; `None` when it is not a task or has ended.
    pub async fn poll_task(
        self: Arc<Self>,
        tenant: Arc<str>,
        lease: u64,
        poll: PollPolicy,
    ) -> Result<Option<StoreTask<PollAnswer>>, StoreError> {
        let parts = self
            .task_op("poll", &tenant, lease, None, 0.0, &poll)
            .await?;
        Ok(match parts.first().map(String::as_str) {
            Some("due") => Some(StoreTask {
                answer: PollAnswer::Due {
                    interval_ms: number(&parts, 1)? as u64,
                },
                in_flight: Some(number(&parts, 2)? as u64),
            }),
            Some("early") => Some(StoreTask {
                answer: PollAnswer::Early {
                    wait_ns: (number(&parts, 1)? * 1e3) as u64,
                },
                in_flight: None,
            }),
            _ => None,
        })
    }

    /// Extends a lease by `ttl_ns`, or by its own TTL (`default_ttl_ns` when it has none); `None`
    /// when it is gone. Answers how long it now lives, in nanoseconds.
    pub async fn renew(
        self: Arc<Self>,
        tenant: Arc<str>,
        lease: u64,
        ttl_ns: Option<u64>,
        default_ttl_ns: u64,
    ) -> Result<Option<u64>, StoreError> {
        let poll = PollPolicy {
            min_ns: 0,
            spacing_ns: 0,
            max_ns: 0,
        };
        let parts = self
            .task_op(
                "renew",
                &tenant,
                lease,
                ttl_ns.map(|ns| ns as f64 / 1e3),
                default_ttl_ns as f64 / 1e3,
                &poll,
            )
            .await?;
        if parts.first().map(String::as_str) != Some("ok") {
            return Ok(None);
        }
        Ok(Some((number(&parts, 1)? * 1e3) as u64))
    }
}
