//! Who may call which route: caller tokens for the admission routes and tenant snapshots, an admin
//! token for `/v1/admin/*`, an optional metrics token for `/metrics` and `/v1/alerts`.
//!
//! Tokens arrive as `Authorization: Bearer TOKEN` and are compared as SHA-256 digests against the
//! configured ones ([`crate::config::ServerAuth`]), in constant time and against every configured
//! digest, so neither the answer's timing nor its text tells a caller how close a guess was. The
//! answers name no token, digest, address or config value.
//!
//! The live view (`GET /v1/tenants` and the status page `GET /`) is guarded like `/metrics`: open
//! when no metrics token is configured, else the metrics or the admin token shows every tenant, and
//! a tenant's own credential (an `[edge]` API key or JWT) shows that tenant alone, so a customer
//! given its own view never sees another tenant's name. Browsers cannot send a bearer token to a
//! page they open, so the status page also takes the token as the password of HTTP Basic
//! authentication (any user name).
//!
//! `/healthz` and `/readyz` are always open: probes carry no credentials. The admin routes are closed
//! (403) when no admin token is configured, unless the daemon listens on a Unix socket only, where
//! the socket file's permissions already decide who can connect. `/v1/edge/check` authenticates its
//! callers itself (`[edge]` keys) and is not gated here.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use warp::http::{HeaderValue, StatusCode};

use super::error::ApiError;
use crate::config::server_auth::TokenDigest;
use crate::config::{Config, ServerAuth};

/// What a route needs from its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Health and readiness probes, the edge check, unknown routes.
    Open,
    /// `/v1/admit`, `/v1/release`, `/v1/feedback`, `/v1/tenants/*`.
    Caller,
    /// `/v1/admin/*`, `/v1/advice`.
    Admin,
    /// `/metrics`, `/v1/alerts`.
    Metrics,
    /// `/v1/tenants` and `/`: checked by the route itself ([`viewer`]), which needs to know whose
    /// tenants the caller may see.
    Live,
}

/// The class of a path (whatever the method: a wrong method is refused only once the caller has
/// shown it may use the route).
pub fn class(path: &str) -> Class {
    match path {
        "/v1/admit" | "/v1/release" | "/v1/feedback" | "/v1/tasks/poll" | "/v1/renew" => {
            Class::Caller
        }
        "/metrics" | "/v1/alerts" => Class::Metrics,
        "/v1/tenants" | "/" => Class::Live,
        p if p.starts_with("/v1/tenants/") => Class::Caller,
        // The advice carries the config file's text: who may read it is who may reload it.
        "/v1/advice" => Class::Admin,
        p if p.starts_with("/v1/admin/") => Class::Admin,
        _ => Class::Open,
    }
}

/// The token in an `Authorization: Bearer TOKEN` header.
fn bearer(header: Option<&HeaderValue>) -> Option<&[u8]> {
    let v = header?.as_bytes();
    let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `token` hashes to one of `digests`. Every digest is compared, in constant time.
fn matches(token: &[u8], digests: &[TokenDigest]) -> bool {
    let presented: [u8; 32] = Sha256::digest(token).into();
    let mut found = subtle::Choice::from(0u8);
    for d in digests {
        found |= presented.ct_eq(d);
    }
    found.into()
}

fn unauthorized(message: &'static str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
}

/// Checks the caller's token for a route of `class`. `unix_only`: the daemon listens on a Unix
/// socket only.
pub fn check(
    auth: &ServerAuth,
    class: Class,
    header: Option<&HeaderValue>,
    unix_only: bool,
) -> Result<(), ApiError> {
    let needed: &[TokenDigest] = match class {
        Class::Open | Class::Live => return Ok(()),
        Class::Caller if auth.api_tokens.is_empty() => return Ok(()),
        Class::Caller => &auth.api_tokens,
        Class::Metrics => match &auth.metrics_token {
            None => return Ok(()),
            Some(d) => std::slice::from_ref(d),
        },
        Class::Admin => match &auth.admin_token {
            None if unix_only => return Ok(()),
            None => {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "forbidden",
                    "the admin routes are turned off: configure an admin token (server.admin_token_sha256), or listen on a Unix socket only",
                ))
            }
            Some(d) => std::slice::from_ref(d),
        },
    };
    match bearer(header) {
        None => Err(unauthorized(
            "this route needs a token: send Authorization: Bearer <token>",
        )),
        Some(token) if matches(token, needed) => Ok(()),
        Some(_) => Err(unauthorized("the token is not accepted for this route")),
    }
}

