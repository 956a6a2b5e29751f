//! `POST /v1/release`: the end of an admitted call. The lease id carries the tenant, so the release
//! goes to that tenant's actor (or, with a shared store, to the store through any replica's actor);
//! what the upstream answered feeds its penalty box and adaptive rate there.

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use warp::http::StatusCode;
use warp::reply::Response;

use super::fields::{status_field, RetryAfterValue};
use super::{body, json_response, lease, ApiError, App};
use crate::actors::{Release, ReleaseError};
use crate::engine::{Outcome, ReleaseInfo};
use crate::store::Store;
use crate::telemetry::ReleaseEvent;

/// The answer to a release.
const RELEASED: &[u8] = br#"{"released":true}"#;

#[derive(Deserialize)]
struct ReleaseBody<'a> {
    /// Borrowed from the request body unless the JSON escapes characters in it.
    #[serde(borrow)]
    lease_id: Cow<'a, str>,
    #[serde(borrow)]
    outcome: Cow<'a, str>,
    #[serde(default)]
    upstream_status: Option<f64>,
    #[serde(default)]
    retry_after: Option<RetryAfterValue>,
    #[serde(default)]
    duration_ms: Option<f64>,
    /// What the call actually spent, per spend unit.
    #[serde(default)]
    spent: Option<std::collections::BTreeMap<String, f64>>,
    /// What the call actually cost in cost units (0 for a cache hit).
    #[serde(default)]
    cost: Option<f64>,
}

pub async fn release(app: &Arc<App>, bytes: bytes::Bytes) -> Result<Response, ApiError> {
    let b: ReleaseBody = body::parse_json(&bytes)?;
    let outcome = Outcome::parse(&b.outcome).ok_or_else(|| {
        ApiError::invalid(format!(
            "outcome {:?} is not one of ok, error, upstream_rate_limited, cancelled",
            b.outcome
        ))
    })?;
    let upstream_status = b
        .upstream_status
        .map(|s| status_field("upstream_status", s))
        .transpose()?;
    let wall = app.shared.clock.wall_ms();
    let retry_after = b.retry_after.as_ref().map(|r| r.parse(wall)).transpose()?;
    let duration_ms = match b.duration_ms {
        Some(d) if d.is_finite() && d >= 0.0 => Some(d.min(u64::MAX as f64 / 2.0) as u64),
        Some(d) => {
            return Err(ApiError::invalid(format!(
                "duration_ms {d} must be a non-negative number"
            )))
        }
        None => None,
    };
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_lease",
            "no such lease: it was never issued, was already released, or expired",
        )
    };
    // Checked in full before the lease is touched: a bad figure changes nothing.
    let settle = super::spend::settlement(&app.shared.config.load(), b.spent.as_ref(), b.cost)?;
    let (tenant, lease) = lease::decode(&b.lease_id).ok_or_else(unknown)?;
    let info = ReleaseInfo {
        outcome,
        upstream_status,
        retry_after: retry_after.as_ref().map(|r| r.0),
        duration_ms,
    };
    let msg = Release {
        lease,
        info,
        settle,
    };
    // With a shared store the lease may be another replica's: this one's actor asks the store.
    let released = match app.shared.store() {
        Store::Redis(_) => Some(app.shared.ask(&tenant, msg).await?),
        Store::Memory => app.shared.ask_existing(&tenant, msg).await?,
    };
    let released = released.ok_or_else(unknown)?.map_err(|e| match e {
        ReleaseError::Unknown => unknown(),
        ReleaseError::StoreUnavailable(why) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            format!("the shared store (redis) holding the lease did not answer ({why}); release it again"),
        ),
    })?;
    let counted = upstream_status.is_some()
        || outcome == Outcome::UpstreamRateLimited
        || duration_ms.is_some();
    if !app.shared.telemetry.wants_release(counted) {
        return Ok(json_response(StatusCode::OK, RELEASED));
    }
    app.shared.telemetry.release(ReleaseEvent {
        tenant: Arc::from(tenant.as_str()),
        subject: released.subject,
        tool: released.tool,
        upstream: released.upstream,
        outcome: outcome.as_str(),
        upstream_status,
        retry_after: retry_after.map(|r| r.1),
        penalty_ms: released.penalty.map(|d| d.as_millis() as u64),
        duration_ms,
        lease,
        released_unix_ns: if app.shared.telemetry.traces() {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        } else {
            0
        },
    });
    Ok(json_response(StatusCode::OK, RELEASED))
}
