//! The config file: TOML text in, validated policy out.
//!
//! Parsing happens in two steps. Serde reads the file into `Raw*` structs that keep the byte span of every
//! value (`toml::Spanned`) and refuse unknown keys; validation then turns them into the typed [`Config`]
//! the engine uses. Every error — TOML syntax, an unknown key, a value out of range, a dangling plan name
//! — is reported as `FILE:LINE: message` for the first problem (the one on the lowest line, whatever
//! section it is in), so an operator can fix it without guessing. The same path serves `admitd check`,
//! startup and reload, so a file that passes `check` is exactly a file the daemon accepts.

pub mod units;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

pub use units::{parse_duration, parse_rate, Rate};

/// The config's name-keyed maps. Tools and upstreams are looked up several times per admission by a
/// caller's name, so with a fast hasher (the keys are the operator's: nothing to flood).
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A config error located in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub file: String,
    /// 1-based line of the offending key or value, when known.
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file, line, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Whether refusals are enforced or only reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

/// A token bucket's shape: refill rate and size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketSpec {
    pub rate: Rate,
    pub burst: f64,
}

impl BucketSpec {
    pub fn new(per_sec: f64, burst: f64) -> Self {
        BucketSpec {
            rate: Rate::per_sec(per_sec),
            burst,
        }
    }
}

/// The limits of one layer (`[limits.subject]`, `[limits.tenant]`, `[limits.global]`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerLimits {
    pub bucket: BucketSpec,
    /// Calls in flight at once; `None` is unlimited.
    pub concurrency: Option<u32>,
    /// Cost units per UTC day; `None` is unlimited.
    pub daily_quota: Option<f64>,
}

/// Partial limits: what a plan overrides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerOverride {
    pub rate: Option<Rate>,
    pub burst: Option<f64>,
    pub concurrency: Option<u32>,
    pub daily_quota: Option<f64>,
}

impl LayerOverride {
    fn apply(&self, base: &LayerLimits) -> LayerLimits {
        LayerLimits {
            bucket: BucketSpec {
                rate: self.rate.unwrap_or(base.bucket.rate),
                burst: self.burst.unwrap_or(base.bucket.burst),
            },
            concurrency: self.concurrency.or(base.concurrency),
            daily_quota: self.daily_quota.or(base.daily_quota),
        }
    }
}

/// `[limits.*]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub subject: LayerLimits,
    pub tenant: LayerLimits,
    pub global: LayerLimits,
}

/// `[plans.NAME]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub subject: LayerOverride,
    pub tenant: LayerOverride,
    /// `[plans.NAME.global]`: the plan's tenants pass a global bucket of their own (one for the whole
    /// plan, shared by its tenants) with these keys over `[limits.global]`'s, instead of that one.
    pub global: LayerOverride,
    /// Weight in the fair share of a contended shared upstream (default 1).
    pub weight: f64,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            subject: LayerOverride::default(),
            tenant: LayerOverride::default(),
            global: LayerOverride::default(),
            weight: 1.0,
        }
    }
}

/// `[tools.NAME]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolConfig {
    /// Cost units one call spends when the request names none.
    pub cost: Option<f64>,
    /// The upstream a call spends when the request names none.
    pub upstream: Option<String>,
    /// Amplification: every upstream one call spends, with the units it charges per unit of cost
    /// (`upstreams = { crm = 200 }`). A single `upstream` is the same as `{ name = 1 }`.
    pub upstreams: Vec<(String, f64)>,
    /// A per-subject bucket for this tool (scope `subject_tool`).
    pub bucket: Option<BucketSpec>,
}

/// `[upstreams.NAME]`.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamConfig {
    /// The budget for this upstream: per tenant, or across all tenants when `shared`. Either written as
    /// `rate`/`burst`, or derived from `published_limit` (see [`derive_rate`]).
    pub bucket: Option<BucketSpec>,
    pub shared: bool,
    /// The upstream's own published limit, when the budget is derived from it.
    pub published_limit: Option<Rate>,
    /// Traffic to the upstream that does not come through admitd (batch jobs).
    pub reserved_for_batch: Option<Rate>,
    pub headroom: f64,
    pub aimd: Aimd,
    /// Client-side adaptive throttling; `None` when `adaptive_k = 0`.
    pub adaptive: Option<Adaptive>,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            bucket: None,
            shared: false,
            published_limit: None,
            reserved_for_batch: None,
            headroom: DEFAULT_HEADROOM,
            aimd: Aimd::default(),
            adaptive: Some(Adaptive::default()),
        }
    }
}

/// Default share of a published limit that admitd budgets for agents.
pub const DEFAULT_HEADROOM: f64 = 0.7;

/// The agent budget derived from an upstream's published limit: what is left after batch traffic,
/// times the headroom. A CRM that takes 20 writes/s with 8/s used by batch jobs leaves 12/s; at the
/// default headroom of 0.7 admitd budgets 8.4/s of it.
pub fn derive_rate(published: Rate, reserved: Option<Rate>, headroom: f64) -> f64 {
    (published.per_sec - reserved.map_or(0.0, |r| r.per_sec)) * headroom
}

/// Multiplicative decrease, additive increase of an upstream budget driven by its 429s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Aimd {
    /// The effective rate is multiplied by this on every 429.
    pub factor: f64,
    /// ... but never below this share of the configured rate.
    pub floor: f64,
    /// Share of the configured rate regained per successful call.
    pub recover: f64,
}

impl Default for Aimd {
    fn default() -> Self {
        Aimd {
            factor: 0.5,
            floor: 0.1,
            recover: 0.05,
        }
    }
}

/// Google SRE client-side throttling: reject locally with probability
/// max(0, (requests - k * accepts) / (requests + 1)) over a sliding window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptive {
    pub k: f64,
    pub window: Duration,
    /// No local refusals while the window holds fewer requests than this: with a handful of calls
    /// the formula swings wildly (one 429 out of one request gives 50%), so low-volume callers are
    /// left to the penalty box and the AIMD cut.
    pub min_requests: u64,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            k: 2.0,
            window: Duration::from_secs(120),
            min_requests: 20,
        }
    }
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub mode: Mode,
    /// Longest hold before shedding.
    pub max_wait: Duration,
    /// Unreleased leases expire after this and free their slot.
    pub lease_ttl: Duration,
    /// Threads that run tenant actors and serve HTTP; 0 means one per core.
    pub workers: usize,
    /// A tenant actor whose state is at rest for this long is stopped.
    pub idle_ttl: Duration,
    /// Calls one tenant may have waiting for a concurrency slot at once.
    pub max_queue: usize,
}

/// `[telemetry]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    pub max_subjects_per_tenant: usize,
    /// Subject label values across all tenants; later subjects are reported as `__other__`.
    pub max_subjects_total: usize,
    pub otlp: Option<OtlpConfig>,
    /// Refusal log lines per second, across the daemon (further refusals are counted, not logged).
    pub refusal_log_per_sec: f64,
    /// Metrics, spans, the refusal log and alerts; `false` turns all of them off (to measure what they
    /// cost, or where none is wanted).
    pub enabled: bool,
}

/// Spans recorded per second at most, by default: every call of a daemon deciding at a few hundred
/// calls a second gets one, and a busy daemon spends at most a few percent of a core on spans and
/// does not flood its collector (exporting a span costs a few microseconds; docs/BENCHMARKS.md).
pub const DEFAULT_MAX_SPANS_PER_SECOND: u32 = 1000;

/// `[telemetry.otlp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    pub endpoint: String,
    pub service_name: String,
    /// Share of root admissions (no caller trace) that get a span, 0 to 1. Calls whose caller sent a
    /// `traceparent` follow the caller's sampled flag.
    pub sample_ratio: f64,
    /// Spans recorded per second at most, over every call (a bucket holding one second of them);
    /// 0: no limit. Calls past it get no span and are counted as dropped (`rate_limited`).
    pub max_spans_per_second: u32,
    /// How spans travel to the collector.
    pub protocol: OtlpProtocol,
}