/// Whose tenants a caller of the live view may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Viewer {
    All,
    /// Only this tenant: the caller showed that tenant's own credential.
    Tenant(String),
}

/// The token of an `Authorization` header: a bearer token, or the password of HTTP Basic
/// authentication (what a browser sends for a page).
fn bearer_or_basic(header: Option<&HeaderValue>) -> Option<Vec<u8>> {
    if let Some(t) = bearer(header) {
        return Some(t.to_vec());
    }
    let v = header?.as_bytes();
    let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"basic") {
        return None;
    }
    let decoded = base64_decode(rest.trim_ascii())?;
    let colon = decoded.iter().position(|b| *b == b':')?;
    let password = decoded[colon + 1..].to_vec();
    (!password.is_empty()).then_some(password)
}

/// Standard base64 with padding (RFC 4648), as HTTP Basic authentication sends it.
fn base64_decode(s: &[u8]) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    }
    if s.len() % 4 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for chunk in s.chunks(4) {
        let pad = chunk.iter().rev().take_while(|c| **c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut n = 0u32;
        for c in &chunk[..4 - pad] {
            n = (n << 6) | value(*c)?;
        }
        n <<= 6 * pad as u32;
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Some(out)
}

/// Who may see what of the live view (see the module's doc). `identify` turns a tenant's own
/// credential into its tenant (the `[edge]` keys), when any are configured.
pub fn viewer(
    auth: &ServerAuth,
    header: Option<&HeaderValue>,
    identify: impl FnOnce(&str) -> Option<String>,
) -> Result<Viewer, ApiError> {
    let Some(metrics) = &auth.metrics_token else {
        return Ok(Viewer::All);
    };
    let Some(token) = bearer_or_basic(header) else {
        return Err(unauthorized(
            "this route needs a token: send Authorization: Bearer <token>",
        ));
    };
    let operators: Vec<TokenDigest> = std::iter::once(*metrics).chain(auth.admin_token).collect();
    if matches(&token, &operators) {
        return Ok(Viewer::All);
    }
    std::str::from_utf8(&token)
        .ok()
        .and_then(identify)
        .map(Viewer::Tenant)
        .ok_or_else(|| unauthorized("the token is not accepted for this route"))
}

/// Logs a warning at start when the daemon can be reached from other machines and no caller token
/// is configured: anyone who can reach the port can then spend any tenant's budget.
pub fn warn_if_exposed(config: &Config) {
    let listen = &config.server.listen;
    if !listen.is_local() && !config.server.auth.callers_need_token() {
        tracing::warn!(
            listen = %listen,
            "admitd listens on an address other machines can reach and no caller token is configured (server.api_tokens_sha256): anyone who reaches it can spend any tenant's budget"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(token: &str) -> [u8; 32] {
        Sha256::digest(token.as_bytes()).into()
    }

    fn auth() -> ServerAuth {
        ServerAuth {
            api_tokens: vec![digest("caller-one"), digest("caller-two")],
            admin_token: Some(digest("the-admin")),
            metrics_token: None,
        }
    }

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    #[test]
    fn routes_fall_in_their_classes() {
        assert_eq!(class("/v1/admit"), Class::Caller);
        assert_eq!(class("/v1/tenants/acme"), Class::Caller);
        assert_eq!(class("/v1/tasks/poll"), Class::Caller);
        assert_eq!(class("/v1/renew"), Class::Caller);
        assert_eq!(class("/v1/admin/reload"), Class::Admin);
        assert_eq!(
            class("/v1/advice"),
            Class::Admin,
            "it carries the config file"
        );
        assert_eq!(class("/metrics"), Class::Metrics);
        assert_eq!(class("/v1/alerts"), Class::Metrics);
        assert_eq!(class("/healthz"), Class::Open);
        assert_eq!(class("/readyz"), Class::Open);
        assert_eq!(class("/v1/edge/check"), Class::Open);
        assert_eq!(class("/v1/tenants"), Class::Live);
        assert_eq!(class("/"), Class::Live);
    }

    #[test]
    fn caller_tokens_are_checked_by_their_digest() {
        let a = auth();
        for t in [
            "Bearer caller-one",
            "bearer caller-two",
            "BEARER  caller-one ",
        ] {
            assert_eq!(check(&a, Class::Caller, Some(&hv(t)), false), Ok(()), "{t}");
        }
        for t in [
            "Bearer caller-three",
            "Basic caller-one",
            "caller-one",
            "Bearer ",
            "Bearer the-admin",
        ] {
            let e = check(&a, Class::Caller, Some(&hv(t)), false).unwrap_err();
            assert_eq!(
                (e.status, e.code),
                (StatusCode::UNAUTHORIZED, "unauthorized"),
                "{t}"
            );
            assert!(!e.message.contains("caller"), "{}", e.message);
        }
        assert!(check(&a, Class::Caller, None, false).is_err());
        // No caller tokens: the caller routes are open.
        assert_eq!(
            check(&ServerAuth::default(), Class::Caller, None, false),
            Ok(())
        );
    }

    #[test]
    fn admin_routes_need_their_own_token_or_a_unix_socket() {
        let a = auth();
        assert_eq!(
            check(&a, Class::Admin, Some(&hv("Bearer the-admin")), false),
            Ok(())
        );
        let e = check(&a, Class::Admin, Some(&hv("Bearer caller-one")), false).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        // A configured admin token is needed on a Unix socket as well.
        assert!(check(&a, Class::Admin, None, true).is_err());
        let none = ServerAuth::default();
        let e = check(&none, Class::Admin, Some(&hv("Bearer anything")), false).unwrap_err();
        assert_eq!((e.status, e.code), (StatusCode::FORBIDDEN, "forbidden"));
        assert_eq!(check(&none, Class::Admin, None, true), Ok(()));
    }

    #[test]
    fn metrics_are_open_unless_a_metrics_token_is_set() {
        assert_eq!(check(&auth(), Class::Metrics, None, false), Ok(()));
        let a = ServerAuth {
            metrics_token: Some(digest("scraper")),
            ..ServerAuth::default()
        };
        assert!(check(&a, Class::Metrics, None, false).is_err());
        assert_eq!(
            check(&a, Class::Metrics, Some(&hv("Bearer scraper")), false),
            Ok(())
        );
        assert_eq!(check(&a, Class::Open, None, false), Ok(()));
    }

    fn acme_key(token: &str) -> Option<String> {
        (token == "acme-key").then(|| "acme".to_string())
    }

    #[test]
    fn the_live_view_shows_everything_to_operators_and_a_tenant_only_itself() {
        let a = ServerAuth {
            metrics_token: Some(digest("scraper")),
            ..auth()
        };
        for t in ["Bearer scraper", "Bearer the-admin"] {
            assert_eq!(viewer(&a, Some(&hv(t)), acme_key), Ok(Viewer::All), "{t}");
        }
        assert_eq!(
            viewer(&a, Some(&hv("Bearer acme-key")), acme_key),
            Ok(Viewer::Tenant("acme".into()))
        );
        // A browser's Basic authentication: the token is the password ("admin:scraper").
        assert_eq!(
            viewer(&a, Some(&hv("Basic YWRtaW46c2NyYXBlcg==")), acme_key),
            Ok(Viewer::All)
        );
        for t in [
            "Bearer caller-one",
            "Bearer nope",
            "Basic !!!!",
            "Basic YWRtaW46",
        ] {
            let e = viewer(&a, Some(&hv(t)), acme_key).unwrap_err();
            assert_eq!(e.status, StatusCode::UNAUTHORIZED, "{t}");
        }
        assert!(viewer(&a, None, acme_key).is_err());
        // No metrics token: open, like /metrics.
        assert_eq!(viewer(&auth(), None, acme_key), Ok(Viewer::All));
    }

    #[test]
    fn base64_as_basic_authentication_sends_it() {
        assert_eq!(
            base64_decode(b"YWRtaW46c2NyYXBlcg==").unwrap(),
            b"admin:scraper"
        );
        assert_eq!(base64_decode(b"YTpi").unwrap(), b"a:b");
        assert_eq!(base64_decode(b"YTo=").unwrap(), b"a:");
        assert_eq!(base64_decode(b"YTo"), None);
        assert_eq!(base64_decode(b"Y==="), None);
        assert_eq!(base64_decode(b"YT*="), None);
    }
}
