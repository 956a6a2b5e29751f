//! `GET /v1/edge/check`: the admission check for gateways (nginx `auth_request`, Envoy `ext_authz`).
//!
//! The gateway forwards the original request's headers without its body. This route turns them into
//! an answer the gateway acts on: 200 (let the request through), 429 (`Retry-After`), 401 or 400. In
//! order:
//!
//! 1. The client address (the configured header, as the gateway set it) must not be over its
//!    failed-authentication limit; if it is, 429 before the credential is even looked at, so a
//!    source guessing keys learns nothing more. This limit lives here, in its own table, and never
//!    touches a tenant's budget: a stranger's failures cannot shed a tenant's calls.
//! 2. The credential (`Authorization: Bearer`, else `X-Api-Key`) must be a configured API key (by
//!    its SHA-256, compared in constant time) or a valid JWT; it yields the tenant and subject.
//!    It comes before the protocol version: a client without a credential falls back to older
//!    handshakes, and must hear that its credential is missing, not that its revision is old.
//! 3. `MCP-Protocol-Version` must be at least `[edge] min_protocol_version`: the gateway limits on
//!    the mirrored `Mcp-Method` / `Mcp-Name` headers, which only that revision makes servers check
//!    against the body.
//! 4. For a metered method (`tools/call` unless configured otherwise), the call is admitted on the
//!    tool named by `Mcp-Name`, without waiting: the gateway holds the client's request meanwhile.
//!
//! How an edge admission counts: the gateway never releases a lease, so an edge admission is
//! rate-only. It spends the same rate buckets and daily quota as `POST /v1/admit` (one budget per
//! key, whichever layer asks), is refused by the upstream penalty box, the adaptive throttle and by
//! concurrency slots that in-server leases fill, and its lease ends at once: it holds no slot.
//! Concurrency is the in-server check's job. A credential never leaves this module: it is neither
//! logged, nor put in a metric label, nor echoed.

use std::sync::Arc;

use compact_str::CompactString;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use warp::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use warp::reply::{Reply, Response};

use super::edge_answer::{self, Refusal};
use super::error::ApiError;
use super::{admit, json, name_field, App};
use crate::actors::{AdmitReply, CancelWaiter, EndEdgeLease};
use crate::clock::{Nanos, NS_PER_SEC};
use crate::config::{EdgeConfig, JwtConfig, JwtKeys};
use crate::engine::{AdmitRequest, Verdict};
use crate::telemetry::names::EDGE_CHECKS;

/// The route; Envoy appends the original path to it (`/v1/edge/check/mcp`), which is the same check.
pub const PATH: &str = "/v1/edge/check";

