//! `GET /readyz`: whether this replica can decide. Ready unless it is shutting down or the shared
//! store it decides on does not answer.

use std::sync::Arc;

use warp::http::StatusCode;
use warp::reply::Response;

use super::{json, App};

/// `GET /readyz`: 200 while every backend answers (the shared store, when there is one), else 503
/// naming what does not.
pub fn readiness(app: &Arc<App>) -> Response {
    let (up, state) = app.shared.store().readiness();
    if up {
        json(
            StatusCode::OK,
            &serde_json::json!({"ready": true, "store": state}),
        )
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({
                "ready": false,
                "store": state,
                "reason": "the shared store (redis) does not answer",
            }),
        )
    }
}
