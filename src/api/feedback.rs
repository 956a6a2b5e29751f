//! `POST /v1/feedback`: an upstream's answer seen outside a lease (a 429 and its `Retry-After`),
//! fed into that upstream's penalty box and adaptive rate for the tenant.

use std::sync::Arc;

use serde::Deserialize;
use warp::http::StatusCode;
use warp::reply::Response;

use super::fields::{name_field, status_field, RetryAfterValue};
use super::{body, json, ApiError, App};
use crate::actors::Feedback;
use crate::telemetry::FeedbackEvent;

#[derive(Deserialize)]
struct FeedbackBody {
    tenant: String,
    upstream: String,
    status: f64,
    #[serde(default)]
    retry_after: Option<RetryAfterValue>,
}

pub async fn feedback(app: &Arc<App>, bytes: bytes::Bytes) -> Result<Response, ApiError> {
    let b: FeedbackBody = body::parse_json(&bytes)?;
    name_field("tenant", &b.tenant)?;
    name_field("upstream", &b.upstream)?;
    let status = status_field("status", b.status)?;
    let retry_after = b
        .retry_after
        .as_ref()
        .map(|r| r.parse(app.shared.clock.wall_ms()))
        .transpose()?;
    let upstream: Arc<str> = Arc::from(b.upstream.as_str());
    let penalty = app
        .shared
        .ask(
            &b.tenant,
            Feedback {
                upstream: upstream.clone(),
                status,
                retry_after: retry_after.as_ref().map(|r| r.0),
            },
        )
        .await?;
    app.shared.telemetry.feedback(FeedbackEvent {
        tenant: Arc::from(b.tenant.as_str()),
        upstream,
        status,
        retry_after: retry_after.map(|r| r.1),
        penalty_ms: penalty.map(|d| d.as_millis() as u64),
    });
    Ok(json(
        StatusCode::ACCEPTED,
        &serde_json::json!({"accepted": true}),
    ))
}