/// `[telemetry.otlp] protocol`, named as `OTEL_EXPORTER_OTLP_PROTOCOL` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (`endpoint` is the traces URL, e.g. `http://host:4318/v1/traces`).
    #[default]
    HttpProtobuf,
    /// OTLP/HTTP with JSON bodies (same endpoint).
    HttpJson,
    /// OTLP/gRPC (`endpoint` is the collector's gRPC address, e.g. `http://host:4317`).
    Grpc,
}

impl OtlpProtocol {
    pub const ALL: [OtlpProtocol; 3] = [
        OtlpProtocol::HttpProtobuf,
        OtlpProtocol::HttpJson,
        OtlpProtocol::Grpc,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::HttpJson => "http/json",
            OtlpProtocol::Grpc => "grpc",
        }
    }
}

/// `[alerts]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AlertsConfig {
    pub shed_ratio: f64,
    pub window: Duration,
    pub for_: Duration,
    pub min_calls: u64,
    /// Ratio below which a firing alert clears (hysteresis); defaults to 80% of `shed_ratio`.
    pub clear_ratio: f64,
    /// Optional Alertmanager base URL; alerts are POSTed to `{url}/api/v2/alerts`.
    pub alertmanager_url: Option<String>,
}

/// The whole validated config.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it came from, for reloads and messages; `None` for built-in defaults.
    pub path: Option<String>,
    /// `--listen` from the command line, which wins over the file's `[server] listen` on reloads too.
    pub listen_override: Option<SocketAddr>,
    pub server: ServerConfig,
    pub limits: Limits,
    pub plans: HashMap<String, Plan>,
    pub tenants: HashMap<String, TenantConfig>,
    pub tools: HashMap<String, ToolConfig>,
    pub upstreams: HashMap<String, UpstreamConfig>,
    pub telemetry: TelemetryConfig,
    pub alerts: AlertsConfig,
}

/// `[tenants.NAME]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantConfig {
    pub plan: Option<String>,
}

/// The limits that apply to one tenant once its plan is applied.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLimits {
    pub subject: LayerLimits,
    pub tenant: LayerLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            path: None,
            listen_override: None,
            server: ServerConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 9470)),
                mode: Mode::Enforce,
                max_wait: Duration::from_secs(2),
                lease_ttl: Duration::from_secs(300),
                workers: 0,
                idle_ttl: Duration::from_secs(60),
                max_queue: 1024,
            },
            limits: Limits {
                subject: LayerLimits {
                    bucket: BucketSpec::new(2.0, 20.0),
                    concurrency: Some(8),
                    daily_quota: None,
                },
                tenant: LayerLimits {
                    bucket: BucketSpec::new(10.0, 50.0),
                    concurrency: Some(32),
                    daily_quota: None,
                },
                global: LayerLimits {
                    bucket: BucketSpec::new(5000.0, 5000.0),
                    concurrency: None,
                    daily_quota: None,
                },
            },
            plans: HashMap::default(),
            tenants: HashMap::default(),
            tools: HashMap::default(),
            upstreams: HashMap::default(),
            telemetry: TelemetryConfig {
                max_subjects_per_tenant: 1000,
                max_subjects_total: 10_000,
                otlp: None,
                refusal_log_per_sec: 20.0,
                enabled: true,
            },
            alerts: AlertsConfig {
                shed_ratio: 0.5,
                window: Duration::from_secs(300),
                for_: Duration::from_secs(60),
                min_calls: 100,
                clear_ratio: 0.4,
                alertmanager_url: None,
            },
        }
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            line: None,
            message: format!("cannot read the config file: {e}"),
        })?;
        let mut cfg = Config::parse(&file, &text)?;
        cfg.path = Some(file);
        Ok(cfg)
    }

    /// Validates config text; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Config, ConfigError> {
        Self::parse_within(file, text, RECHECKS)
    }

    /// [`Config::parse`]. A line the TOML reader refuses (bad syntax, an unknown key, a value of the
    /// wrong type) stops it before validation, but validation might find a problem on an earlier
    /// line: the refused line is blanked and the file checked again (`rechecks` more times at
    /// most), and whichever problem comes first in the file is the one reported.
    fn parse_within(file: &str, text: &str, rechecks: u32) -> Result<Config, ConfigError> {
        let raw: RawConfig = match toml::from_str(text) {
            Ok(raw) => raw,
            Err(e) => {
                let line = e.span().map(|s| line_of(text, s.start));
                let err = ConfigError {
                    file: file.to_string(),
                    line,
                    message: reader_message(&e, text),
                };
                if let (Some(line), true) = (line, rechecks > 0) {
                    let rest = Self::parse_within(file, &blank_line(text, line), rechecks - 1);
                    if let Err(earlier) = rest {
                        if earlier.line.is_some_and(|l| l < line) {
                            return Err(earlier);
                        }
                    }
                }
                return Err(err);
            }
        };
        let v = Validator { file, text };
        v.config(raw)
    }

    /// The tenant's plan, with its name.
    fn plan_of(&self, tenant: &str) -> Option<(&str, &Plan)> {
        let name = self.tenants.get(tenant)?.plan.as_deref()?;
        Some((name, self.plans.get(name)?))
    }

    /// The global bucket the tenant's calls pass: `[limits.global]` (`None`), or the one its plan
    /// overrides it with, shared by the plan's tenants (`Some(plan name)`).
    pub fn tenant_global(&self, tenant: &str) -> (Option<&str>, BucketSpec) {
        self.plan_of(tenant)
            .and_then(|(name, _)| Some((Some(name), self.plan_global(name)?)))
            .unwrap_or((None, self.limits.global.bucket))
    }

    /// The global bucket of a plan that overrides `[limits.global]`, else `None`.
    pub fn plan_global(&self, plan: &str) -> Option<BucketSpec> {
        let p = self.plans.get(plan)?;
        (p.global.rate.is_some() || p.global.burst.is_some())
            .then(|| p.global.apply(&self.limits.global).bucket)
    }

    /// The limits for `tenant`, with its plan applied.
    pub fn tenant_limits(&self, tenant: &str) -> TenantLimits {
        let plan = self.plan_of(tenant).map(|(_, p)| p);
        match plan {
            Some(p) => TenantLimits {
                subject: p.subject.apply(&self.limits.subject),
                tenant: p.tenant.apply(&self.limits.tenant),
            },
            None => TenantLimits {
                subject: self.limits.subject.clone(),
                tenant: self.limits.tenant.clone(),
            },
        }
    }

    /// The tenant's weight in the fair share of a contended shared upstream (its plan's, default 1).
    pub fn tenant_weight(&self, tenant: &str) -> f64 {
        self.plan_of(tenant).map_or(1.0, |(_, p)| p.weight)
    }

    /// The number of worker threads to run.
    pub fn worker_count(&self) -> usize {
        if self.server.workers > 0 {
            self.server.workers
        } else {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        }
    }
}

/// Checks a tenant, subject, tool or upstream name: 1 to 128 bytes of UTF-8 without control characters.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > 128 {
        return Err(format!("is {} bytes long; the limit is 128", name.len()));
    }
    if name.chars().any(char::is_control) {
        return Err("contains a control character".into());
    }
    Ok(())
}

/// The longest a bucket may take to refill from empty. A year is plenty for any rate limit (longer
/// budgets are what `daily_quota` is for), and a bound keeps every bucket time, throttled by an
/// upstream's `aimd_floor` or not, far inside the engine's 64-bit nanoseconds (584 years).
pub const MAX_REFILL_YEARS: f64 = 50.0;
const SECS_PER_YEAR: f64 = 365.25 * 86_400.0;

/// A number for an error message: plain up to six decimals, else in exponent form (`1e-300`).
fn short_num(x: f64) -> String {
    if (1e-6..1e15).contains(&x) {
        let s = format!("{x:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:e}")
    }
}

/// `years` for an error message: whole years, or "forever" past any sensible number.
fn years_text(years: f64) -> String {
    if years.is_finite() && years < 1e12 {
        format!("{years:.0} years")
    } else {
        "practically forever".to_string()
    }
}

/// Where a layer's bucket shape is set in the file: its burst, else its rate.
fn layer_span(raw: &RawLayer) -> Option<std::ops::Range<usize>> {
    raw.burst
        .as_ref()
        .map(|b| b.span())
        .or(raw.rate.as_ref().map(|r| r.span()))
}

