//! The config file's shape as serde reads it, and the TOML reader's errors.
//!
//! The `Raw*` structs mirror the file section by section: they refuse unknown keys and keep the byte
//! span of every value (`toml::Spanned`) so validation can name the line of a bad value. Nothing
//! outside `config/` sees them: the rest of the daemon reads the validated model (`model.rs`).

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

/// How many refused lines [`Config::parse`] blanks, at most, looking for an earlier problem.
pub(super) const RECHECKS: u32 = 8;

/// `text` with line `line` (from 1) emptied, every other line where it was.
pub(super) fn blank_line(text: &str, line: usize) -> String {
    text.split_inclusive('\n')
        .enumerate()
        .map(|(i, l)| match (i + 1 == line, l.ends_with('\n')) {
            (false, _) => l,
            (true, true) => "\n",
            (true, false) => "",
        })
        .collect()
}

/// The TOML reader's message, with the key it is about when it says only what was wrong with a value
/// (`invalid type: string "x", expected f64` names no key): `limits.tenant.burst: invalid type: ...`.
pub(super) fn reader_message(e: &toml::de::Error, text: &str) -> String {
    let message = e
        .message()
        .trim()
        .replace("expected f64", "expected a number")
        .replace("expected i64", "expected a whole number");
    let message = message.as_str();
    let about_a_value = message.starts_with("invalid type") || message.starts_with("invalid value");
    match e
        .span()
        .filter(|_| about_a_value)
        .and_then(|s| key_at(text, s.start))
    {
        Some(key) => format!("{key}: {message}"),
        None => message.to_string(),
    }
}

/// The full name of the `key = value` whose value starts at `offset`: the last `[table]` header
/// before it, a dot, and the key (`None` for any other shape, such as inline tables).
pub(super) fn key_at(text: &str, offset: usize) -> Option<String> {
    let before = &text[..offset.min(text.len())];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let key = before[line_start..].split_once('=')?.0.trim();
    let plain = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '"'))
    };
    if !plain(key) {
        return None;
    }
    let header = before[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .and_then(|l| l.strip_prefix('[')?.split_once(']'))
        .map(|(h, _)| h.trim());
    Some(match header {
        Some(h) if plain(h) => format!("{h}.{key}"),
        _ => key.to_string(),
    })
}

pub(super) fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

pub(super) type S<T> = Spanned<T>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) server: Option<RawServer>,
    pub(super) limits: Option<RawLimits>,
    pub(super) plans: Option<BTreeMap<String, S<RawPlan>>>,
    pub(super) tenants: Option<BTreeMap<String, S<RawTenant>>>,
    pub(super) tools: Option<BTreeMap<String, S<RawTool>>>,
    pub(super) upstreams: Option<BTreeMap<String, S<RawUpstream>>>,
    pub(super) telemetry: Option<RawTelemetry>,
    pub(super) alerts: Option<RawAlerts>,
    pub(super) edge: Option<super::edge::RawEdge>,
    pub(super) state: Option<super::state::RawState>,
    pub(super) overload: Option<super::state::RawOverload>,
    pub(super) store: Option<super::store::RawStore>,
    pub(super) tasks: Option<super::tasks::RawTasks>,
    pub(super) advice: Option<super::advice::RawAdvice>,
    pub(super) spend: Option<BTreeMap<String, S<super::spend::RawSpendUnit>>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<S<String>>,
    pub(super) socket_mode: Option<S<String>>,
    pub(super) socket_group: Option<S<String>>,
    pub(super) api_tokens_sha256: Option<S<Vec<S<String>>>>,
    pub(super) admin_token_sha256: Option<S<String>>,
    pub(super) metrics_token_sha256: Option<S<String>>,
    pub(super) mode: Option<S<String>>,
    pub(super) max_wait: Option<S<String>>,
    pub(super) lease_ttl: Option<S<String>>,
    pub(super) workers: Option<S<i64>>,
    pub(super) idle_ttl: Option<S<String>>,
    pub(super) max_queue: Option<S<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLayer {
    pub(super) rate: Option<S<String>>,
    pub(super) burst: Option<S<f64>>,
    pub(super) concurrency: Option<S<i64>>,
    pub(super) daily_quota: Option<S<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub(super) subject: Option<RawLayer>,
    pub(super) tenant: Option<RawLayer>,
    pub(super) global: Option<RawLayer>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlan {
    pub(super) subject: Option<RawLayer>,
    pub(super) tenant: Option<RawLayer>,
    pub(super) weight: Option<S<f64>>,
    pub(super) global: Option<RawLayer>,
    pub(super) spend: Option<super::spend::RawPlanSpend>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    pub(super) plan: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTool {
    pub(super) cost: Option<S<f64>>,
    pub(super) upstream: Option<S<String>>,
    pub(super) upstreams: Option<S<BTreeMap<String, S<f64>>>>,
    pub(super) rate: Option<S<String>>,
    pub(super) burst: Option<S<f64>>,
    pub(super) spend: Option<super::spend::RawToolSpend>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) rate: Option<S<String>>,
    pub(super) burst: Option<S<f64>>,
    pub(super) shared: Option<bool>,
    pub(super) published_limit: Option<S<String>>,
    pub(super) headroom: Option<S<f64>>,
    pub(super) reserved_for_batch: Option<S<String>>,
    pub(super) aimd_factor: Option<S<f64>>,
    pub(super) aimd_floor: Option<S<f64>>,
    pub(super) aimd_recover: Option<S<f64>>,
    pub(super) adaptive_k: Option<S<f64>>,
    pub(super) adaptive_window: Option<S<String>>,
    pub(super) adaptive_min_requests: Option<S<i64>>,
    pub(super) probe_every: Option<S<String>>,
    pub(super) probe_step: Option<S<f64>>,
    pub(super) probe_hold: Option<S<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    pub(super) max_subjects_per_tenant: Option<S<i64>>,
    pub(super) max_subjects_total: Option<S<i64>>,
    pub(super) refusal_log_per_sec: Option<S<f64>>,
    pub(super) enabled: Option<bool>,
    pub(super) hash_identities: Option<S<bool>>,
    pub(super) hash_key_file: Option<S<String>>,
    pub(super) hash_key_env: Option<S<String>>,
    pub(super) otlp: Option<RawOtlp>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOtlp {
    pub(super) endpoint: Option<S<String>>,
    pub(super) service_name: Option<S<String>>,
    pub(super) sample_ratio: Option<S<f64>>,
    pub(super) max_spans_per_second: Option<S<i64>>,
    pub(super) protocol: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAlerts {
    pub(super) shed_ratio: Option<S<f64>>,
    pub(super) window: Option<S<String>>,
    #[serde(rename = "for")]
    pub(super) for_: Option<S<String>>,
    pub(super) min_calls: Option<S<i64>>,
    pub(super) clear_ratio: Option<S<f64>>,
    pub(super) alertmanager_url: Option<S<String>>,
}