/// Whether a request path is the edge check's.
pub fn is_edge_path(path: &str) -> bool {
    path.strip_prefix(PATH)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Addresses remembered by the failed-authentication table at most. Past it, addresses whose
/// allowance is back to full are forgotten; if none is, further addresses share one allowance, so
/// the table's memory is bounded whatever a flood of sources does.
const MAX_ADDRESSES: usize = 65_536;
/// The longest client address kept as a key; a longer header value is cut.
const MAX_ADDRESS_LEN: usize = 64;
/// The shared key for addresses that do not fit the table, and for requests without the header.
const OVERFLOW: &str = "\u{0}overflow";

/// Failed authentications per client address: a token bucket each, refilled at
/// `[edge] failed_auth_rate` up to `failed_auth_burst`. One mutex is enough: only failed and
/// blocked checks write to it, and each holds it for a map lookup.
#[derive(Default)]
pub struct FailedAuth {
    table: parking_lot::Mutex<std::collections::HashMap<String, Allowance>>,
}

#[derive(Clone, Copy)]
struct Allowance {
    tokens: f64,
    at: Nanos,
}

impl Allowance {
    fn now(self, now: Nanos, per_sec: f64, burst: f64) -> f64 {
        let elapsed = now.saturating_sub(self.at) as f64 / NS_PER_SEC as f64;
        (self.tokens + elapsed * per_sec).min(burst)
    }
}

impl FailedAuth {
    /// How long `addr` must wait before its next attempt, when it has no failure left to spend.
    pub fn blocked(&self, addr: &str, now: Nanos, per_sec: f64, burst: f64) -> Option<u64> {
        let table = self.table.lock();
        let tokens = table.get(addr)?.now(now, per_sec, burst);
        (tokens < 1.0).then(|| ((1.0 - tokens) / per_sec * NS_PER_SEC as f64).ceil() as u64)
    }

    /// Spends one failure of `addr`.
    pub fn failed(&self, addr: &str, now: Nanos, per_sec: f64, burst: f64) {
        let mut table = self.table.lock();
        let key = if table.contains_key(addr) || table.len() < MAX_ADDRESSES {
            addr
        } else {
            table.retain(|_, a| a.now(now, per_sec, burst) < burst);
            if table.len() < MAX_ADDRESSES {
                addr
            } else {
                OVERFLOW
            }
        };
        let a = table.entry(key.to_string()).or_insert(Allowance {
            tokens: burst,
            at: now,
        });
        let tokens = a.now(now, per_sec, burst);
        *a = Allowance {
            tokens: (tokens - 1.0).max(0.0),
            at: now,
        };
    }
}

/// The caller's address as the gateway put it in the configured header: its first comma-separated
/// item (the client's own hop in `X-Forwarded-For`).
fn client_address<'a>(h: &'a HeaderMap, header: &str) -> &'a str {
    let Some(v) = h.get(header).and_then(|v| v.to_str().ok()) else {
        return OVERFLOW;
    };
    let first = v.split(',').next().unwrap_or("").trim();
    if first.is_empty() {
        return OVERFLOW;
    }
    match first.char_indices().nth(MAX_ADDRESS_LEN) {
        Some((cut, _)) => &first[..cut],
        None => first,
    }
}

/// The credential: a bearer token, else an `X-Api-Key`. `Err` when an `Authorization` header is
/// there but is not a bearer token.
fn credential(h: &HeaderMap) -> Result<Option<&str>, ()> {
    if let Some(v) = h.get(warp::http::header::AUTHORIZATION) {
        let s = v.to_str().map_err(|_| ())?;
        let (scheme, token) = s.trim().split_once(' ').ok_or(())?;
        if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
            return Err(());
        }
        return Ok(Some(token.trim()));
    }
    match h.get("x-api-key").map(|v| v.to_str()) {
        Some(Ok(k)) if !k.trim().is_empty() => Ok(Some(k.trim())),
        Some(_) => Err(()),
        None => Ok(None),
    }
}

/// The `(tenant, subject)` a credential stands for.
pub(super) fn identify(cfg: &EdgeConfig, token: &str) -> Option<(String, String)> {
    let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    // Every key is compared, whichever matches: the time taken says nothing about which one did.
    let mut found = None;
    for key in &cfg.api_keys {
        if bool::from(key.sha256.ct_eq(&digest)) {
            found = Some(key);
        }
    }
    if let Some(k) = found {
        return Some((k.tenant.clone(), k.subject.clone()));
    }
    let jwt = cfg.jwt.as_ref()?;
    (token.bytes().filter(|b| *b == b'.').count() == 2)
        .then(|| verify_jwt(jwt, token))
        .flatten()
}