/// How many refused lines [`Config::parse`] blanks, at most, looking for an earlier problem.
const RECHECKS: u32 = 8;

/// `text` with line `line` (from 1) emptied, every other line where it was.
fn blank_line(text: &str, line: usize) -> String {
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
fn reader_message(e: &toml::de::Error, text: &str) -> String {
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
fn key_at(text: &str, offset: usize) -> Option<String> {
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

fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

// ---- raw (serde) side -------------------------------------------------------------------------------

type S<T> = Spanned<T>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<RawServer>,
    limits: Option<RawLimits>,
    plans: Option<BTreeMap<String, S<RawPlan>>>,
    tenants: Option<BTreeMap<String, S<RawTenant>>>,
    tools: Option<BTreeMap<String, S<RawTool>>>,
    upstreams: Option<BTreeMap<String, S<RawUpstream>>>,
    telemetry: Option<RawTelemetry>,
    alerts: Option<RawAlerts>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<S<String>>,
    mode: Option<S<String>>,
    max_wait: Option<S<String>>,
    lease_ttl: Option<S<String>>,
    workers: Option<S<i64>>,
    idle_ttl: Option<S<String>>,
    max_queue: Option<S<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLayer {
    rate: Option<S<String>>,
    burst: Option<S<f64>>,
    concurrency: Option<S<i64>>,
    daily_quota: Option<S<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    subject: Option<RawLayer>,
    tenant: Option<RawLayer>,
    global: Option<RawLayer>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    subject: Option<RawLayer>,
    tenant: Option<RawLayer>,
    weight: Option<S<f64>>,
    global: Option<RawLayer>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    plan: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTool {
    cost: Option<S<f64>>,
    upstream: Option<S<String>>,
    upstreams: Option<S<BTreeMap<String, S<f64>>>>,
    rate: Option<S<String>>,
    burst: Option<S<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    rate: Option<S<String>>,
    burst: Option<S<f64>>,
    shared: Option<bool>,
    published_limit: Option<S<String>>,
    headroom: Option<S<f64>>,
    reserved_for_batch: Option<S<String>>,
    aimd_factor: Option<S<f64>>,
    aimd_floor: Option<S<f64>>,
    aimd_recover: Option<S<f64>>,
    adaptive_k: Option<S<f64>>,
    adaptive_window: Option<S<String>>,
    adaptive_min_requests: Option<S<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    max_subjects_per_tenant: Option<S<i64>>,
    max_subjects_total: Option<S<i64>>,
    refusal_log_per_sec: Option<S<f64>>,
    enabled: Option<bool>,
    otlp: Option<RawOtlp>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOtlp {
    endpoint: Option<S<String>>,
    service_name: Option<S<String>>,
    sample_ratio: Option<S<f64>>,
    max_spans_per_second: Option<S<i64>>,
    protocol: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAlerts {
    shed_ratio: Option<S<f64>>,
    window: Option<S<String>>,
    #[serde(rename = "for")]
    for_: Option<S<String>>,
    min_calls: Option<S<i64>>,
    clear_ratio: Option<S<f64>>,
    alertmanager_url: Option<S<String>>,
}

// ---- validation -------------------------------------------------------------------------------------

struct Validator<'a> {
    file: &'a str,
    text: &'a str,
}

impl Validator<'_> {
    fn err<T>(
        &self,
        span: std::ops::Range<usize>,
        message: impl Into<String>,
    ) -> Result<T, ConfigError> {
        Err(ConfigError {
            file: self.file.to_string(),
            line: Some(line_of(self.text, span.start)),
            message: message.into(),
        })
    }

    fn rate(&self, key: &str, v: &S<String>) -> Result<Rate, ConfigError> {
        parse_rate(v.get_ref()).or_else(|e| self.err(v.span(), format!("{key}: {e}")))
    }

    fn duration(&self, key: &str, v: &S<String>, max: Duration) -> Result<Duration, ConfigError> {
        let d =
            parse_duration(v.get_ref()).or_else(|e| self.err(v.span(), format!("{key}: {e}")))?;
        if d > max {
            return self.err(
                v.span(),
                format!(
                    "{key}: {:?} is longer than the maximum of {max:?}",
                    v.get_ref()
                ),
            );
        }
        Ok(d)
    }

    fn positive(&self, key: &str, v: &S<f64>, min: f64) -> Result<f64, ConfigError> {
        let x = *v.get_ref();
        if !x.is_finite() || x < min || x > 1e15 {
            let range = if min == f64::MIN_POSITIVE {
                "greater than 0 and at most 1e15".to_string()
            } else {
                format!("from {min} to 1e15")
            };
            return self.err(v.span(), format!("{key} must be a number {range}, not {x}"));
        }
        Ok(x)
    }

    fn count(&self, key: &str, v: &S<i64>, min: i64, max: i64) -> Result<i64, ConfigError> {
        let x = *v.get_ref();
        if x < min || x > max {
            return self.err(
                v.span(),
                format!("{key} must be a whole number from {min} to {max}, not {x}"),
            );
        }
        Ok(x)
    }

    fn name(
        &self,
        key: &str,
        name: &str,
        span: std::ops::Range<usize>,
    ) -> Result<String, ConfigError> {
        match check_name(name) {
            Ok(()) => Ok(name.to_string()),
            Err(e) => self.err(span, format!("{key} {name:?} {e}")),
        }
    }

    /// Refuses the keys a global layer (`[limits.global]`, `[plans.NAME.global]`) cannot have.
    fn rate_backstop_only(&self, section: &str, raw: &RawLayer) -> Result<(), ConfigError> {
        let unsupported = earliest([
            ("concurrency", raw.concurrency.as_ref().map(|v| v.span())),
            ("daily_quota", raw.daily_quota.as_ref().map(|v| v.span())),
        ]);
        match unsupported {
            Some((key, at)) => self.err(at, format!("{section}.{key} is not supported: the global layer is a rate backstop only; set {key} in [limits.subject] or [limits.tenant]")),
            None => Ok(()),
        }
    }

    fn layer_override(&self, section: &str, raw: &RawLayer) -> Result<LayerOverride, ConfigError> {
        // The keys are independent: the one with a problem earliest in the file is reported.
        let mut first = FirstProblem::default();
        let over = LayerOverride {
            rate: raw
                .rate
                .as_ref()
                .and_then(|r| first.note(self.rate(&format!("{section}.rate"), r))),
            burst: raw
                .burst
                .as_ref()
                .and_then(|b| first.note(self.positive(&format!("{section}.burst"), b, 1.0))),
            concurrency: raw.concurrency.as_ref().and_then(|c| {
                let c = self.count(&format!("{section}.concurrency"), c, 1, 1_000_000);
                first.note(c).map(|c| c as u32)
            }),
            daily_quota: raw.daily_quota.as_ref().and_then(|q| {
                let q = self.positive(&format!("{section}.daily_quota"), q, f64::MIN_POSITIVE);
                first.note(q)
            }),
        };
        first.or(over)
    }

    /// A bucket from optional `rate` and `burst`: both absent is no bucket; a rate alone gets a burst of
    /// one second's worth (at least 1); a burst without a rate is an error.
    fn optional_bucket(
        &self,
        section: &str,
        span: std::ops::Range<usize>,
        rate: &Option<S<String>>,
        burst: &Option<S<f64>>,
    ) -> Result<Option<BucketSpec>, ConfigError> {
        match (rate, burst) {
            (None, None) => Ok(None),
            (None, Some(b)) => self.err(
                b.span(),
                format!("{section}.burst is set but {section}.rate is not; set both"),
            ),
            (Some(r), b) => {
                let rate = self.rate(&format!("{section}.rate"), r)?;
                let burst = match b {
                    Some(b) => self.positive(&format!("{section}.burst"), b, 1.0)?,
                    None => rate.per_sec.ceil().max(1.0),
                };
                let _ = span;
                let spec = BucketSpec { rate, burst };
                let at = b.as_ref().map_or(r.span(), |b| b.span());
                self.refill_fits(section, at, spec, 1.0)?;
                Ok(Some(spec))
            }
        }
    }

    fn fraction(
        &self,
        key: &str,
        v: &S<f64>,
        min_exclusive: f64,
        max: f64,
    ) -> Result<f64, ConfigError> {
        let x = *v.get_ref();
        if !(x > min_exclusive && x <= max) {
            return self.err(
                v.span(),
                format!("{key} must be greater than {min_exclusive} and at most {max}, not {x}"),
            );
        }
        Ok(x)
    }

    /// Refuses a bucket that takes longer than [`MAX_REFILL_YEARS`] to refill from empty: `floor` is the
    /// lowest share of its rate it may be throttled to (an upstream's `aimd_floor`, else 1). Such a
    /// bucket would be a quota in disguise, and its times would not fit the engine's nanoseconds.
    fn refill_fits(
        &self,
        section: &str,
        at: std::ops::Range<usize>,
        spec: BucketSpec,
        floor: f64,
    ) -> Result<(), ConfigError> {
        let years = spec.burst / (spec.rate.per_sec * floor) / SECS_PER_YEAR;
        if years.is_finite() && years <= MAX_REFILL_YEARS {
            return Ok(());
        }
        let throttled = if floor < 1.0 {
            format!(" when throttled to aimd_floor = {}", short_num(floor))
        } else {
            String::new()
        };
        self.err(
            at,
            format!(
                "{section}: a full refill of {} tokens at {}/s takes {}{throttled}; the longest allowed is {MAX_REFILL_YEARS} years (raise the rate or lower the burst; for a budget per day, use daily_quota)",
                short_num(spec.burst),
                short_num(spec.rate.per_sec * floor),
                years_text(years),
            ),
        )
    }

    fn upstream(
        &self,
        section: &str,
        span: std::ops::Range<usize>,
        u: &RawUpstream,
    ) -> Result<UpstreamConfig, ConfigError> {
        let mut out = UpstreamConfig {
            shared: u.shared.unwrap_or(false),
            ..UpstreamConfig::default()
        };
        match &u.published_limit {
            Some(p) => {
                if let Some(r) = &u.rate {
                    return self.err(
                        r.span(),
                        format!("{section}: set either rate or published_limit, not both"),
                    );
                }
                let published = self.rate(&format!("{section}.published_limit"), p)?;
                let reserved = match &u.reserved_for_batch {
                    Some(r) => Some(self.rate(&format!("{section}.reserved_for_batch"), r)?),
                    None => None,
                };
                if let Some(h) = &u.headroom {
                    out.headroom = self.fraction(&format!("{section}.headroom"), h, 0.0, 1.0)?;
                }
                let rate = derive_rate(published, reserved, out.headroom);
                if rate <= 0.0 {
                    let at = u.reserved_for_batch.as_ref().map_or(p.span(), |r| r.span());
                    return self.err(at, format!("{section}.reserved_for_batch leaves nothing of published_limit for agents"));
                }
                let burst = match &u.burst {
                    Some(b) => self.positive(&format!("{section}.burst"), b, 1.0)?,
                    None => rate.ceil().max(1.0),
                };
                out.bucket = Some(BucketSpec::new(rate, burst));
                out.published_limit = Some(published);
                out.reserved_for_batch = reserved;
            }
            None => {
                let needs_published = earliest([
                    ("headroom", u.headroom.as_ref().map(|v| v.span())),
                    (
                        "reserved_for_batch",
                        u.reserved_for_batch.as_ref().map(|v| v.span()),
                    ),
                ]);
                if let Some((key, at)) = needs_published {
                    return self.err(
                        at,
                        format!("{section}.{key} needs {section}.published_limit"),
                    );
                }
                out.bucket = self.optional_bucket(section, span.clone(), &u.rate, &u.burst)?;
            }
        }
        if let Some(v) = &u.aimd_factor {
            out.aimd.factor = self.fraction(&format!("{section}.aimd_factor"), v, 0.0, 1.0)?;
        }
        if let Some(v) = &u.aimd_floor {
            out.aimd.floor = self.fraction(&format!("{section}.aimd_floor"), v, 0.0, 1.0)?;
        }
        if let Some(spec) = out.bucket {
            // Where the bucket's shape was set, or the floor that stretches it.
            let shape = u
                .burst
                .as_ref()
                .map(|b| b.span())
                .or(u.rate.as_ref().map(|r| r.span()))
                .or(u.published_limit.as_ref().map(|p| p.span()))
                .unwrap_or(span.clone());
            if u.published_limit.is_some() {
                // A bucket from rate and burst was checked where it was read.
                self.refill_fits(section, shape.clone(), spec, 1.0)?;
            }
            let at = u.aimd_floor.as_ref().map_or(shape, |f| f.span());
            self.refill_fits(section, at, spec, out.aimd.floor)?;
        }
        if let Some(v) = &u.aimd_recover {
            out.aimd.recover = self.fraction(&format!("{section}.aimd_recover"), v, 0.0, 1.0)?;
        }
        let mut adaptive = Adaptive::default();
        if let Some(v) = &u.adaptive_k {
            let k = *v.get_ref();
            if !(k == 0.0 || (1.0..=100.0).contains(&k)) {
                return self.err(
                    v.span(),
                    format!("{section}.adaptive_k must be 0 (off) or from 1 to 100, not {k}"),
                );
            }
            adaptive.k = k;
        }
        if let Some(v) = &u.adaptive_window {
            adaptive.window = self.duration(
                &format!("{section}.adaptive_window"),
                v,
                Duration::from_secs(3600),
            )?;
            if adaptive.window < Duration::from_secs(1) {
                return self.err(
                    v.span(),
                    format!("{section}.adaptive_window must be at least 1s"),
                );
            }
        }
        if let Some(v) = &u.adaptive_min_requests {
            adaptive.min_requests =
                self.count(&format!("{section}.adaptive_min_requests"), v, 0, 1_000_000)? as u64;
        }
        out.adaptive = (adaptive.k > 0.0).then_some(adaptive);
        Ok(out)
    }

    /// Validates the whole file. Each independent item (the server table, each `[limits.*]` layer, each
    /// plan, tenant, tool and upstream, the telemetry and alerts tables) is checked up to its first
    /// problem, and of those the one on the lowest line is reported: the order the sections are checked
    /// in here is not the order an operator reads the file in.
    fn config(&self, raw: RawConfig) -> Result<Config, ConfigError> {
        let mut cfg = Config::default();
        let mut first = FirstProblem::default();

        if let Some(s) = raw.server {
            first.note(self.server(s, &mut cfg.server));
        }

        // Whether each layer is free of problems: plans are measured only against layers that are.
        let mut layer = |name: &str, raw: Option<RawLayer>, target: &mut LayerLimits| {
            raw.is_none_or(|raw| first.note(self.limits_layer(name, &raw, target)).is_some())
        };
        let l = raw.limits.unwrap_or_default();
        let subject_ok = layer("limits.subject", l.subject, &mut cfg.limits.subject);
        let tenant_ok = layer("limits.tenant", l.tenant, &mut cfg.limits.tenant);
        let global_ok = layer("limits.global", l.global, &mut cfg.limits.global);

        let plans = raw.plans.unwrap_or_default();
        let subject_base = subject_ok.then_some(&cfg.limits.subject);
        let tenant_base = tenant_ok.then_some(&cfg.limits.tenant);
        let global_base = global_ok.then_some(&cfg.limits.global);
        cfg.plans = first.each(&plans, |name, plan| {
            self.plan(name, plan, subject_base, tenant_base, global_base)
        });
        cfg.tenants = first.each(&raw.tenants.unwrap_or_default(), |name, tenant| {
            self.tenant(name, tenant, &plans)
        });
        cfg.tools = first.each(&raw.tools.unwrap_or_default(), |name, tool| {
            self.tool(name, tool)
        });
        cfg.upstreams = first.each(&raw.upstreams.unwrap_or_default(), |name, up| {
            self.name("upstream", name, up.span())?;
            self.upstream(&format!("upstreams.{name}"), up.span(), up.get_ref())
        });

        if let Some(t) = raw.telemetry {
            first.note(self.telemetry(t, &mut cfg.telemetry));
        }
        if let Some(a) = raw.alerts {
            first.note(self.alerts(a, &mut cfg.alerts));
        }

        first.or(cfg)
    }

    /// `[server]`, over the defaults in `out`.
    fn server(&self, s: RawServer, out: &mut ServerConfig) -> Result<(), ConfigError> {
        if let Some(v) = s.listen {
            out.listen = match v.get_ref().parse() {
                Ok(a) => a,
                Err(_) => {
                    return self.err(
                        v.span(),
                        format!(
                            "server.listen: {:?} is not an address such as \"127.0.0.1:9470\"",
                            v.get_ref()
                        ),
                    )
                }
            };
        }
        if let Some(v) = s.mode {
            out.mode = match v.get_ref().as_str() {
                "enforce" => Mode::Enforce,
                "shadow" => Mode::Shadow,
                other => {
                    return self.err(
                        v.span(),
                        format!("server.mode must be \"enforce\" or \"shadow\", not {other:?}"),
                    )
                }
            };
        }
        if let Some(v) = s.max_wait {
            out.max_wait = self.duration("server.max_wait", &v, Duration::from_secs(300))?;
        }
        if let Some(v) = s.lease_ttl {
            out.lease_ttl =
                self.duration("server.lease_ttl", &v, Duration::from_secs(7 * 86_400))?;
            if out.lease_ttl.is_zero() {
                return self.err(v.span(), "server.lease_ttl must be longer than 0");
            }
        }
        if let Some(v) = s.idle_ttl {
            out.idle_ttl = self.duration("server.idle_ttl", &v, Duration::from_secs(86_400))?;
        }
        if let Some(v) = s.workers {
            out.workers = self.count("server.workers", &v, 0, 256)? as usize;
        }
        if let Some(v) = s.max_queue {
            out.max_queue = self.count("server.max_queue", &v, 0, 1_000_000)? as usize;
        }
        Ok(())
    }

    /// One `[limits.*]` layer, over the defaults in `target`.
    fn limits_layer(
        &self,
        name: &str,
        layer: &RawLayer,
        target: &mut LayerLimits,
    ) -> Result<(), ConfigError> {
        if name == "limits.global" {
            self.rate_backstop_only(name, layer)?;
        }
        *target = self.layer_override(name, layer)?.apply(target);
        if let Some(at) = layer_span(layer) {
            self.refill_fits(name, at, target.bucket, 1.0)?;
        }
        Ok(())
    }

    /// `[plans.NAME]`. Each layer it overrides is measured against its base in `[limits.*]`, unless
    /// that base is `None` because it has a problem of its own (which is reported instead).
    fn plan(
        &self,
        name: &str,
        plan: &S<RawPlan>,
        subject_base: Option<&LayerLimits>,
        tenant_base: Option<&LayerLimits>,
        global_base: Option<&LayerLimits>,
    ) -> Result<Plan, ConfigError> {
        let span = plan.span();
        self.name("plan", name, span)?;
        let p = plan.get_ref();
        let weight = match &p.weight {
            Some(w) => self.positive(&format!("plans.{name}.weight"), w, 0.001)?,
            None => 1.0,
        };
        let plan = Plan {
            weight,
            subject: match &p.subject {
                Some(l) => self.layer_override(&format!("plans.{name}.subject"), l)?,
                None => LayerOverride::default(),
            },
            tenant: match &p.tenant {
                Some(l) => self.layer_override(&format!("plans.{name}.tenant"), l)?,
                None => LayerOverride::default(),
            },
            global: match &p.global {
                Some(l) => {
                    let section = format!("plans.{name}.global");
                    self.rate_backstop_only(&section, l)?;
                    self.layer_override(&section, l)?
                }
                None => LayerOverride::default(),
            },
        };
        for (layer, raw, over, base) in [
            ("subject", &p.subject, &plan.subject, subject_base),
            ("tenant", &p.tenant, &plan.tenant, tenant_base),
            ("global", &p.global, &plan.global, global_base),
        ] {
            if let (Some(at), Some(base)) = (raw.as_ref().and_then(layer_span), base) {
                let section = format!("plans.{name}.{layer}");
                self.refill_fits(&section, at, over.apply(base).bucket, 1.0)?;
            }
        }
        Ok(plan)
    }

    /// `[tenants.NAME]`. `plans` is every `[plans.NAME]` in the file, whether it has a problem or not:
    /// a tenant on a plan with a problem is not also told that its plan is unknown.
    fn tenant(
        &self,
        name: &str,
        tenant: &S<RawTenant>,
        plans: &BTreeMap<String, S<RawPlan>>,
    ) -> Result<TenantConfig, ConfigError> {
        self.name("tenant", name, tenant.span())?;
        let plan = match &tenant.get_ref().plan {
            Some(p) => {
                if !plans.contains_key(p.get_ref()) {
                    let known: Vec<&str> = plans.keys().map(String::as_str).collect();
                    let known = if known.is_empty() {
                        "no plans are defined".to_string()
                    } else {
                        format!("defined plans: {}", known.join(", "))
                    };
                    return self.err(
                        p.span(),
                        format!(
                            "tenants.{name}.plan: unknown plan {:?} ({known})",
                            p.get_ref()
                        ),
                    );
                }
                Some(p.get_ref().clone())
            }
            None => None,
        };
        Ok(TenantConfig { plan })
    }

    /// `[tools.NAME]`.
    fn tool(&self, name: &str, tool: &S<RawTool>) -> Result<ToolConfig, ConfigError> {
        let span = tool.span();
        self.name("tool", name, span.clone())?;
        let t = tool.get_ref();
        let section = format!("tools.{name}");
        let cost = match &t.cost {
            Some(c) => Some(self.positive(&format!("{section}.cost"), c, f64::MIN_POSITIVE)?),
            None => None,
        };
        let upstream = match &t.upstream {
            Some(u) => Some(self.name(&format!("{section}.upstream"), u.get_ref(), u.span())?),
            None => None,
        };
        let mut upstreams = Vec::new();
        if let Some(map) = &t.upstreams {
            if let Some(u) = &t.upstream {
                return self.err(
                    u.span(),
                    format!("{section}: set either upstream or upstreams, not both"),
                );
            }
            if map.get_ref().is_empty() {
                return self.err(
                    map.span(),
                    format!("{section}.upstreams is empty; list at least one upstream"),
                );
            }
            for (up, units) in map.get_ref() {
                let up = self.name(&format!("{section}.upstreams"), up, units.span())?;
                let units = self.positive(
                    &format!("{section}.upstreams.{up}"),
                    units,
                    f64::MIN_POSITIVE,
                )?;
                upstreams.push((up, units));
            }
        } else if let Some(u) = &upstream {
            upstreams.push((u.clone(), 1.0));
        }
        let bucket = self.optional_bucket(&section, span, &t.rate, &t.burst)?;
        Ok(ToolConfig {
            cost,
            upstream,
            upstreams,
            bucket,
        })
    }

    /// `[telemetry]`, over the defaults in `out`.
    fn telemetry(&self, t: RawTelemetry, out: &mut TelemetryConfig) -> Result<(), ConfigError> {
        if let Some(v) = t.enabled {
            out.enabled = v;
        }
        if let Some(v) = t.max_subjects_total {
            out.max_subjects_total =
                self.count("telemetry.max_subjects_total", &v, 0, 10_000_000)? as usize;
        }
        if let Some(v) = t.max_subjects_per_tenant {
            out.max_subjects_per_tenant =
                self.count("telemetry.max_subjects_per_tenant", &v, 0, 1_000_000)? as usize;
        }
        if let Some(v) = t.refusal_log_per_sec {
            out.refusal_log_per_sec = self.positive("telemetry.refusal_log_per_sec", &v, 0.0)?;
        }
        if let Some(o) = t.otlp {
            let endpoint = match o.endpoint {
                Some(e) => {
                    let s = e.get_ref().trim();
                    if !(s.starts_with("http://") || s.starts_with("https://")) {
                        return self.err(e.span(), format!("telemetry.otlp.endpoint must be an http:// or https:// URL, not {s:?}"));
                    }
                    Some(s.to_string())
                }
                None => None,
            };
            // `service_name` alone is accepted: the contract gives its default, and a file that
            // writes the defaults out (export off, no endpoint) must stay valid.
            if endpoint.is_none() {
                let set = earliest([
                    ("sample_ratio", o.sample_ratio.as_ref().map(|v| v.span())),
                    (
                        "max_spans_per_second",
                        o.max_spans_per_second.as_ref().map(|v| v.span()),
                    ),
                    ("protocol", o.protocol.as_ref().map(|v| v.span())),
                ]);
                if let Some((_, span)) = set {
                    return self.err(span, "[telemetry.otlp] has no endpoint, so nothing would be exported; set telemetry.otlp.endpoint (for example \"http://127.0.0.1:4318/v1/traces\") or remove the section");
                }
            }
            let sample_ratio = match o.sample_ratio {
                Some(v) => {
                    let r = *v.get_ref();
                    if !(0.0..=1.0).contains(&r) {
                        return self.err(
                            v.span(),
                            format!("telemetry.otlp.sample_ratio must be between 0 and 1, not {r}"),
                        );
                    }
                    r
                }
                None => 1.0,
            };
            let max_spans_per_second = match o.max_spans_per_second {
                Some(v) => {
                    self.count("telemetry.otlp.max_spans_per_second", &v, 0, 10_000_000)? as u32
                }
                None => DEFAULT_MAX_SPANS_PER_SECOND,
            };
            let protocol = match o.protocol {
                Some(v) => {
                    let name = v.get_ref().trim();
                    match OtlpProtocol::ALL.into_iter().find(|p| p.as_str() == name) {
                        Some(p) => p,
                        None => {
                            return self.err(
                                v.span(),
                                format!(
                                    "telemetry.otlp.protocol must be \"http/protobuf\", \"http/json\" or \"grpc\", not {name:?}"
                                ),
                            )
                        }
                    }
                }
                None => OtlpProtocol::default(),
            };
            let service_name = o
                .service_name
                .map(|s| s.into_inner())
                .unwrap_or_else(|| "admitd".to_string());
            out.otlp = endpoint.map(|endpoint| OtlpConfig {
                endpoint,
                service_name,
                sample_ratio,
                max_spans_per_second,
                protocol,
            });
        }
        Ok(())
    }

    /// `[alerts]`, over the defaults in `out`.
    fn alerts(&self, a: RawAlerts, out: &mut AlertsConfig) -> Result<(), ConfigError> {
        if let Some(v) = a.shed_ratio {
            let r = *v.get_ref();
            if !(r > 0.0 && r < 1.0) {
                return self.err(
                    v.span(),
                    format!("alerts.shed_ratio must be between 0 and 1 (exclusive), not {r}"),
                );
            }
            out.shed_ratio = r;
            out.clear_ratio = r * 0.8;
        }
        if let Some(v) = a.clear_ratio {
            let r = *v.get_ref();
            if !(r >= 0.0 && r <= out.shed_ratio) {
                return self.err(
                    v.span(),
                    format!(
                        "alerts.clear_ratio must be between 0 and alerts.shed_ratio ({}), not {r}",
                        out.shed_ratio
                    ),
                );
            }
            out.clear_ratio = r;
        }
        if let Some(v) = a.window {
            out.window = self.duration("alerts.window", &v, Duration::from_secs(86_400))?;
            if out.window < Duration::from_secs(1) {
                return self.err(v.span(), "alerts.window must be at least 1s");
            }
        }
        if let Some(v) = a.for_ {
            out.for_ = self.duration("alerts.for", &v, Duration::from_secs(86_400))?;
        }
        if let Some(v) = a.min_calls {
            out.min_calls = self.count("alerts.min_calls", &v, 0, i64::MAX)? as u64;
        }
        if let Some(v) = a.alertmanager_url {
            let s = v.get_ref().trim().trim_end_matches('/');
            if !(s.starts_with("http://") || s.starts_with("https://")) {
                return self.err(
                    v.span(),
                    format!(
                        "alerts.alertmanager_url must be an http:// or https:// URL, not {s:?}"
                    ),
                );
            }
            out.alertmanager_url = Some(s.to_string());
        }
        Ok(())
    }
}

/// Gathers the problems of items checked one after another and keeps the one earliest in the file, so
/// the first problem reported is the first by line, not by the order the code visits sections in. A
/// tie goes to the problem noted first.
#[derive(Default)]
struct FirstProblem(Option<ConfigError>);

impl FirstProblem {
    /// The value of `r`, or `None` once its error is noted.
    fn note<T>(&mut self, r: Result<T, ConfigError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                // A problem without a line sorts last (validation always has one).
                let line = |e: &ConfigError| e.line.unwrap_or(usize::MAX);
                if self.0.as_ref().is_none_or(|kept| line(&e) < line(kept)) {
                    self.0 = Some(e);
                }
                None
            }
        }
    }

    /// Checks every `[SECTION.NAME]` of a section, each as one item, and keeps those that pass.
    fn each<R, T>(
        &mut self,
        items: &BTreeMap<String, R>,
        mut check: impl FnMut(&str, &R) -> Result<T, ConfigError>,
    ) -> HashMap<String, T> {
        items
            .iter()
            .filter_map(|(name, item)| Some((name.clone(), self.note(check(name, item))?)))
            .collect()
    }

    /// `value` when no problem was noted, else the earliest problem.
    fn or<T>(self, value: T) -> Result<T, ConfigError> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(value),
        }
    }
}

