//! `POST /v1/tasks/poll`: one `tasks/get` of an MCP task, checked against the time the task was
//! told to come back. On time: 200 with the next interval (which follows the tenant's load). Early:
//! 429 with the shed body of every refusal (`scope: "task_poll"`, the time until it is due). A task
//! that was released or expired: 404 `unknown_lease`. Polls spend no tool budget.
//!
//! Also the start of a task, for `POST /v1/admit` with `"task": true` ([`start`]): the lease is
//! made a task and its first interval is put in the admission's answer.

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use warp::http::{HeaderValue, StatusCode};
use warp::reply::Response;

use super::{body, json, json_response, lease, ApiError, App};
use crate::actors::{PollTask, Shared, StartTask, TaskError};
use crate::clock::ceil_ms;
use crate::engine::refusal::{self, whole_seconds, RefusalContext};
use crate::engine::{PollAnswer, Scope, Shed};
use crate::store::Store;
use crate::telemetry::TenantEvent;

#[derive(Deserialize)]
struct PollBody<'a> {
    #[serde(borrow)]
    lease_id: Cow<'a, str>,
}

pub(super) fn unknown_lease() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "unknown_lease",
        "no such lease: it was never issued, was already released, or expired",
    )
}

/// A lease that is not live is 404; a shared store that does not answer is 503 (the lease may be
/// live: the caller tries again rather than give the task up).
pub(super) fn task_error(e: TaskError) -> ApiError {
    match e {
        TaskError::Unknown => unknown_lease(),
        TaskError::Unavailable => ApiError::unavailable(
            "the shared store does not answer; whether the lease is live is not known, try again",
        ),
    }
}

/// Asks the tenant's actor; with a shared store the lease may be another replica's, so the actor
/// is started if needed and asks the store.
pub(super) async fn ask_lease<M>(
    shared: &Arc<Shared>,
    tenant: &str,
    msg: M,
) -> Result<M::Result, ApiError>
where
    M: actix::Message + Send + Clone + 'static,
    M::Result: Send,
    crate::actors::TenantActor: actix::Handler<M>,
{
    match shared.store() {
        Store::Redis(_) => Ok(shared.ask(tenant, msg).await?),
        Store::Memory => shared
            .ask_existing(tenant, msg)
            .await?
            .ok_or_else(unknown_lease),
    }
}

/// Makes an admitted call a task: its lease lives `[tasks] lease_ttl`. Returns the poll interval
/// for the answer's `poll_interval_ms`.
///
/// The call is admitted whatever happens here. When its lease cannot be made a task (admitted
/// unchecked while the shared store was down, or the store stopped answering since), it is answered
/// with the shortest interval and keeps a call's lease, which the worker's renewals extend.
pub(super) async fn start(shared: &Arc<Shared>, tenant: &str, lease: u64) -> u64 {
    let started = ask_lease(shared, tenant, StartTask(lease)).await;
    match started {
        Ok(Ok(interval_ms)) => {
            shared.telemetry.tenant_event(TenantEvent::TaskStarted {
                tenant: Arc::from(tenant),
            });
            interval_ms
        }
        other => {
            let why = match other {
                Ok(Err(TaskError::Unavailable)) | Err(_) => "the shared store does not answer",
                _ => "its lease is not in the shared store",
            };
            tracing::warn!(
                tenant,
                "a call admitted as a task runs as a plain call: {why}"
            );
            ceil_ms(shared.config.load().tasks.poll_interval.as_nanos() as u64)
        }
    }
}

/// The 429 of an early poll: the contract's shed body, with the time until the poll is due.
fn early(wait_ns: u64) -> Response {
    let retry_after_ms = ceil_ms(wait_ns).max(1);
    let cx = RefusalContext {
        tool: "",
        upstream: None,
        shared_upstream: false,
        cost: 0.0,
        limit: 0.0,
        account_wide: false,
    };
    let shed = Shed {
        scope: Scope::TaskPoll,
        retry_after_ms,
        retryable: true,
        reason: refusal::reason(Scope::TaskPoll).to_string(),
        message: refusal::message(Scope::TaskPoll, retry_after_ms, &cx),
        spend: None,
    };
    let mut r = json(
        StatusCode::TOO_MANY_REQUESTS,
        &super::admit::shed_body(&shed),
    );
    r.headers_mut().insert(
        warp::http::header::RETRY_AFTER,
        HeaderValue::from(whole_seconds(retry_after_ms).max(1)),
    );
    r
}

pub async fn poll(app: &Arc<App>, bytes: bytes::Bytes) -> Result<Response, ApiError> {
    let b: PollBody = body::parse_json(&bytes)?;
    let (tenant, lease) = lease::decode(&b.lease_id).ok_or_else(unknown_lease)?;
    let answer = ask_lease(&app.shared, &tenant, PollTask(lease))
        .await?
        .map_err(task_error)?;
    let tenant: Arc<str> = Arc::from(tenant.as_str());
    Ok(match answer {
        PollAnswer::Due { interval_ms } => {
            app.shared.telemetry.tenant_event(TenantEvent::TaskPolled {
                tenant,
                admitted: true,
            });
            let mut out = Vec::with_capacity(32);
            out.extend_from_slice(b"{\"poll_interval_ms\":");
            out.extend_from_slice(itoa::Buffer::new().format(interval_ms).as_bytes());
            out.push(b'}');
            json_response(StatusCode::OK, out)
        }
        PollAnswer::Early { wait_ns } => {
            app.shared.telemetry.tenant_event(TenantEvent::TaskPolled {
                tenant,
                admitted: false,
            });
            early(wait_ns)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn an_early_poll_gets_the_shed_body_with_the_time_left() {
        let r = early(4_200 * 1_000_000 + 1);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()["retry-after"], "5");
        let body = futures_executor::block_on(r.into_body().collect())
            .unwrap()
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["admitted"], false);
        assert_eq!(v["scope"], "task_poll");
        assert_eq!(v["retry_after_ms"], 4_201);
        assert_eq!(v["retryable"], true);
        assert_eq!(v["tool_result"]["isError"], true);
        assert_eq!(v["tool_result"]["structuredContent"]["scope"], "task_poll");
        let text = v["tool_result"]["content"][0]["text"].as_str().unwrap();
        assert!(text.contains("Wait 5 seconds"), "{text}");
    }
}
