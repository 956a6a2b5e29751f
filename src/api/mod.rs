//! The HTTP API (warp): parse and validate, ask the tenant's actor, map the decision to status, body and
//! headers. No admission logic lives here.
//!
//! Routing is one catch-all filter and a `match` on method and path rather than a tree of warp filters:
//! every failure, including unknown routes and wrong methods, must render the same JSON error body, and
//! a flat match makes that (and the cost of routing) obvious. [`service`] is what hyper serves: the
//! routes behind the headers they read, taken from the request beforehand.
//!
//! This file is the router. Each route lives in a file named after it (`admit.rs`, `release.rs`,
//! `feedback.rs`, `tenant.rs`, `tenants.rs`, `status.rs` (`GET /`), `ready.rs`, `reload.rs`,
//! `edge.rs`, `edge_answer.rs` for `/v1/edge/refusal`, `renew.rs`, `tasks.rs` for MCP task polls),
//! with its body's shape, its
//! checks and its answer; what several routes read alike is in `fields.rs`.

pub mod admit;
pub mod advice;
pub mod auth;
pub mod body;
pub mod edge;
pub mod edge_answer;
pub mod error;
pub mod feedback;
pub mod fields;
pub mod gate;
pub mod inflight;
pub mod lease;
pub mod overload;
pub mod policy_cache;
pub mod ready;
pub mod release;
pub mod reload;
pub mod renew;
pub mod retry_after;
pub mod spend;
pub mod status;
pub mod tasks;
pub mod tenant;
pub mod tenants;
pub mod unparsed;

use std::cell::Cell;
use std::sync::Arc;

use actix::Addr;
use bytes::Buf;
use futures_util::Stream;
use serde::Serialize;
use warp::http::{HeaderValue, Method, StatusCode};
use warp::reply::Response;
use warp::{Filter, Reply};

use crate::actors::global::GlobalActor;
use crate::actors::Shared;
pub use crate::names::check_name;
use error::ApiError;
pub use fields::name_field;
pub use reload::reload;

/// What the HTTP layer needs from the rest of the daemon.
pub struct App {
    pub shared: Arc<Shared>,
    pub global: Addr<GlobalActor>,
    /// Renders `GET /metrics`, when metrics are on.
    pub metrics: Option<Arc<dyn Fn() -> String + Send + Sync>>,
    /// Renders `GET /v1/alerts`, when the alert evaluator runs.
    pub alerts: Option<Arc<dyn Fn() -> serde_json::Value + Send + Sync>>,
    /// Failed edge authentications per client address (`GET /v1/edge/check`).
    pub edge: edge::FailedAuth,
}

/// A JSON response with the given status (the body as bytes: a `Vec<u8>`, or a static `&[u8]`).
pub fn json_response(status: StatusCode, body: impl Into<bytes::Bytes>) -> Response {
    let mut r = Response::new(body.into().into());
    *r.status_mut() = status;
    r.headers_mut().insert(
        warp::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => json_response(status, body),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("could not encode the answer: {e}"),
        )
        .into_response(),
    }
}

thread_local! {
    /// The headers of the request whose future is being polled on this thread, put here by
    /// [`WithHead`] for the routes to take.
    static HEAD: Cell<Option<body::Head>> = const { Cell::new(None) };
}

/// The API as hyper serves it: warp's service for `routes`, with two differences that matter for
/// speed.
///
/// - The headers the API reads ([`body::Head`]) are taken from the request before warp sees it.
///   warp's filters can only copy headers out: copying the whole map
///   (`warp::header::headers_cloned`) cost 4% of an admission's instructions, and reading each
///   header through a filter of its own still cost most of that, in the filters' futures and in
///   parsing the names.
/// - Each request's future lives in a box of its own. hyper keeps each connection's request future
///   in one place for the connection's life and moves every new request's future into it. warp's
///   future is over a kilobyte (the request and its route, the filters' state and the handler's),
///   and with many connections that place was last written a whole round of connections earlier:
///   with a thousand tenants' state passing through the cache in between, the move wrote a dozen
///   cache lines that had to be fetched first. A box is the allocator's most recently freed block
///   of that size, which is still in cache (last-level misses per request 146 + 71 → 139 + 58;
///   docs/BENCHMARKS.md).
pub fn service(
    app: Arc<App>,
) -> Service<
    impl tower_service::Service<
            warp::http::Request<hyper::body::Incoming>,
            Response = Response,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + Sync
        + 'static,
