//! The fast 503 of an admission that admitd cannot take on now: the daemon is past one of its
//! `[overload]` bounds (a tenant's mailbox, the held admissions) or is shutting down.
//!
//! The body is the API's error body (`error`, `message`) plus what a shed carries, so an MCP server
//! that hands `tool_result` to its client unchanged works the same for a 503 as for a 429: the
//! model is told to wait and retry. `Retry-After` is set as on a retryable 429. Nothing was spent.

use serde::Serialize;
use warp::http::{HeaderValue, StatusCode};
use warp::reply::Response;

/// Why the call was not taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// The tenant's actor has `[overload] mailbox` admissions waiting already.
    Mailbox,
    /// `[overload] max_held` admissions are held already.
    Held,
    /// The daemon is shutting down (another replica, or this one restarted, takes the retry).
    ShuttingDown,
    /// The shared store does not answer and `[store] on_error = "fail_closed"`.
    StoreUnavailable,
}

impl Overload {
    /// The metric label (`admitd_overload_total{reason}`).
    pub fn as_str(self) -> &'static str {
        match self {
            Overload::Mailbox => "mailbox",
            Overload::Held => "held",
            Overload::ShuttingDown => "shutting_down",
            Overload::StoreUnavailable => "store_unavailable",
        }
    }

    fn code(self) -> &'static str {
        match self {
            Overload::ShuttingDown => "shutting_down",
            Overload::StoreUnavailable => "store_unavailable",
            _ => "overloaded",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Overload::Mailbox => "too many calls of this tenant are waiting to be decided",
            Overload::Held => "too many calls are waiting for capacity",
            Overload::ShuttingDown => "the admission service is shutting down",
            Overload::StoreUnavailable => {
                "the shared state of the limits does not answer, so no call is admitted until it does"
            }
        }
    }
}

/// How long a refused caller is asked to wait: long enough for a backlog to clear or a restarted
/// daemon to listen again, short enough not to idle an agent.
pub const RETRY_AFTER_MS: u64 = 1000;

#[derive(Serialize)]
struct TextContent {
    #[serde(rename = "type")]
    kind: &'static str,
    text: String,
}

#[derive(Serialize)]
struct Structured {
    error: &'static str,
    scope: &'static str,
    retry_after_ms: u64,
    retryable: bool,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolResult {
    content: [TextContent; 1],
    structured_content: Structured,
    is_error: bool,
}

#[derive(Serialize)]
struct Body {
    error: &'static str,
    message: &'static str,
    admitted: bool,
    retry_after_ms: u64,
    retryable: bool,
    tool_result: ToolResult,
}

/// The 503 answer for `why`, counted in `admitd_overload_total{reason}`.
pub fn refused(why: Overload) -> Response {
    metrics::counter!(crate::telemetry::names::OVERLOAD, "reason" => why.as_str()).increment(1);
    response(why)
}

/// The 503 answer for `why`.
pub fn response(why: Overload) -> Response {
    let secs = RETRY_AFTER_MS.div_ceil(1000);
    let body = Body {
        error: why.code(),
        message: why.message(),
        admitted: false,
        retry_after_ms: RETRY_AFTER_MS,
        retryable: true,
        tool_result: ToolResult {
            content: [TextContent {
                kind: "text",
                text: format!(
                    "The service that admits this call is busy. Wait {secs} second{}, then retry \
                     this call with the same arguments. Do not retry sooner.",
                    if secs == 1 { "" } else { "s" }
                ),
            }],
            structured_content: Structured {
                error: "unavailable",
                scope: "overload",
                retry_after_ms: RETRY_AFTER_MS,
                retryable: true,
            },
            is_error: true,
        },
    };
    let mut r = super::json(StatusCode::SERVICE_UNAVAILABLE, &body);
    r.headers_mut()
        .insert(warp::http::header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_503_carries_the_error_body_a_tool_result_and_retry_after() {
        for why in [
            Overload::Mailbox,
            Overload::Held,
            Overload::ShuttingDown,
            Overload::StoreUnavailable,
        ] {
            let r = response(why);
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(r.headers()["retry-after"], "1");
            let body = futures_executor::block_on(http_body_util::BodyExt::collect(r.into_body()))
                .unwrap()
                .to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["error"], why.code());
            assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
            assert_eq!(v["tool_result"]["isError"], true);
            assert_eq!(
                v["tool_result"]["structuredContent"]["retry_after_ms"],
                1000
            );
            let text = v["tool_result"]["content"][0]["text"].as_str().unwrap();
            assert!(text.contains("Wait 1 second,"), "{text}");
        }
    }
}