/// A JWT's tenant and subject, when its signature, algorithm, issuer, audience, expiry and
/// not-before all check out and both claims are valid names.
fn verify_jwt(jwt: &JwtConfig, token: &str) -> Option<(String, String)> {
    use jsonwebtoken::{decode, decode_header, DecodingKey, Validation};
    let header = decode_header(token).ok()?;
    // Only the configured algorithm: a token cannot pick a weaker one (or HS256 keyed with a
    // public key).
    if header.alg != jwt.algorithm {
        return None;
    }
    let key = match &jwt.keys {
        JwtKeys::Hmac(secret) => DecodingKey::from_secret(secret.bytes()),
        JwtKeys::Jwks(set) => {
            let jwk = match header.kid.as_deref() {
                Some(kid) => set.find(kid)?,
                None if set.keys.len() == 1 => &set.keys[0],
                None => return None,
            };
            DecodingKey::from_jwk(jwk).ok()?
        }
    };
    let mut v = Validation::new(jwt.algorithm);
    v.set_issuer(&[&jwt.issuer]);
    v.set_audience(&[&jwt.audience]);
    v.set_required_spec_claims(&["exp", "iss", "aud"]);
    v.validate_exp = true;
    v.validate_nbf = true;
    v.leeway = jwt.leeway.as_secs();
    let data = decode::<serde_json::Map<String, serde_json::Value>>(token, &key, &v).ok()?;
    let claim = |name: &str| -> Option<String> {
        let s = data.claims.get(name)?.as_str()?;
        crate::config::check_name(s).ok()?;
        Some(s.to_string())
    };
    Some((claim(&jwt.tenant_claim)?, claim(&jwt.subject_claim)?))
}

