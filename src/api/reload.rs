//! `POST /v1/admin/reload` (and SIGHUP, through [`reload`]): read the config file again and swap the
//! policies in without losing live buckets, leases or quotas. A file that does not validate is
//! refused and the running config stays; keys that only a restart can change are named.

use std::sync::Arc;

use actix::Addr;
use warp::http::StatusCode;
use warp::reply::Response;

use super::{json, ApiError, App};
use crate::actors::global::{GlobalActor, Reconfigure};
use crate::actors::Shared;
use crate::config::Config;

/// The latest reload (HTTP or SIGHUP) and how it went, for the status page.
#[derive(Debug, Clone, PartialEq)]
pub struct LastReload {
    /// Unix milliseconds.
    pub at_ms: i64,
    /// The keys that need a restart, or why the file was refused.
    pub outcome: Result<Vec<&'static str>, String>,
}

/// One per process, as the config file is: both ways of reloading write it.
static LAST_RELOAD: parking_lot::Mutex<Option<LastReload>> = parking_lot::const_mutex(None);

/// The latest reload since the process started, if any.
pub fn last_reload() -> Option<LastReload> {
    LAST_RELOAD.lock().clone()
}

/// Re-reads the config file and swaps policies in. Live buckets, leases and quotas are kept; a file that
/// does not validate is refused and the running config stays. Returns the keys that need a restart.
pub async fn reload(
    shared: &Arc<Shared>,
    global: &Addr<GlobalActor>,
) -> Result<Vec<&'static str>, ApiError> {
    let result = reload_file(shared, global).await;
    *LAST_RELOAD.lock() = Some(LastReload {
        at_ms: shared.clock.wall_ms(),
        outcome: result.clone().map_err(|e| e.message),
    });
    result
}

async fn reload_file(
    shared: &Arc<Shared>,
    global: &Addr<GlobalActor>,
) -> Result<Vec<&'static str>, ApiError> {
    let current = shared.config.load_full();
    let Some(path) = current.path.clone() else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_config_file",
            "the daemon runs on built-in defaults (no --config), so there is no file to reload",
        ));
    };
    let path_buf = std::path::PathBuf::from(&path);
    let new = tokio::task::spawn_blocking(move || Config::load(&path_buf))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!("reload task failed: {e}"),
            )
        })?
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_config",
                format!("{e}; the running config was kept"),
            )
        })?;
    let mut new = new;
    if let Some(addr) = &current.listen_override {
        new.server.listen = addr.clone();
        new.listen_override = Some(addr.clone());
    }
    // Against what the process runs with, not the last file read: a key changed by one reload and
    // changed back by the next needs no restart.
    let running = &shared.started;
    let mut restart = Vec::new();
    if new.server.listen != running.server.listen {
        restart.push("server.listen");
    }
    if new.server.listen.is_unix() && new.server.socket != running.server.socket {
        restart.push("server.socket_mode/socket_group");
    }
    if new.worker_count() != running.worker_count() {
        restart.push("server.workers");
    }
    if new.telemetry.otlp != running.telemetry.otlp {
        restart.push("telemetry.otlp");
    }
    crate::telemetry::set_identity_key(new.telemetry.identity_key.as_ref());
    if new.state != running.state {
        restart.push("state");
    }
    if new.overload.header_timeout != running.overload.header_timeout {
        restart.push("overload.header_timeout");
    }
    // The store and its connections are made at start; `on_error` and `replicas` are read from the
    // store's own copy too.
    if new.store != running.store {
        restart.push("store");
    }
    // The recording is started (or not) with the telemetry; its budget is applied on reload.
    if new.advice.enabled != running.advice.enabled {
        restart.push("advice.enabled");
    }
    global
        .send(Reconfigure(new))
        .await
        .map_err(|e| ApiError::unavailable(format!("could not apply the config: {e}")))?;
    tracing::info!(file = %path, restart_required = ?restart, "config reloaded");
    Ok(restart)
}

pub async fn reload_answer(app: &Arc<App>) -> Result<Response, ApiError> {
    let restart = reload(&app.shared, &app.global).await?;
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({"reloaded": true, "restart_required": restart}),
    ))
}
