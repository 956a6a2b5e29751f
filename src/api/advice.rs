//! `GET /v1/advice?over=15s`: limits proposed from the calls this daemon decided over the period
//! (see [`crate::advice`]), and `?format=raw`: the period's calls themselves, for `admitd advise`
//! to merge several replicas' recordings.
//!
//! An admin route (see [`super::auth`]): the answer carries the running config file's text. The
//! work (percentiles, two replays through the engine) runs on the blocking pool, away from the
//! worker's requests.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use warp::http::StatusCode;
use warp::reply::Response;

use super::{json, ApiError, App};
use crate::advice::Period;
use crate::config::{parse_duration, Config, StoreKind};

pub const PATH: &str = "/v1/advice";

/// The period asked for when `over` is absent.
pub const DEFAULT_OVER: Duration = Duration::from_secs(3600);

/// What `format=raw` answers: a period another admitd can merge with its own.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Raw {
    /// Always [`RAW_FORMAT`]: a reader refuses any other.
    pub format: String,
    pub over_s: f64,
    /// When the period ended, on the wall clock (Unix milliseconds).
    pub end_unix_ms: i64,
    /// The running config file's text (empty on built-in defaults).
    pub config: String,
    pub period: Period,
}

pub const RAW_FORMAT: &str = "admitd-recording/1";

/// Said with every advice of a replica that shares its limits through a store.
pub const SHARED_STORE_NOTE: &str = "this replica advises from the calls it decided itself; the limits are shared with the other replicas of the store, so run admitd advise with every replica's --url to merge what all of them saw";

/// The query: `over` and `format`.
#[derive(Debug, PartialEq)]
struct Query {
    over: Duration,
    raw: bool,
}

fn parse_query(query: Option<&str>) -> Result<Query, ApiError> {
    let mut q = Query {
        over: DEFAULT_OVER,
        raw: false,
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "over" => q.over = parse_over(value)?,
            "format" => {
                q.raw = match value {
                    "json" => false,
                    "raw" => true,
                    other => {
                        return Err(ApiError::invalid(format!(
                            "format={other:?} is not one of json, raw"
                        )))
                    }
                }
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {other:?}: /v1/advice takes over and format"
                )))
            }
        }
    }
    Ok(q)
}

/// `over`: a whole number from 1 to 99999 and a unit (`ms`, `s`, `m`, `h`, `d`), nothing else,
/// exactly as docs/openapi.yaml's pattern says, so that what the spec calls valid is what the route
/// takes. (99999d is within every duration admitd reads; a config's fractions are not needed to
/// name a period.)
fn parse_over(value: &str) -> Result<Duration, ApiError> {
    let digits = value.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = value.split_at(digits);
    let whole = (1..=5).contains(&number.len()) && !number.starts_with('0');
    if !whole || !matches!(unit, "ms" | "s" | "m" | "h" | "d") {
        return Err(ApiError::invalid(format!(
            "over={value:?} is not a period such as 15s, 5m or 1h: a whole number from 1 to 99999 \
             and one of the units ms, s, m, h, d"
        )));
    }
    parse_duration(value).map_err(|e| ApiError::invalid(format!("over={value:?}: {e}")))
}

fn internal(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
}

/// The running config file's text; empty on built-in defaults.
async fn config_text(cfg: &Config) -> Result<String, ApiError> {
    let Some(path) = cfg.path.clone() else {
        return Ok(String::new());
    };
    tokio::task::spawn_blocking(move || std::fs::read_to_string(&path))
        .await
        .map_err(|e| internal(format!("reading the config file failed: {e}")))?
        .map_err(|e| internal(format!("cannot read the config file: {e}")))
}

pub async fn advice(app: &Arc<App>, query: Option<&str>) -> Result<Response, ApiError> {
    let q = parse_query(query)?;
    let shared = &app.shared;
    if !shared.telemetry.records_advice() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "advice_off",
            "calls are not recorded here: [advice] enabled and [telemetry] enabled must both be true",
        ));
    }
    let over_ms = u64::try_from(q.over.as_millis()).unwrap_or(u64::MAX);
    let period = shared
        .telemetry
        .advice_period(over_ms)
        .await
        .ok_or_else(|| internal("the recording did not answer in time".into()))?;
    let end_unix_ms = shared.clock.wall_ms();
    let cfg = shared.config.load_full();
    let text = config_text(&cfg).await?;
    if q.raw {
        return Ok(json(
            StatusCode::OK,
            &Raw {
                format: RAW_FORMAT.into(),
                over_s: period.over_ms as f64 / 1000.0,
                end_unix_ms,
                config: text,
                period,
            },
        ));
    }
    let shared_store = cfg.store.kind == StoreKind::Redis;
    let mut advice = tokio::task::spawn_blocking(move || {
        crate::advice::advise(&period, &cfg, &text, end_unix_ms)
    })
    .await
    .map_err(|e| internal(format!("the advice failed: {e}")))?
    .map_err(internal)?;
    if shared_store {
        advice.notes.push(SHARED_STORE_NOTE.into());
    }
    Ok(json(StatusCode::OK, &advice))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_takes_over_and_format_and_refuses_anything_else() {
        let q = parse_query(None).unwrap();
        assert_eq!(
            q,
            Query {
                over: DEFAULT_OVER,
                raw: false
            }
        );
        // The spec's pattern, at both ends of its range.
        assert_eq!(
            parse_query(Some("over=1ms")).unwrap().over,
            Duration::from_millis(1)
        );
        assert_eq!(
            parse_query(Some("over=99999d")).unwrap().over,
            Duration::from_secs(99_999 * 86_400)
        );
        let q = parse_query(Some("over=15s&format=raw")).unwrap();
        assert_eq!(
            q,
            Query {
                over: Duration::from_secs(15),
                raw: true
            }
        );
        for bad in [
            "over=15",
            "over=5mins",
            "over=0s",
            "format=xml",
            "window=1m",
            "over=",
            "over=1.5h",
            "over=015s",
            "over=100000s",
            "over= 15s",
        ] {
            let e = parse_query(Some(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(e.code, "invalid_request", "{bad}");
        }
    }
}