fn counted(result: &'static str) {
    metrics::counter!(EDGE_CHECKS, "result" => result).increment(1);
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// Why a header is not there: absent, or present with bytes that are not visible ASCII.
fn absent(h: &HeaderMap, name: &str, shown: &str) -> String {
    match h.get(name) {
        Some(v) if v.to_str().is_err() => format!("{shown} is not visible ASCII"),
        _ => format!("{shown} is missing"),
    }
}

/// An MCP revision: `YYYY-MM-DD` with a month from 01 to 12 and a day from 01 to 31.
fn is_revision(v: &str) -> bool {
    let b = v.as_bytes();
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    if b.len() != 10
        || b[4] != b'-'
        || b[7] != b'-'
        || !digits(0..4)
        || !digits(5..7)
        || !digits(8..10)
    {
        return false;
    }
    let month: u8 = v[5..7].parse().unwrap_or(0);
    let day: u8 = v[8..10].parse().unwrap_or(0);
    (1..=12).contains(&month) && (1..=31).contains(&day)
}

/// A refusal of the check: the plain answer (a JSON error or the contract's shed body, with its
/// headers), and what its JSON-RPC answer is made from (`edge_answer`).
pub struct Refused {
    plain: Response,
    refusal: Refusal,
}

impl Refused {
    fn from_error(e: ApiError) -> Self {
        let refusal = Refusal::new(e.status, e.code, e.message.clone());
        Refused {
            plain: e.into_response(),
            refusal,
        }
    }
}

/// A 400 for the request's MCP headers; `error` is the JSON-RPC answer's kind
/// (`header_mismatch` or `unsupported_protocol_version`), the plain answer stays `invalid_request`.
fn bad_request(error: &str, message: String) -> Refused {
    counted("bad_request");
    let refusal = Refusal::new(StatusCode::BAD_REQUEST, error, message.clone());
    Refused {
        plain: ApiError::invalid(message).into_response(),
        refusal,
    }
}

static TENANT: HeaderName = HeaderName::from_static("x-admitd-tenant");
static SUBJECT: HeaderName = HeaderName::from_static("x-admitd-subject");

/// Answers one edge check. `headers` are the forwarded request's; `method` is the check request's
/// own (Envoy sends the original method, nginx's subrequests are GETs and say the original in
/// `X-Original-Method`). `body` is the original request's body when the gateway sends it (Envoy's
/// `with_request_body`): a refusal is then answered in JSON-RPC at once, as the MCP server would
/// have answered; without one, the refusal travels in the `X-Admitd-Answer` header for
/// `POST /v1/edge/refusal` (see `edge_answer`).
pub async fn check(
    app: &Arc<App>,
    method: &Method,
    headers: Option<Box<HeaderMap>>,
    body: Option<bytes::Bytes>,
) -> Response {
    let h = headers.unwrap_or_default();
    // Envoy says so when it cut the body at max_request_bytes: the id may be in the part cut off.
    let partial = header(&h, "x-envoy-auth-partial-body") == Some("true");
    let body = body.filter(|b| !partial && !b.iter().all(u8::is_ascii_whitespace));
    match decide(app, method, &h).await {
        Ok(r) => r,
        Err(Refused { mut plain, refusal }) => match body {
            Some(body) => {
                let a = edge_answer::answer(&refusal, &body, header(&h, "mcp-protocol-version"));
                // A gateway lets through what its check answers 200: the refusal keeps its own
                // status (Envoy's local_reply_config turns a 429 back into the 200 a server gives).
                let status = if a.status == StatusCode::OK {
                    StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
                } else {
                    a.status
                };
                let mut r = edge_answer::render(&edge_answer::Answer {
                    status,
                    body: a.body,
                });
                for (name, value) in plain.headers() {
                    if name != warp::http::header::CONTENT_TYPE
                        && name != warp::http::header::CONTENT_LENGTH
                    {
                        r.headers_mut().append(name, value.clone());
                    }
                }
                r
            }
            None => {
                if let Some(v) = refusal.header_value() {
                    plain
                        .headers_mut()
                        .insert(HeaderName::from_static(edge_answer::ANSWER_HEADER), v);
                }
                plain
            }
        },
    }
}

async fn decide(app: &Arc<App>, method: &Method, h: &HeaderMap) -> Result<Response, Refused> {
    let cfg = app.shared.config.load_full();
    let Some(edge) = cfg.edge.as_ref() else {
        return Err(Refused::from_error(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "the edge check is off: add an [edge] section to the config to turn it on",
        )));
    };
    let now = app.shared.clock.mono();
    let (per_sec, burst) = (
        edge.failed_auth_rate.per_sec,
        f64::from(edge.failed_auth_burst),
    );

    let addr = client_address(h, &edge.client_address_header);
    if let Some(wait_ns) = app.edge.blocked(addr, now, per_sec, burst) {
        counted("auth_limited");
        return Err(failed_auth_limited(wait_ns, edge));
    }

    let identity = match credential(h) {
        Ok(Some(token)) => identify(edge, token),
        _ => None,
    };
    let Some((tenant, subject)) = identity else {
        app.edge.failed(addr, now, per_sec, burst);
        counted("unauthorized");
        tracing::debug!(client = addr, "edge check: no valid credential");
        let mut refused = Refused::from_error(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "no valid credential: send Authorization: Bearer <key or JWT>, or X-Api-Key: <key>",
        ));
        refused.plain.headers_mut().insert(
            warp::http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"admitd\""),
        );
        return Err(refused);
    };

    let min = &edge.min_protocol_version;
    let old = "unsupported_protocol_version";
    match header(h, "mcp-protocol-version") {
        None => {
            let why = absent(h, "mcp-protocol-version", "MCP-Protocol-Version");
            return Err(bad_request(old, format!(
                "{why}; the edge check needs MCP revision {min} or later, whose servers check the Mcp-Method and Mcp-Name headers against the body"
            )));
        }
        Some(v) if !is_revision(v) => {
            return Err(bad_request(
                old,
                format!("MCP-Protocol-Version {v:?} is not an MCP revision (YYYY-MM-DD, such as {min})"),
            ))
        }
        Some(v) if v < min.as_str() => {
            return Err(bad_request(old, format!(
                "MCP-Protocol-Version {v:?} is older than {min}, the first revision whose servers check the Mcp-Method and Mcp-Name headers against the body; the gateway cannot limit on those headers before it"
            )))
        }
        Some(_) => {}
    }

    let original = header(h, "x-original-method").unwrap_or(method.as_str());
    let mismatch = "header_mismatch";
    let mcp_method = match header(h, "mcp-method") {
        Some(m) => m,
        // Streamable HTTP's GET (the event stream) and DELETE (end of session) carry no JSON-RPC
        // message, so no method to mirror.
        None if ["GET", "HEAD", "DELETE"].contains(&original) => "",
        None => {
            let why = absent(h, "mcp-method", "Mcp-Method");
            return Err(bad_request(mismatch, format!(
                "{why}: a request that carries an MCP message names its method in the Mcp-Method header"
            )));
        }
    };
    let mut r = if edge.budget_methods.iter().any(|m| m == mcp_method) {
        let Some(tool) = header(h, "mcp-name") else {
            let why = absent(h, "mcp-name", "Mcp-Name");
            return Err(bad_request(
                mismatch,
                format!("{why}: a {mcp_method} request names its tool in the Mcp-Name header"),
            ));
        };
        if let Err(e) = name_field("Mcp-Name", tool) {
            return Err(bad_request(mismatch, e.message));
        }
        Box::pin(admit_at_edge(app, &tenant, &subject, tool, now)).await?
    } else {
        counted("unmetered");
        json(
            StatusCode::OK,
            &serde_json::json!({"admitted": true, "metered": false}),
        )
    };
    for (name, value) in [(&TENANT, &tenant), (&SUBJECT, &subject)] {
        if let Ok(v) = HeaderValue::from_bytes(value.as_bytes()) {
            r.headers_mut().insert(name, v);
        }
    }
    Ok(r)
}

