//! `GET /v1/tenants`: every tenant with state, most-shed first (or by `sort=`), a page at a time.
//!
//! The rows come from the alert actor's per-tenant windows (`telemetry::live`), not from the tenant
//! actors: one message to one actor whatever the number of tenants, answered by a linear selection
//! over its table. The caller's token decides whose tenants it sees ([`super::auth::viewer`]): a
//! tenant's own credential shows that tenant alone, so no other tenant's name reaches it.

use std::sync::Arc;

use serde::Serialize;
use warp::http::StatusCode;
use warp::reply::Response;

use super::auth::{self, Viewer};
use super::body::Head;
use super::fields::percent_decode;
use super::{json, ApiError, App};
use crate::telemetry::live::{Cursor, SortField, TenantRow, TenantsPage, TenantsQuery};

/// Rows per page unless `limit=` says otherwise.
pub const DEFAULT_LIMIT: usize = 100;
/// The most rows one page holds.
pub const MAX_LIMIT: usize = 1000;

/// Whose tenants the caller may see, from its `Authorization` header.
pub fn viewer(app: &App, head: &Head) -> Result<Viewer, ApiError> {
    let config = app.shared.config.load();
    auth::viewer(&config.server.auth, head.authorization.as_ref(), |token| {
        let edge = config.edge.as_ref()?;
        super::edge::identify(edge, token).map(|(tenant, _)| tenant)
    })
}

/// The `sort`, `limit` (`default_limit` when absent) and `next` parameters of a query string.
pub fn parse_query(
    query: Option<&str>,
    default_limit: usize,
) -> Result<(SortField, usize, Option<Cursor>), ApiError> {
    let (mut sort, mut limit, mut next) = (SortField::ShedRatio, default_limit, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, raw) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(raw).ok_or_else(|| {
            ApiError::invalid(format!("{name} is not valid percent-encoded UTF-8"))
        })?;
        match name {
            "sort" => {
                sort = SortField::parse(&value).ok_or_else(|| {
                    let known: Vec<_> = SortField::ALL.iter().map(|f| f.as_str()).collect();
                    ApiError::invalid(format!(
                        "sort must be one of {}, not {value:?}",
                        known.join(", ")
                    ))
                })?;
            }
            "limit" => {
                limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ApiError::invalid(format!(
                            "limit must be a whole number from 1 to {MAX_LIMIT}"
                        ))
                    })?;
            }
            "next" => {
                next = Some(Cursor::decode(&value).ok_or_else(|| {
                    ApiError::invalid("next must be the next value of an earlier answer")
                })?);
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown parameter {other:?}: this route takes sort, limit and next"
                )))
            }
        }
    }
    Ok((sort, limit, next))
}

/// One page of the view for `viewer`; 503 when telemetry is off or does not answer.
pub async fn page(app: &App, viewer: Viewer, q: TenantsQuery) -> Result<TenantsPage, ApiError> {
    let q = TenantsQuery {
        only: match viewer {
            Viewer::All => None,
            Viewer::Tenant(t) => Some(t),
        },
        ..q
    };
    app.shared.telemetry.tenants(q).await.ok_or_else(|| {
        ApiError::unavailable(
            "the live view is read from the telemetry actors, which are off ([telemetry] enabled = false) or did not answer",
        )
    })
}

#[derive(Serialize)]
struct Answer<'a> {
    tenants: &'a [TenantRow],
    next: Option<String>,
    sort: &'static str,
    total: usize,
    window_s: f64,
}

/// `GET /v1/tenants`.
pub async fn tenants(app: &Arc<App>, viewer: Viewer, head: &Head) -> Result<Response, ApiError> {
    let (sort, limit, after) = parse_query(head.query.as_deref(), DEFAULT_LIMIT)?;
    let q = TenantsQuery {
        sort,
        limit,
        after,
        only: None,
        history: false,
    };
    let page = page(app, viewer, q).await?;
    Ok(json(
        StatusCode::OK,
        &Answer {
            tenants: &page.tenants,
            next: page.next.as_ref().map(Cursor::encode),
            sort: sort.as_str(),
            total: page.total,
            window_s: page.window_s,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_read_and_bad_ones_refused() {
        assert_eq!(
            parse_query(None, DEFAULT_LIMIT).unwrap(),
            (SortField::ShedRatio, DEFAULT_LIMIT, None)
        );
        let (sort, limit, next) =
            parse_query(Some("sort=inflight&limit=5"), DEFAULT_LIMIT).unwrap();
        assert_eq!((sort, limit, next), (SortField::Inflight, 5, None));
        let c = Cursor {
            key: 12.0,
            tenant: b"a b&c".to_vec(),
        };
        let q = format!("sort=shed&next={}", c.encode());
        assert_eq!(
            parse_query(Some(&q), DEFAULT_LIMIT).unwrap().2,
            Some(c.clone())
        );
        for bad in [
            "sort=nope",
            "limit=0",
            "limit=1001",
            "limit=-1",
            "limit=1.5",
            "next=garbage",
            "next=",
            "colour=red",
            "sort=%zz",
        ] {
            let e = parse_query(Some(bad), DEFAULT_LIMIT).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
