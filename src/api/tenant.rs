//! `GET /v1/tenants/{tenant}`: one tenant's state as its actor (or the shared store) holds it now:
//! tokens left per layer and key, calls in flight, quota used, penalties, adaptive rates. 404
//! `unknown_tenant` when it holds none; with a shared store, 503 `store_unavailable` when the store
//! does not answer.

use std::sync::Arc;

use warp::http::StatusCode;
use warp::reply::Response;

use super::fields::{name_field, percent_decode};
use super::{json, ApiError, App};
use crate::actors::{Snapshot, StoreSnapshot};
use crate::store::Store;

pub async fn tenant_snapshot(app: &Arc<App>, raw: &str) -> Result<Response, ApiError> {
    let tenant = percent_decode(raw).ok_or_else(|| {
        ApiError::invalid("the tenant in the path is not valid percent-encoded UTF-8")
    })?;
    name_field("tenant", &tenant)?;
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_tenant",
            format!("tenant {tenant:?} holds no state"),
        )
    };
    let snap = match app.shared.store() {
        // An outage is a 503 that names the store, not "holds no state": the state may well be
        // there, out of reach.
        Store::Redis(_) => Some(app.shared.ask(&tenant, StoreSnapshot).await?.map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                format!("the shared store (redis) holding the tenant's state did not answer: {e}"),
            )
        })?),
        Store::Memory => app.shared.ask_existing(&tenant, Snapshot).await?,
    };
    match snap {
        Some(Some(snap)) => Ok(json(StatusCode::OK, &snap)),
        _ => Err(unknown()),
    }
}