/// The 429 for a client address over its failed-authentication limit.
fn failed_auth_limited(wait_ns: u64, edge: &EdgeConfig) -> Refused {
    let secs = wait_ns.div_ceil(NS_PER_SEC).max(1);
    let mut refused = Refused::from_error(ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_failed_authentications",
        format!("too many failed authentications from this address; retry in {secs} seconds"),
    ));
    refused.refusal.retry_after_ms = Some(secs * 1000);
    let r = &mut refused.plain;
    let refill_secs = (f64::from(edge.failed_auth_burst) / edge.failed_auth_rate.per_sec).ceil();
    let h = r.headers_mut();
    h.insert(warp::http::header::RETRY_AFTER, HeaderValue::from(secs));
    if let Ok(v) = HeaderValue::from_str(&format!(
        "\"failed_auth\";q={};w={}",
        edge.failed_auth_burst, refill_secs as u64
    )) {
        h.insert("ratelimit-policy", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("\"failed_auth\";r=0;t={secs}")) {
        h.insert("ratelimit", v);
    }
    refused
}

/// The rate-only admission of an edge check (see the module doc): decided without waiting, its
/// lease ended at once.
async fn admit_at_edge(
    app: &Arc<App>,
    tenant: &str,
    subject: &str,
    tool: &str,
    started: Nanos,
) -> Result<Response, Refused> {
    let shared = &app.shared;
    let req = AdmitRequest {
        subject: CompactString::from(subject),
        tool: CompactString::from(tool),
        upstream: None,
        cost: None,
        max_wait_ns: 0,
        returning: false,
        spend: None,
    };
    let reply = shared
        .admit(tenant, req, started)
        .await
        .map_err(|e| Refused::from_error(e.into()))?;
    let (decision, tenant_name) = match reply {
        AdmitReply::Decided(d, name) => (d, name),
        AdmitReply::Late => {
            return Err(Refused::from_error(crate::actors::AskError::Timeout.into()))
        }
        AdmitReply::StoreDown => {
            return Err(Refused::from_error(ApiError::unavailable(
                "the shared state of the limits does not answer; retry the request",
            )))
        }
        // Never with no wait allowed; if it were, the caller is not held.
        AdmitReply::Queued { waiter, .. } => {
            shared.tell_existing(tenant, CancelWaiter(waiter));
            return Err(Refused::from_error(ApiError::unavailable(
                "the tenant's slots are all held; retry the request",
            )));
        }
    };
    let decision_ns = shared.clock.mono().saturating_sub(started);
    let (mut response, event) =
        admit::answer(tenant_name, &decision, None, None, decision_ns, 0, false);
    shared.telemetry.decision(event);
    match &decision.verdict {
        Verdict::Admitted(a) => {
            shared.tell_existing(tenant, EndEdgeLease(a.lease));
            counted("admitted");
            // The lease is over already: the body says what was admitted, without a lease id.
            let tightest = decision.tightest();
            let body = serde_json::json!({
                "admitted": true,
                "metered": true,
                "mode": a.mode.as_str(),
                "remaining": tightest.map(|t| t.remaining),
                "limit": tightest.map(|t| t.burst),
            });
            let mut fresh = json(StatusCode::OK, &body);
            std::mem::swap(fresh.headers_mut(), response.headers_mut());
            Ok(fresh)
        }
        Verdict::Shed(s) => {
            counted("shed");
            let refusal = Refusal {
                retry_after_ms: Some(s.retry_after_ms),
                tool_result: Some(admit::tool_result_json(s)),
                ..Refusal::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limited",
                    s.message.clone(),
                )
            };
            Err(Refused {
                plain: response,
                refusal,
            })
        }
    }
}

