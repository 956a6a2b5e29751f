//! `POST /v1/renew`: extends a live lease, most often an MCP task's, renewed by the server's worker
//! while the work runs. A worker that dies stops renewing, and the lease (with its concurrency
//! slot) ends at its TTL. `ttl_ms` is optional: without it, the lease is extended by its own TTL
//! (a task's `[tasks] lease_ttl`, the last `ttl_ms` it was renewed with, else `[server] lease_ttl`).

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use warp::http::StatusCode;
use warp::reply::Response;

use super::tasks::{ask_lease, task_error, unknown_lease};
use super::{body, json_response, lease, ApiError, App};
use crate::actors::Renew;
use crate::clock::{ceil_ms, NS_PER_MS};

/// The longest a renewal may extend a lease by: as long as the longest `lease_ttl` the config
/// allows.
pub const MAX_TTL_MS: u64 = 7 * 86_400 * 1_000;

#[derive(Deserialize)]
struct RenewBody<'a> {
    #[serde(borrow)]
    lease_id: Cow<'a, str>,
    #[serde(default)]
    ttl_ms: Option<f64>,
}

/// `ttl_ms` as nanoseconds: a whole number of milliseconds from 1 to [`MAX_TTL_MS`].
fn ttl_ns(ttl_ms: Option<f64>) -> Result<Option<u64>, ApiError> {
    let Some(ms) = ttl_ms else { return Ok(None) };
    if !(ms.is_finite() && ms >= 1.0 && ms <= MAX_TTL_MS as f64 && ms.fract() == 0.0) {
        return Err(ApiError::invalid(format!(
            "ttl_ms {ms} must be a whole number of milliseconds from 1 to {MAX_TTL_MS} (7 days)"
        )));
    }
    Ok(Some(ms as u64 * NS_PER_MS))
}

pub async fn renew(app: &Arc<App>, bytes: bytes::Bytes) -> Result<Response, ApiError> {
    let b: RenewBody = body::parse_json(&bytes)?;
    let ttl_ns = ttl_ns(b.ttl_ms)?;
    let (tenant, lease) = lease::decode(&b.lease_id).ok_or_else(unknown_lease)?;
    let left_ns = ask_lease(&app.shared, &tenant, Renew { lease, ttl_ns })
        .await?
        .map_err(task_error)?;
    let mut out = Vec::with_capacity(48);
    out.extend_from_slice(b"{\"renewed\":true,\"expires_in_ms\":");
    out.extend_from_slice(itoa::Buffer::new().format(ceil_ms(left_ns)).as_bytes());
    out.push(b'}');
    Ok(json_response(StatusCode::OK, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_ms_is_a_whole_positive_number_within_a_week() {
        assert_eq!(ttl_ns(None).unwrap(), None);
        assert_eq!(ttl_ns(Some(60_000.0)).unwrap(), Some(60_000 * NS_PER_MS));
        assert_eq!(
            ttl_ns(Some(MAX_TTL_MS as f64)).unwrap(),
            Some(MAX_TTL_MS * NS_PER_MS)
        );
        for bad in [
            0.0,
            -5.0,
            1.5,
            f64::NAN,
            f64::INFINITY,
            1e300,
            MAX_TTL_MS as f64 + 1.0,
        ] {
            let e = ttl_ns(Some(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(e.code, "invalid_request");
        }
    }
}