> {
    Service {
        traced: app.shared.telemetry.traces(),
        warp: warp::service(routes(app)),
    }
}

/// See [`service`].
#[derive(Clone)]
pub struct Service<S> {
    warp: S,
    traced: bool,
}

impl<S> hyper::service::Service<warp::http::Request<hyper::body::Incoming>> for Service<S>
where
    S: tower_service::Service<warp::http::Request<hyper::body::Incoming>> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = WithHead<S::Future>;

    fn call(&self, req: warp::http::Request<hyper::body::Incoming>) -> Self::Future {
        let mut head = body::Head::read(req.headers(), self.traced);
        // The edge check reads many headers, some named by the config: it gets a copy of them all.
        if edge::is_edge_path(req.uri().path()) || req.uri().path() == edge_answer::PATH {
            head.edge = Some(Box::new(req.headers().clone()));
        } else if req.uri().path() == advice::PATH
            || auth::class(req.uri().path()) == auth::Class::Live
        {
            // Only the advice and the live view read a query string: other requests do not copy
            // theirs.
            head.query = req.uri().query().map(Into::into);
        }
        WithHead {
            head: Some(head),
            // warp's service is always ready (its `poll_ready` returns `Ready` without looking).
            inner: Box::pin(self.warp.clone().call(req)),
        }
    }
}

/// A request's future, in a box of its own, and the headers its routes read: while they have not
/// taken them, they find them in `HEAD` whenever the future is polled. (tokio's task-local
/// future would do the same, but holds the future inline, which moved the kilobyte of warp's
/// future once more per request.)
///
/// It assumes a route reads `HEAD` only from inside its own request's future: the slot is filled
/// for the length of each poll and emptied after it, so no other request on the thread can see it
/// (`routes_find_their_head_on_whichever_poll_reads_it_and_no_other_request_does`). What it bought:
/// 26 326 → 25 000 instructions per admission against warp's `headers_cloned`
/// (`scripts/count.sh --tenants 1 --subjects 1`; docs/BENCHMARKS.md).
pub struct WithHead<F> {
    head: Option<body::Head>,
    inner: std::pin::Pin<Box<F>>,
}

impl<F: std::future::Future> std::future::Future for WithHead<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.get_mut();
        if this.head.is_none() {
            return this.inner.as_mut().poll(cx);
        }
        HEAD.set(this.head.take());
        let poll = this.inner.as_mut().poll(cx);
        // What the routes did not take stays with this request, not for the next one polled here.
        this.head = HEAD.take();
        poll
    }
}

/// The whole API as one warp filter, served by [`service`] (which gives it the request's headers).
fn routes(
    app: Arc<App>,
) -> impl Filter<Extract = (Response,), Error = warp::Rejection> + Clone + Send + Sync + 'static {
    warp::any()
        .and(warp::method())
        .and(warp::path::full())
        // Outside `service`, no headers: every body is refused for want of a content type.
        .and(warp::any().map(|| HEAD.take().unwrap_or(body::Head::NONE)))
        .and(warp::body::stream())
        .then(
            move |method: Method, path: warp::path::FullPath, head: body::Head, body| {
                let app = app.clone();
                async move {
                    let mut body = body::Tracked::new(body);
                    let mut answer =
                        match dispatch(&app, &method, path.as_str(), head, &mut body).await {
                            Ok(r) => r,
                            Err(e) => e.into_response(),
                        };
                    body::settle(&mut body, &mut answer).await;
                    answer
                }
            },
        )
}