#[cfg(test)]
mod revision_tests {
    use super::*;

    #[test]
    fn a_revision_is_a_date_shape() {
        for ok in ["2026-07-28", "2025-03-26", "9999-12-31"] {
            assert!(is_revision(ok), "{ok}");
        }
        for bad in [
            "zzzzzzzzzz",
            "9999-99-99",
            "2026-13-01",
            "2026-07-32",
            "2026-7-28",
            "2026/07/28",
            "",
        ] {
            assert!(!is_revision(bad), "{bad}");
        }
    }

    #[test]
    fn a_header_that_is_not_text_is_not_called_missing() {
        let mut h = HeaderMap::new();
        assert_eq!(absent(&h, "mcp-name", "Mcp-Name"), "Mcp-Name is missing");
        h.insert("mcp-name", HeaderValue::from_bytes(b"\xff\xfe").unwrap());
        assert_eq!(
            absent(&h, "mcp-name", "Mcp-Name"),
            "Mcp-Name is not visible ASCII"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_and_its_envoy_suffixes() {
        assert!(is_edge_path("/v1/edge/check"));
        assert!(is_edge_path("/v1/edge/check/mcp"));
        assert!(!is_edge_path("/v1/edge/checks"));
        assert!(!is_edge_path("/v1/edge"));
    }

    #[test]
    fn failed_authentications_are_limited_per_address_and_refill() {
        let t = FailedAuth::default();
        let (rate, burst) = (1.0, 3.0);
        for _ in 0..3 {
            assert_eq!(t.blocked("10.0.0.1", 0, rate, burst), None);
            t.failed("10.0.0.1", 0, rate, burst);
        }
        assert_eq!(t.blocked("10.0.0.1", 0, rate, burst), Some(NS_PER_SEC));
        // Another address is not touched.
        assert_eq!(t.blocked("10.0.0.2", 0, rate, burst), None);
        // Half a second later, half a token: half a second to wait.
        assert_eq!(
            t.blocked("10.0.0.1", NS_PER_SEC / 2, rate, burst),
            Some(NS_PER_SEC / 2)
        );
        assert_eq!(t.blocked("10.0.0.1", NS_PER_SEC, rate, burst), None);
    }

    #[test]
    fn the_table_stays_bounded() {
        let t = FailedAuth::default();
        for i in 0..MAX_ADDRESSES + 10 {
            t.failed(&format!("a{i}"), 0, 1.0, 1.0);
        }
        assert!(t.table.lock().len() <= MAX_ADDRESSES + 1);
        // The addresses past the table share one allowance, which is spent.
        assert!(t.blocked(OVERFLOW, 0, 1.0, 1.0).is_some());
        // Once refilled, old entries are forgotten to make room.
        t.failed("late", 10 * NS_PER_SEC, 1.0, 1.0);
        assert!(t.blocked("late", 10 * NS_PER_SEC, 1.0, 1.0).is_some());
    }

    #[test]
    fn client_addresses_and_credentials_are_read_from_the_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(client_address(&h, "x-forwarded-for"), OVERFLOW);
        h.insert(
            "x-forwarded-for",
            HeaderValue::from_static(" 203.0.113.7 , 10.0.0.1"),
        );
        assert_eq!(client_address(&h, "x-forwarded-for"), "203.0.113.7");
        assert_eq!(credential(&h), Ok(None));
        h.insert("x-api-key", HeaderValue::from_static("k1"));
        assert_eq!(credential(&h), Ok(Some("k1")));
        h.insert("authorization", HeaderValue::from_static("Bearer  k2 "));
        assert_eq!(credential(&h), Ok(Some("k2")));
        h.insert("authorization", HeaderValue::from_static("Basic a2V5Og=="));
        assert_eq!(credential(&h), Err(()));
    }

    fn edge_with_key(key: &str) -> EdgeConfig {
        EdgeConfig {
            api_keys: vec![crate::config::ApiKey {
                sha256: Sha256::digest(key.as_bytes()).into(),
                tenant: "acme".into(),
                subject: "acme-bot".into(),
            }],
            ..EdgeConfig::default()
        }
    }

    #[test]
    fn api_keys_match_by_hash() {
        let edge = edge_with_key("s3cret-key");
        assert_eq!(
            identify(&edge, "s3cret-key"),
            Some(("acme".into(), "acme-bot".into()))
        );
        assert_eq!(identify(&edge, "s3cret-kez"), None);
        assert_eq!(identify(&edge, ""), None);
    }

    fn hs256(secret: &[u8]) -> JwtConfig {
        JwtConfig {
            algorithm: jsonwebtoken::Algorithm::HS256,
            keys: JwtKeys::Hmac(test_secret(secret)),
            issuer: "https://auth.example".into(),
            audience: "mcp".into(),
            tenant_claim: "org".into(),
            subject_claim: "sub".into(),
            leeway: std::time::Duration::from_secs(0),
        }
    }

    fn test_secret(bytes: &[u8]) -> crate::config::Secret {
        // Built through the config, the only way a secret is made.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, bytes).unwrap();
        let text = format!(
            "[edge.jwt]\nalgorithm = \"HS256\"\nissuer = \"i\"\naudience = \"a\"\nsecret_file = {:?}\n",
            f.display().to_string()
        );
        let c = crate::config::Config::parse("t.toml", &text).unwrap();
        match c.edge.unwrap().jwt.unwrap().keys {
            JwtKeys::Hmac(s) => s,
            JwtKeys::Jwks(_) => unreachable!(),
        }
    }

    fn token(secret: &[u8], alg: jsonwebtoken::Algorithm, claims: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(alg),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret),
        )
        .unwrap()
    }

    #[test]
    fn jwts_are_checked_for_signature_issuer_audience_and_time() {
        let secret = b"0123456789abcdef0123456789abcdef";
        let edge = EdgeConfig {
            jwt: Some(hs256(secret)),
            ..EdgeConfig::default()
        };
        let now = jsonwebtoken::get_current_timestamp();
        let good = serde_json::json!({"iss": "https://auth.example", "aud": "mcp", "exp": now + 60, "sub": "bot-1", "org": "acme"});
        let hs = jsonwebtoken::Algorithm::HS256;
        assert_eq!(
            identify(&edge, &token(secret, hs, good.clone())),
            Some(("acme".into(), "bot-1".into()))
        );
        let with = |k: &str, v: serde_json::Value| {
            let mut c = good.clone();
            c[k] = v;
            c
        };
        let refused = [
            token(b"another-secret-another-secret-xx", hs, good.clone()),
            token(secret, hs, with("iss", "https://evil.example".into())),
            token(secret, hs, with("aud", "other".into())),
            token(secret, hs, with("exp", (now - 60).into())),
            token(secret, hs, with("nbf", (now + 600).into())),
            token(secret, hs, with("org", serde_json::Value::Null)),
            token(secret, hs, with("sub", "".into())),
            // A different algorithm than the configured one.
            token(secret, jsonwebtoken::Algorithm::HS384, good.clone()),
        ];
        for t in refused {
            assert_eq!(identify(&edge, &t), None);
        }
        let mut no_exp = good.clone();
        no_exp.as_object_mut().unwrap().remove("exp");
        assert_eq!(identify(&edge, &token(secret, hs, no_exp)), None);
    }
}
