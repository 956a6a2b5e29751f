//! Why a call to the shared store did not answer, and the bound every call to Redis is held to.
//! Everything else in the store depends on this module; it depends on nothing of the store's.

use std::time::Duration;

/// Why a call to the store did not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// No answer within `[store] timeout`.
    Timeout,
    /// Not connected, or the connection broke.
    Connection(String),
    /// Redis answered with an error.
    Script(String),
}

impl StoreError {
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::Script(_) => "script",
        }
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Timeout => write!(f, "no answer within the store timeout"),
            StoreError::Connection(e) => write!(f, "not connected: {e}"),
            StoreError::Script(e) => write!(f, "the store answered an error: {e}"),
        }
    }
}

/// A call to Redis bounded by `limit`: past it, a [`StoreError::Timeout`].
pub(super) async fn within(
    limit: Duration,
    call: impl std::future::Future<Output = redis::RedisResult<redis::Value>>,
) -> Result<redis::Value, StoreError> {
    match tokio::time::timeout(limit, call).await {
        Err(_) => Err(StoreError::Timeout),
        Ok(r) => r.map_err(store_error),
    }
}

/// How a connection to one Redis server is opened. The client's own response timeout (500 ms
/// unless set) would end any call past it as a broken connection, marking the store down at once
/// whatever `[store] timeout` says, and would cut a batch that the lane lets run for up to 10 s.
/// admitd bounds its calls itself ([`within`]: the store timeout, at most 10 s; a batch in flight,
/// 10 s), where running late counts as one failed call; the connection's own bound is only a
/// backstop behind all of them, for a call that nothing else bounds.
pub(super) fn connection_config(limit: Duration) -> redis::AsyncConnectionConfig {
    const BACKSTOP: Duration = Duration::from_secs(30);
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(BACKSTOP.max(limit * 2)))
}

/// A Redis client error as the store's.
pub(super) fn store_error(e: redis::RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreError::Connection(e.to_string())
    } else if e.is_timeout() {
        StoreError::Timeout
    } else {
        StoreError::Script(e.to_string())
    }
}
