//! The one error type of the HTTP API, rendered as `{"error": "<code>", "message": "<sentence>"}`.

use serde::Serialize;
use warp::http::StatusCode;
use warp::reply::{Reply, Response};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    message: &'a str,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
}

impl From<crate::actors::AskError> for ApiError {
    fn from(e: crate::actors::AskError) -> Self {
        match e {
            crate::actors::AskError::Timeout => ApiError::unavailable(
                "the tenant's state did not answer in time; retry the request",
            ),
            crate::actors::AskError::Overloaded => ApiError::unavailable(
                "too many calls of this tenant are waiting to be decided; retry the request",
            ),
            crate::actors::AskError::Unavailable => {
                ApiError::unavailable("the tenant's state is restarting; retry the request")
            }
        }
    }
}

impl Reply for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&Body {
            error: self.code,
            message: &self.message,
        })
        .unwrap_or_default();
        super::json_response(self.status, body)
    }
}