async fn dispatch<S, B>(
    app: &Arc<App>,
    method: &Method,
    path: &str,
    head: body::Head,
    body: S,
) -> Result<Response, ApiError>
where
    S: Stream<Item = Result<B, warp::Error>> + Unpin,
    B: Buf,
{
    // HEAD is GET without the body (hyper leaves the body out), as HTTP asks of every GET route.
    let get = method == Method::GET || method == Method::HEAD;
    let post = method == Method::POST;
    let delete = method == Method::DELETE;
    let class = auth::class(path);
    let mut viewer = auth::Viewer::All;
    if class == auth::Class::Live {
        match tenants::viewer(app, &head) {
            Ok(v) => viewer = v,
            // A browser asks its user for the token of a page when told Basic.
            Err(e) => {
                return Ok(challenge(
                    e,
                    if path == "/" {
                        "Basic realm=\"admitd\""
                    } else {
                        "Bearer"
                    },
                ))
            }
        }
    } else if class != auth::Class::Open {
        let unix_only = app.shared.started.server.listen.is_unix();
        let checked = auth::check(
            &app.shared.config.load().server.auth,
            class,
            head.authorization.as_ref(),
            unix_only,
        );
        if let Err(e) = checked {
            return Ok(challenge(e, "Bearer"));
        }
    }
    match path {
        "/v1/admit" if post => {
            let bytes = json_body(&head, body).await?;
            admit::admit(app, head.traceparent, bytes).await
        }
        "/v1/release" if post => release::release(app, json_body(&head, body).await?).await,
        // The routes below are rare: their futures are boxed so that they do not make every
        // request's future (moved several times on its way into the connection task) larger.
        "/v1/feedback" if post => {
            Box::pin(feedback::feedback(app, json_body(&head, body).await?)).await
        }
        "/v1/tasks/poll" if post => Box::pin(tasks::poll(app, json_body(&head, body).await?)).await,
        "/v1/renew" if post => Box::pin(renew::renew(app, json_body(&head, body).await?)).await,
        "/healthz" if get => Ok(json(StatusCode::OK, &serde_json::json!({"status": "ok"}))),
        // Not ready from the moment shutdown starts, so a load balancer stops sending here.
        "/readyz" if get && app.shared.stopping() => Ok(json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"ready": false, "store": "memory", "reason": "shutting down"}),
        )),
        "/readyz" if get => Ok(ready::readiness(app)),
        "/metrics" if get && app.metrics.is_some() => {
            // Every decision answered before the scrape is in it.
            Box::pin(app.shared.telemetry.settle()).await;
            let text = app.metrics.as_ref().map(|f| f()).unwrap_or_default();
            let mut r = Response::new(text.into());
            r.headers_mut().insert(
                warp::http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            Ok(r)
        }
        "/v1/alerts" if get && app.alerts.is_some() => {
            let shared = &app.shared;
            Box::pin(shared.telemetry.refresh_alerts(shared.report_calls())).await;
            let v = app.alerts.as_ref().map(|f| f()).unwrap_or_default();
            Ok(json(StatusCode::OK, &v))
        }
        "/v1/admin/reload" if post => {
            // The route takes no body, but one over the limit is refused as anywhere else.
            body::read_limited(body).await?;
            Box::pin(reload::reload_answer(app)).await
        }
        // Any method: Envoy's ext_authz sends the original request's.
        "/v1/advice" if get => Box::pin(advice::advice(app, head.query.as_deref())).await,
        p if edge::is_edge_path(p) => {
            // Envoy's with_request_body sends the original body along; nginx's subrequest none.
            // One over the limit is answered as if absent: the refusal is then plain.
            let bytes = body::read_limited(body).await.ok();
            Ok(Box::pin(edge::check(app, method, head.edge, bytes)).await)
        }
        // nginx's error_page hands the refused request on as it came: a POST, or the GET of an
        // event stream or the DELETE that ends a session refused for their credential.
        "/v1/edge/refusal" if post || get || delete => {
            let bytes = body::read_limited(body).await.unwrap_or_default();
            edge_answer::refusal_route(head.edge.as_deref(), &bytes)
        }
        "/v1/tenants" if get => Box::pin(tenants::tenants(app, viewer, &head)).await,
        "/" if get => Box::pin(status::status_page(app, viewer, &head)).await,
        p if get && p.starts_with("/v1/tenants/") => {
            Box::pin(tenant::tenant_snapshot(app, &p["/v1/tenants/".len()..])).await
        }
        p => {
            let allow = match p {
                "/v1/admit" | "/v1/release" | "/v1/feedback" | "/v1/admin/reload"
                | "/v1/tasks/poll" | "/v1/renew" => Some("POST"),
                "/healthz" | "/readyz" | "/v1/advice" => Some("GET, HEAD"),
                "/v1/edge/refusal" => Some("GET, POST, DELETE, HEAD"),
                "/metrics" if app.metrics.is_some() => Some("GET, HEAD"),
                "/v1/alerts" if app.alerts.is_some() => Some("GET, HEAD"),
                "/v1/tenants" | "/" => Some("GET, HEAD"),
                p if p.starts_with("/v1/tenants/") => Some("GET, HEAD"),
                _ => None,
            };
            match allow {
                Some(allow) => {
                    let mut r = ApiError::new(
                        StatusCode::METHOD_NOT_ALLOWED,
                        "method_not_allowed",
                        format!("{p} accepts {allow} only"),
                    )
                    .into_response();
                    r.headers_mut()
                        .insert(warp::http::header::ALLOW, HeaderValue::from_static(allow));
                    Ok(r)
                }
                None => Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("no route {p}"),
                )),
            }
        }
    }
}

