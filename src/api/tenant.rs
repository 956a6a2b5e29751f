//! `GET /v1/tenants/{tenant}`: one tenant's state as its actor (or the shared store) holds it now:
//! tokens left per layer and key, calls in flight, quota used, penalties, adaptive rates.

use std::sync::Arc;

use warp::http::StatusCode;
use warp::reply::Response;

use super::fields::{name_field, percent_decode};
use super::{json, ApiError, App};
use crate::actors::Snapshot;

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
        Some(_) => Some(app.shared.ask(&tenant, Snapshot).await?),
        None => app.shared.ask_existing(&tenant, Snapshot).await?,
    };
    match snap {
        Some(Some(snap)) => Ok(json(StatusCode::OK, &snap)),
        _ => Err(unknown()),
    }
}