/// Of several keys, each with its span when it is set, the one set earliest in the file.
fn earliest<K>(
    keys: impl IntoIterator<Item = (K, Option<std::ops::Range<usize>>)>,
) -> Option<(K, std::ops::Range<usize>)> {
    keys.into_iter()
        .filter_map(|(key, span)| Some((key, span?)))
        .min_by_key(|(_, span)| span.start)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[server]
listen = "127.0.0.1:9470"
mode = "enforce"
max_wait = "2s"
lease_ttl = "5m"

[limits.subject]
rate = "120/min"
burst = 20
concurrency = 8
daily_quota = 20000

[limits.tenant]
rate = "600/min"
burst = 50
concurrency = 32

[limits.global]
rate = "5000/s"
burst = 5000

[plans.free.subject]
rate = "30/min"
burst = 5

[tenants.globex]
plan = "free"

[tools.get_sales]
cost = 20
upstream = "warehouse"
rate = "5/min"
burst = 5

[upstreams.warehouse]
rate = "20/s"
burst = 20
shared = false

[telemetry]
max_subjects_per_tenant = 1000

[telemetry.otlp]
endpoint = "http://127.0.0.1:4318/v1/traces"
service_name = "admitd"

[alerts]
shed_ratio = 0.5
window = "5m"
for = "1m"
min_calls = 100
"#;

    #[test]
    fn a_bucket_that_takes_longer_than_fifty_years_to_refill_is_refused_where_it_is_set() {
        let e = err("[limits.subject]\nrate = \"1/day\"\nburst = 300000\n");
        assert!(
            e.starts_with("cfg.toml:3: limits.subject: a full refill of 300000 tokens")
                && e.contains("takes 821 years; the longest allowed is 50 years"),
            "{e}"
        );
        // A plan's rate applies to the base burst: the pair is what must fit.
        let e = err("[limits.tenant]\nrate = \"100/s\"\nburst = 100000\n\n[plans.slow]\ntenant = { rate = \"1/day\" }\n");
        assert!(
            e.starts_with("cfg.toml:6: plans.slow.tenant: a full refill"),
            "{e}"
        );
        let e = err("[tools.t]\nrate = \"1/h\"\nburst = 5000000\n");
        assert!(e.starts_with("cfg.toml:3: tools.t: a full refill"), "{e}");
        let e = err("[upstreams.u]\nrate = \"1/day\"\nburst = 20000\n");
        assert!(
            e.starts_with("cfg.toml:3: upstreams.u: a full refill"),
            "{e}"
        );
        // A rate derived from published_limit (here 70% of 1/day) is held to the same bound.
        let e = err("[upstreams.u]\npublished_limit = \"1/day\"\nburst = 20000\n");
        assert!(
            e.starts_with("cfg.toml:3: upstreams.u: a full refill") && e.contains("78 years"),
            "{e}"
        );
        // An upstream's throttle floor stretches its refill too.
        let e = err("[upstreams.u]\nrate = \"10/s\"\nburst = 10\naimd_floor = 1e-300\n");
        assert!(
            e.starts_with("cfg.toml:4: upstreams.u: a full refill")
                && e.contains("when throttled to aimd_floor = 1e-300")
                && e.contains("practically forever"),
            "{e}"
        );
        // Slow buckets inside the bound are fine: ten years' worth of one a day.
        let c = Config::parse(
            "cfg.toml",
            "[limits.subject]\nrate = \"1/day\"\nburst = 3650\n\n[upstreams.u]\nrate = \"1/day\"\nburst = 3650\naimd_floor = 0.5\n",
        )
        .unwrap();
        assert_eq!(c.limits.subject.bucket.burst, 3650.0);
    }

    #[test]
    fn the_contract_example_parses() {
        let c = Config::parse("admitd.toml", EXAMPLE).unwrap();
        assert_eq!(c.limits.subject.bucket, BucketSpec::new(2.0, 20.0));
        assert_eq!(c.limits.subject.daily_quota, Some(20000.0));
        assert_eq!(c.limits.tenant.concurrency, Some(32));
        assert_eq!(c.tools["get_sales"].cost, Some(20.0));
        assert_eq!(c.tools["get_sales"].bucket.unwrap().burst, 5.0);
        assert_eq!(
            c.upstreams["warehouse"].bucket,
            Some(BucketSpec::new(20.0, 20.0))
        );
        assert_eq!(
            c.telemetry.otlp.as_ref().unwrap().endpoint,
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(c.alerts.for_, Duration::from_secs(60));
        let free = c.tenant_limits("globex");
        assert_eq!(free.subject.bucket, BucketSpec::new(0.5, 5.0));
        // a plan keeps the keys it does not override
        assert_eq!(free.subject.concurrency, Some(8));
        assert_eq!(free.subject.daily_quota, Some(20000.0));
        assert_eq!(
            c.tenant_limits("acme").subject.bucket,
            BucketSpec::new(2.0, 20.0)
        );
    }

    #[test]
    fn empty_file_is_the_defaults() {
        let c = Config::parse("x.toml", "").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.server.max_wait, Duration::from_secs(2));
        assert_eq!(c.limits.tenant.bucket, BucketSpec::new(10.0, 50.0));
    }

    fn err(text: &str) -> String {
        Config::parse("cfg.toml", text).unwrap_err().to_string()
    }

    fn otlp_protocol(protocol: Option<&str>) -> Result<OtlpProtocol, String> {
        let mut text = "[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4317\"\n".to_string();
        if let Some(p) = protocol {
            text.push_str(&format!("protocol = \"{p}\"\n"));
        }
        Config::parse("cfg.toml", &text)
            .map(|c| c.telemetry.otlp.unwrap().protocol)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn errors_name_file_and_line() {
        let e = err("[limits.subject]\nburst = 20\nrate = \"5/mins\"\n");
        assert!(
            e.starts_with("cfg.toml:3: limits.subject.rate: invalid rate \"5/mins\""),
            "{e}"
        );

        let e = err("[tenants.globex]\nplan = \"gold\"\n");
        assert!(
            e.starts_with("cfg.toml:2: tenants.globex.plan: unknown plan \"gold\""),
            "{e}"
        );

        let e = err("\n\n[limits.tenant]\nburst = -5\n");
        assert!(
            e.starts_with("cfg.toml:4: limits.tenant.burst must be"),
            "{e}"
        );

        let e = err("[server]\nlisten = \"127.0.0.1:9470\"\nmax_wiat = \"2s\"\n");
        assert!(e.starts_with("cfg.toml:3: unknown field `max_wiat`"), "{e}");

        let e = err("[limits.subject]\nrate = 5\n");
        assert!(e.starts_with("cfg.toml:2: "), "{e}");

        let e = err("[server\n");
        assert!(e.starts_with("cfg.toml:1: "), "{e}");

        let e = err("[server]\nmode = \"audit\"\n");
        assert!(e.starts_with("cfg.toml:2: server.mode must be"), "{e}");

        let e = err("[tools.x]\nburst = 3\n");
        assert!(
            e.starts_with("cfg.toml:2: tools.x.burst is set but tools.x.rate is not"),
            "{e}"
        );

        let e = err("[limits.subject]\nconcurrency = 0\n");
        assert!(
            e.starts_with("cfg.toml:2: limits.subject.concurrency must be a whole number"),
            "{e}"
        );

        let e = err("[server]\nmax_wait = \"2\"\n");
        assert!(
            e.contains("cfg.toml:2: server.max_wait: invalid duration"),
            "{e}"
        );

        let e = err("[bogus]\nx = 1\n");
        assert!(e.starts_with("cfg.toml:1: unknown field `bogus`"), "{e}");
    }

    /// Asserts that `text` is refused with an error starting with `prefix` (`FILE:LINE: message`).
    fn assert_first(text: &str, prefix: &str) {
        let e = err(text);
        assert!(
            e.starts_with(prefix),
            "got {e:?}, want it to start with {prefix:?}"
        );
    }

    #[test]
    fn the_problem_on_the_lowest_line_is_reported_whatever_section_it_is_in() {
        assert_first(
            "[limits.subject]\nrate = \"5/mins\"\n\n[server]\nmode = \"bogus\"\n",
            "cfg.toml:2: limits.subject.rate: invalid rate \"5/mins\"",
        );
        assert_first(
            "[tools.t]\ncost = 0\n\n[limits.subject]\nburst = 0\n",
            "cfg.toml:2: tools.t.cost must be a number greater than 0",
        );
        assert_first(
            "[alerts]\nshed_ratio = 1.5\n[limits.tenant]\nburst = -1\n",
            "cfg.toml:2: alerts.shed_ratio must be between 0 and 1 (exclusive), not 1.5",
        );
        assert_first(
            "[upstreams.u]\nburst = 5\n[tools.t]\ncost = -1\n",
            "cfg.toml:2: upstreams.u.burst is set but upstreams.u.rate is not",
        );
        // A plan with a problem still counts as defined.
        assert_first(
            "[tenants.x]\nplan = \"gold\"\n[plans.free.subject]\nburst = 0\n",
            "cfg.toml:2: tenants.x.plan: unknown plan \"gold\" (defined plans: free)",
        );
    }

    #[test]
    fn a_tenant_on_a_plan_with_a_problem_is_told_the_plans_problem_not_that_it_is_unknown() {
        assert_first(
            "[tenants.x]\nplan = \"free\"\n\n[plans.free.subject]\nrate = \"5/mins\"\n",
            "cfg.toml:5: plans.free.subject.rate: invalid rate \"5/mins\"",
        );
    }

    #[test]
    fn a_plan_is_not_measured_against_a_limits_layer_that_has_a_problem_of_its_own() {
        // Against the refused burst of 1e12 the plan's rate would take forever to refill; the
        // problem is the layer's burst, not the plan.
        assert_first(
            "[plans.slow]\ntenant = { rate = \"1/day\" }\n\n[limits.tenant]\nrate = \"100/s\"\nburst = 1e12\n",
            "cfg.toml:6: limits.tenant: a full refill of 1000000000000 tokens",
        );
    }

    #[test]
    fn within_a_table_the_key_with_a_problem_earliest_in_the_file_is_reported() {
        assert_first(
            "[limits.subject]\nburst = 0\nrate = \"5/mins\"\n",
            "cfg.toml:2: limits.subject.burst must be",
        );
        assert_first(
            "[limits.global]\ndaily_quota = 4\nconcurrency = 4\n",
            "cfg.toml:2: limits.global.daily_quota is not supported",
        );
        assert_first(
            "[upstreams.u]\nreserved_for_batch = \"1/s\"\nheadroom = 0.5\n",
            "cfg.toml:2: upstreams.u.reserved_for_batch needs upstreams.u.published_limit",
        );
        assert_first(
            "[telemetry.otlp]\nprotocol = \"grpc\"\nservice_name = \"x\"\n",
            "cfg.toml:2: [telemetry.otlp] has no endpoint",
        );
    }

    #[test]
    fn a_file_with_one_problem_reports_exactly_that_problem() {
        let text = EXAMPLE.replace("shed_ratio = 0.5", "shed_ratio = 1.5");
        assert_eq!(
            Config::parse("cfg.toml", &text),
            Err(ConfigError {
                file: "cfg.toml".to_string(),
                line: Some(49),
                message: "alerts.shed_ratio must be between 0 and 1 (exclusive), not 1.5"
                    .to_string(),
            })
        );
    }

    #[test]
    fn telemetry_switches_and_caps() {
        let c = Config::parse(
            "c",
            "[telemetry]\nenabled = false\nmax_subjects_total = 50\n",
        )
        .unwrap();
        assert!(!c.telemetry.enabled);
        assert_eq!(c.telemetry.max_subjects_total, 50);
        assert!(Config::default().telemetry.enabled);
        assert_eq!(Config::default().telemetry.max_subjects_total, 10_000);
        let e = err("[telemetry]\nmax_subjects_total = -1\n");
        assert!(
            e.starts_with("cfg.toml:2: telemetry.max_subjects_total must be a whole number"),
            "{e}"
        );
    }

    #[test]
    fn a_value_problem_before_a_line_the_reader_refuses_is_reported_first() {
        // An unknown key, a value of the wrong type, bad syntax: each after a bad value on line 2.
        for later in ["foo = 1\n", "burst = \"x\"\n", "rate = \n"] {
            let e = err(&format!(
                "[limits.subject]\nrate = \"5/mins\"\n[limits.tenant]\n{later}"
            ));
            assert!(
                e.starts_with("cfg.toml:2: limits.subject.rate: invalid rate \"5/mins\""),
                "{later}: {e}"
            );
        }
        // Alone, the refused line is reported, naming the key a wrong type belongs to.
        let e = err("[limits.subject]\nrate = \"5/min\"\n[limits.tenant]\nburst = \"x\"\n");
        assert_eq!(
            e,
            "cfg.toml:4: limits.tenant.burst: invalid type: string \"x\", expected a number"
        );
        let e = err("[server]\nworkers = \"two\"\n");
        assert_eq!(
            e,
            "cfg.toml:2: server.workers: invalid type: string \"two\", expected a whole number"
        );
        let e = err("[limits.subject]\nrate = \"5/min\"\n[limits.tenant]\nfoo = 1\n");
        assert!(e.starts_with("cfg.toml:4: unknown field `foo`"), "{e}");
    }

    #[test]
    fn a_plan_overrides_the_global_layer_for_its_tenants_only() {
        let c = Config::parse(
            "cfg.toml",
            "[limits.global]\nrate = \"100/s\"\nburst = 200\n\
             [plans.free.global]\nrate = \"5/s\"\n[plans.pro.subject]\nburst = 9\n\
             [tenants.globex]\nplan = \"free\"\n[tenants.initech]\nplan = \"pro\"\n",
        )
        .unwrap();
        // The plan's keys over [limits.global]'s; burst not set by the plan stays 200.
        let free = BucketSpec::new(5.0, 200.0);
        assert_eq!(c.tenant_global("globex"), (Some("free"), free));
        assert_eq!(c.plan_global("free"), Some(free));
        // A plan without a global override, and a tenant without a plan, pass [limits.global].
        let global = BucketSpec::new(100.0, 200.0);
        assert_eq!(c.plan_global("pro"), None);
        assert_eq!(c.tenant_global("initech"), (None, global));
        assert_eq!(c.tenant_global("hooli"), (None, global));
        // Checked like [limits.global]: a burst the plan's refill would take centuries to fill.
        let e = err("[plans.free.global]\nrate = \"1/day\"\nburst = 1e15\n");
        assert!(e.starts_with("cfg.toml:3: plans.free.global"), "{e}");
    }

    #[test]
    fn unsupported_and_dead_keys_are_refused_not_ignored() {
        let e = err("[plans.free.global]\nrate = \"1/s\"\nconcurrency = 2\n");
        assert!(
            e.starts_with("cfg.toml:3: plans.free.global.concurrency is not supported"),
            "{e}"
        );
        let e = err("[limits.global]\nconcurrency = 4\n");
        assert!(
            e.starts_with("cfg.toml:2: limits.global.concurrency is not supported"),
            "{e}"
        );
        let e = err("[limits.global]\ndaily_quota = 4\n");
        assert!(
            e.starts_with("cfg.toml:2: limits.global.daily_quota is not supported"),
            "{e}"
        );
        let e = err("[telemetry.otlp]\nsample_ratio = 0.5\n");
        assert!(
            e.starts_with("cfg.toml:2: [telemetry.otlp] has no endpoint"),
            "{e}"
        );
        let e = err("[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nsample_ratio = 1.5\n");
        assert!(
            e.starts_with(
                "cfg.toml:3: telemetry.otlp.sample_ratio must be between 0 and 1, not 1.5"
            ),
            "{e}"
        );
        let c = Config::parse(
            "cfg.toml",
            "[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nsample_ratio = 0.25\n",
        )
        .unwrap();
        assert_eq!(c.telemetry.otlp.unwrap().sample_ratio, 0.25);
        let c = Config::parse(
            "cfg.toml",
            "[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\n",
        )
        .unwrap();
        let otlp = c.telemetry.otlp.unwrap();
        assert_eq!(otlp.sample_ratio, 1.0, "every call is sampled by default");
        assert_eq!(otlp.max_spans_per_second, 1000, "up to 1000 spans a second");
        let c = Config::parse(
            "cfg.toml",
            "[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nmax_spans_per_second = 0\n",
        )
        .unwrap();
        assert_eq!(c.telemetry.otlp.unwrap().max_spans_per_second, 0);
        let e = err("[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nmax_spans_per_second = -5\n");
        assert!(
            e.starts_with("cfg.toml:3: telemetry.otlp.max_spans_per_second must be a whole number from 0 to 10000000, not -5"),
            "{e}"
        );
        let e = err("[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nmax_spans_per_second = 2.5\n");
        assert!(e.starts_with("cfg.toml:3:"), "{e}");
        assert_eq!(otlp_protocol(None), Ok(OtlpProtocol::HttpProtobuf));
        assert_eq!(otlp_protocol(Some("http/json")), Ok(OtlpProtocol::HttpJson));
        assert_eq!(otlp_protocol(Some("grpc")), Ok(OtlpProtocol::Grpc));
        let e = otlp_protocol(Some("http")).unwrap_err();
        assert!(
            e.starts_with("cfg.toml:3: telemetry.otlp.protocol must be \"http/protobuf\", \"http/json\" or \"grpc\", not \"http\""),
            "{e}"
        );
        let e = err("[telemetry.otlp]\nprotocol = \"grpc\"\n");
        assert!(
            e.starts_with("cfg.toml:2: [telemetry.otlp] has no endpoint"),
            "{e}"
        );
        let e = err("[telemetry.otlp]\nmax_spans_per_second = 10\n");
        assert!(
            e.starts_with("cfg.toml:2: [telemetry.otlp] has no endpoint"),
            "{e}"
        );
        // The contract's defaults written out, endpoint (an example there) left out: valid, and
        // nothing is exported.
        let c = Config::parse(
            "cfg.toml",
            "[telemetry]\nmax_subjects_per_tenant = 1000\n[telemetry.otlp]\nservice_name = \"admitd\"\n[alerts]\nshed_ratio = 0.5\n",
        )
        .unwrap();
        assert!(c.telemetry.otlp.is_none(), "no endpoint, no export");
        let e = err("[tools.x]\ncost = 0\n");
        assert!(
            e.starts_with(
                "cfg.toml:2: tools.x.cost must be a number greater than 0 and at most 1e15, not 0"
            ),
            "{e}"
        );
    }

    #[test]
    fn tool_rate_without_burst_gets_one_second_of_burst() {
        let c = Config::parse(
            "c",
            "[tools.t]\nrate = \"5/s\"\n[tools.u]\nrate = \"1/min\"\n",
        )
        .unwrap();
        assert_eq!(c.tools["t"].bucket.unwrap().burst, 5.0);
        assert_eq!(c.tools["u"].bucket.unwrap().burst, 1.0);
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("acme").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name(&"x".repeat(129)).is_err());
        assert!(check_name(&"x".repeat(128)).is_ok());
        assert!(check_name("a\u{7}b").is_err());
        assert!(check_name("ünïcødé").is_ok());
    }

    #[test]
    fn load_reports_missing_file() {
        let e = Config::load(Path::new("/nonexistent/admitd.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/nonexistent/admitd.toml: cannot read"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod upstream_config_tests;