/// An authentication failure's answer, with the scheme to authenticate with when it is a 401.
fn challenge(e: ApiError, scheme: &'static str) -> Response {
    let unauthorized = e.status == StatusCode::UNAUTHORIZED;
    let mut r = e.into_response();
    if unauthorized {
        r.headers_mut().insert(
            warp::http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static(scheme),
        );
    }
    r
}

async fn json_body<S, B>(head: &body::Head, mut body: S) -> Result<bytes::Bytes, ApiError>
where
    S: Stream<Item = Result<B, warp::Error>> + Unpin,
    B: Buf,
{
    if let Err(e) = body::check_headers(head) {
        if e.status == StatusCode::PAYLOAD_TOO_LARGE {
            body::drain(&mut body).await;
        }
        return Err(e);
    }
    body::read_limited(body).await
}

#[cfg(test)]
mod with_head_tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll, Waker};

    /// A request's future that takes the head on its `take_on`th poll.
    struct TakesOn {
        take_on: u32,
        polls: u32,
    }

    impl Future for TakesOn {
        type Output = Option<body::Head>;
        fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
            self.polls += 1;
            if self.polls == self.take_on {
                Poll::Ready(HEAD.take())
            } else {
                Poll::Pending
            }
        }
    }

    #[test]
    fn routes_find_their_head_on_whichever_poll_reads_it_and_no_other_request_does() {
        let mut map = warp::http::HeaderMap::new();
        map.insert("content-type", HeaderValue::from_static("application/json"));
        let head = body::Head::read(&map, false);
        assert_ne!(head, body::Head::NONE);
        let mut f = WithHead {
            head: Some(head.clone()),
            inner: Box::pin(TakesOn {
                take_on: 3,
                polls: 0,
            }),
        };
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..2 {
            assert!(Pin::new(&mut f).poll(&mut cx).is_pending());
            // Between polls the thread holds nothing: another request polled now finds no head.
            assert_eq!(HEAD.take(), None);
        }
        assert_eq!(Pin::new(&mut f).poll(&mut cx), Poll::Ready(Some(head)));
        assert_eq!(HEAD.take(), None);
    }
}
