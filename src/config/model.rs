//! The validated config model: the typed policy the engine, actors, API and telemetry read.
//!
//! Everything here has already passed validation (`validate.rs`), so a value in these types is one the
//! daemon accepts: rates are positive, buckets refill within [`MAX_REFILL_YEARS`](super::MAX_REFILL_YEARS),
//! every plan a tenant names exists. Code below the config layer (the engine) may depend on this model,
//! never on the file's shape (`raw.rs`) or on how it is checked.

use std::net::SocketAddr;
use std::time::Duration;

use super::units::Rate;

/// The config's name-keyed maps. Tools and upstreams are looked up several times per admission by a
/// caller's name, so with a fast hasher (the keys are the operator's: nothing to flood).
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

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
    pub(super) fn apply(&self, base: &LayerLimits) -> LayerLimits {
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
    /// How a shared upstream's learned ceiling is held and probed.
    pub probe: Probing,
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
            probe: Probing::default(),
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

/// How a shared upstream's rate holds below the ceiling its 429s taught and probes above it (see
/// `engine::probe`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probing {
    /// The wait before the first probe, and after a clean one's climb ends; doubled after each
    /// probe that draws a 429, up to three times this.
    pub every: Duration,
    /// How far above the ceiling the first probe goes, as a share of the ceiling; doubled after
    /// each clean probe.
    pub step: f64,
    /// The share of the ceiling the rate holds at between probes.
    pub hold: f64,
}

impl Probing {
    pub fn every_ns(&self) -> u64 {
        u64::try_from(self.every.as_nanos()).unwrap_or(u64::MAX)
    }
}

impl Default for Probing {
    fn default() -> Self {
        Probing {
            every: Duration::from_secs(10),
            step: 0.05,
            hold: 0.9,
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
    pub listen: super::ListenAddr,
    /// Whether the file sets `listen` itself (else it is the default).
    pub listen_in_file: bool,
    /// Mode and group of the Unix socket file, when `listen` is one.
    pub socket: super::SocketOptions,
    /// Caller, admin and metrics tokens.
    pub auth: super::ServerAuth,
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
    /// `hash_identities = true`: the key of the keyed identity hashes in logs and spans.
    pub identity_key: Option<super::IdentityKey>,
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
    /// Optional Alertmanager base URL; alerts are sent with a POST to `{url}/api/v2/alerts`.
    pub alertmanager_url: Option<String>,
}

/// The whole validated config.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it came from, for reloads and messages; `None` for built-in defaults.
    pub path: Option<String>,
    /// `--listen` from the command line, which wins over the file's `[server] listen` on reloads too.
    pub listen_override: Option<super::ListenAddr>,
    pub server: ServerConfig,
    pub limits: Limits,
    pub plans: HashMap<String, Plan>,
    pub tenants: HashMap<String, TenantConfig>,
    pub tools: HashMap<String, ToolConfig>,
    pub upstreams: HashMap<String, UpstreamConfig>,
    pub telemetry: TelemetryConfig,
    pub alerts: AlertsConfig,
    /// `[edge]`: the gateway check; off (the route answers 404) when the section is absent.
    pub edge: Option<super::EdgeConfig>,
    pub state: super::StateConfig,
    pub overload: super::OverloadConfig,
    pub store: super::store::StoreConfig,
    /// `[tasks]`: long-running calls answered as MCP tasks.
    pub tasks: super::TasksConfig,
    /// `[advice]`: the traffic kept for `GET /v1/advice`.
    pub advice: super::AdviceConfig,
    /// `[spend.*]` with the tools' estimates and the plans' budgets.
    pub spend: super::SpendConfig,
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

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig {
            shed_ratio: 0.5,
            window: Duration::from_secs(300),
            for_: Duration::from_secs(60),
            min_calls: 100,
            clear_ratio: 0.4,
            alertmanager_url: None,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            path: None,
            listen_override: None,
            server: ServerConfig {
                listen: super::ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 9470))),
                listen_in_file: false,
                socket: super::SocketOptions::default(),
                auth: super::ServerAuth::default(),
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
                identity_key: None,
            },
            alerts: AlertsConfig::default(),
            edge: None,
            state: Default::default(),
            overload: Default::default(),
            store: super::store::StoreConfig::default(),
            tasks: Default::default(),
            advice: super::AdviceConfig::default(),
            spend: super::SpendConfig::default(),
        }
    }
}

impl Config {
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

    /// This config with every limit divided among `n` replicas: what one replica enforces alone
    /// while the shared store does not answer (`on_error = "local_fallback"`). Rates, bursts, daily
    /// quotas and concurrency are divided; a burst keeps at least one token and a concurrency cap at
    /// least one slot (below that a replica could admit nothing), so a fleet may then admit a little
    /// more than the limit, never `n` times it.
    pub fn divided(&self, n: u32) -> Config {
        let n = f64::from(n.max(1));
        let bucket = |b: BucketSpec| BucketSpec {
            rate: Rate::per_sec(b.rate.per_sec / n),
            burst: (b.burst / n).max(b.burst.min(1.0)),
        };
        let slots = |c: Option<u32>| c.map(|c| ((f64::from(c) / n).floor() as u32).max(1));
        let rate = |r: Option<Rate>| r.map(|r| Rate::per_sec(r.per_sec / n));
        let burst = |b: Option<f64>| b.map(|b| (b / n).max(b.min(1.0)));
        let layer = |l: &LayerLimits| LayerLimits {
            bucket: bucket(l.bucket),
            concurrency: slots(l.concurrency),
            daily_quota: l.daily_quota.map(|q| q / n),
        };
        let overrides = |o: &LayerOverride| LayerOverride {
            rate: rate(o.rate),
            burst: burst(o.burst),
            concurrency: slots(o.concurrency),
            daily_quota: o.daily_quota.map(|q| q / n),
        };
        let mut out = self.clone();
        out.limits = Limits {
            subject: layer(&self.limits.subject),
            tenant: layer(&self.limits.tenant),
            global: layer(&self.limits.global),
        };
        for p in out.plans.values_mut() {
            *p = Plan {
                subject: overrides(&p.subject),
                tenant: overrides(&p.tenant),
                global: overrides(&p.global),
                weight: p.weight,
            };
        }
        for t in out.tools.values_mut() {
            t.bucket = t.bucket.map(bucket);
        }
        for u in out.upstreams.values_mut() {
            u.bucket = u.bucket.map(bucket);
        }
        let budgets = |b: &mut super::SpendBudgets| {
            for x in [&mut b.tenant_daily, &mut b.subject_daily, &mut b.run] {
                *x = x.map(|x| x / n);
            }
        };
        for u in &mut out.spend.units {
            budgets(&mut u.budgets);
        }
        for p in out.spend.plans.values_mut() {
            p.iter_mut().for_each(|(_, b)| budgets(b));
        }
        out
    }

    /// The number of worker threads to run.
    pub fn worker_count(&self) -> usize {
        if self.server.workers > 0 {
            self.server.workers
        } else {
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
        }
    }
}
