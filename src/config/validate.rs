//! Validation: turns the raw file shape into the typed model, reporting the first problem as
//! `FILE:LINE: message`.
//!
//! Every section is checked as items (`[SECTION.NAME]`), and [`FirstProblem`] keeps the problem
//! earliest in the file, whatever order the sections are visited in, so an operator fixing errors top
//! to bottom sees them in that order.

use std::collections::BTreeMap;
use std::time::Duration;

use super::raw::*;
use super::units::{parse_duration, parse_rate, Rate};
use super::*;

/// The longest a bucket may take to refill from empty. No rate limit needs a refill anywhere near
/// this long (longer budgets are what `daily_quota` is for), and the bound keeps every bucket time,
/// throttled by an upstream's `aimd_floor` or not, far inside the engine's 64-bit nanoseconds
/// (584 years).
pub const MAX_REFILL_YEARS: f64 = 50.0;
const SECS_PER_YEAR: f64 = 365.25 * 86_400.0;

/// A number for an error message: plain up to six decimals, else in exponent form (`1e-300`).
pub(super) fn short_num(x: f64) -> String {
    if (1e-6..1e15).contains(&x) {
        let s = format!("{x:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:e}")
    }
}

/// `years` for an error message: whole years, or "forever" past any sensible number.
pub(super) fn years_text(years: f64) -> String {
    if years.is_finite() && years < 1e12 {
        format!("{years:.0} years")
    } else {
        "practically forever".to_string()
    }
}

/// Where a layer's bucket shape is set in the file: its burst, else its rate.
pub(super) fn layer_span(raw: &RawLayer) -> Option<std::ops::Range<usize>> {
    raw.burst
        .as_ref()
        .map(toml::Spanned::span)
        .or(raw.rate.as_ref().map(toml::Spanned::span))
}

pub(super) struct Validator<'a> {
    pub(super) file: &'a str,
    pub(super) text: &'a str,
}

impl Validator<'_> {
    pub(super) fn err<T>(
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

    pub(super) fn rate(&self, key: &str, v: &S<String>) -> Result<Rate, ConfigError> {
        parse_rate(v.get_ref()).or_else(|e| self.err(v.span(), format!("{key}: {e}")))
    }

    pub(super) fn duration(
        &self,
        key: &str,
        v: &S<String>,
        max: Duration,
    ) -> Result<Duration, ConfigError> {
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

    pub(super) fn positive(&self, key: &str, v: &S<f64>, min: f64) -> Result<f64, ConfigError> {
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

    pub(super) fn count(
        &self,
        key: &str,
        v: &S<i64>,
        min: i64,
        max: i64,
    ) -> Result<i64, ConfigError> {
        let x = *v.get_ref();
        if x < min || x > max {
            return self.err(
                v.span(),
                format!("{key} must be a whole number from {min} to {max}, not {x}"),
            );
        }
        Ok(x)
    }

    pub(super) fn name(
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
    pub(super) fn rate_backstop_only(
        &self,
        section: &str,
        raw: &RawLayer,
    ) -> Result<(), ConfigError> {
        let unsupported = earliest([
            (
                "concurrency",
                raw.concurrency.as_ref().map(toml::Spanned::span),
            ),
            (
                "daily_quota",
                raw.daily_quota.as_ref().map(toml::Spanned::span),
            ),
        ]);
        match unsupported {
            Some((key, at)) => self.err(at, format!("{section}.{key} is not supported: the global layer is a rate backstop only; set {key} in [limits.subject] or [limits.tenant]")),
            None => Ok(()),
        }
    }

    pub(super) fn layer_override(
        &self,
        section: &str,
        raw: &RawLayer,
    ) -> Result<LayerOverride, ConfigError> {
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
    pub(super) fn optional_bucket(
        &self,
        section: &str,
        span: std::ops::Range<usize>,
        rate: Option<&S<String>>,
        burst: Option<&S<f64>>,
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
                let at = b.map_or(r.span(), toml::Spanned::span);
                self.refill_fits(section, at, spec, 1.0)?;
                Ok(Some(spec))
            }
        }
    }

    pub(super) fn fraction(
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
    pub(super) fn refill_fits(
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

    pub(super) fn upstream(
        &self,
        section: &str,
        span: std::ops::Range<usize>,
        u: &RawUpstream,
    ) -> Result<UpstreamConfig, ConfigError> {
        let mut out = UpstreamConfig {
            shared: u.shared.unwrap_or(false),
            ..UpstreamConfig::default()
        };
        if let Some(p) = &u.published_limit {
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
                let at = u
                    .reserved_for_batch
                    .as_ref()
                    .map_or(p.span(), toml::Spanned::span);
                return self.err(
                    at,
                    format!(
                        "{section}.reserved_for_batch leaves nothing of published_limit for agents"
                    ),
                );
            }
            let burst = match &u.burst {
                Some(b) => self.positive(&format!("{section}.burst"), b, 1.0)?,
                None => rate.ceil().max(1.0),
            };
            out.bucket = Some(BucketSpec::new(rate, burst));
            out.published_limit = Some(published);
            out.reserved_for_batch = reserved;
        } else {
            let needs_published = earliest([
                ("headroom", u.headroom.as_ref().map(toml::Spanned::span)),
                (
                    "reserved_for_batch",
                    u.reserved_for_batch.as_ref().map(toml::Spanned::span),
                ),
            ]);
            if let Some((key, at)) = needs_published {
                return self.err(
                    at,
                    format!("{section}.{key} needs {section}.published_limit"),
                );
            }
            out.bucket =
                self.optional_bucket(section, span.clone(), u.rate.as_ref(), u.burst.as_ref())?;
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
                .map(toml::Spanned::span)
                .or(u.rate.as_ref().map(toml::Spanned::span))
                .or(u.published_limit.as_ref().map(toml::Spanned::span))
                .unwrap_or(span.clone());
            if u.published_limit.is_some() {
                // A bucket from rate and burst was checked where it was read.
                self.refill_fits(section, shape.clone(), spec, 1.0)?;
            }
            let at = u.aimd_floor.as_ref().map_or(shape, toml::Spanned::span);
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
        if let Some(v) = &u.probe_every {
            out.probe.every = self.duration(
                &format!("{section}.probe_every"),
                v,
                Duration::from_secs(600),
            )?;
            if out.probe.every < Duration::from_secs(1) {
                return self.err(
                    v.span(),
                    format!("{section}.probe_every must be at least 1s"),
                );
            }
        }
        if let Some(v) = &u.probe_step {
            out.probe.step = self.fraction(&format!("{section}.probe_step"), v, 0.0, 1.0)?;
        }
        if let Some(v) = &u.probe_hold {
            out.probe.hold = self.fraction(&format!("{section}.probe_hold"), v, 0.0, 1.0)?;
        }
        Ok(out)
    }

    /// Validates the whole file. Each independent item (the server table, each `[limits.*]` layer, each
    /// plan, tenant, tool and upstream, the telemetry and alerts tables) is checked up to its first
    /// problem, and of those the one on the lowest line is reported: the order the sections are checked
    /// in here is not the order an operator reads the file in.
    pub(super) fn config(&self, raw: RawConfig) -> Result<Config, ConfigError> {
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

        let spend_units = raw.spend.unwrap_or_default();
        cfg.spend.units = self.spend_units(&spend_units, &mut first);

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
        let tools = raw.tools.unwrap_or_default();
        cfg.tools = first.each(&tools, |name, tool| self.tool(name, tool));
        let units = &cfg.spend.units;
        let tool_spend = tools
            .iter()
            .filter_map(|(n, t)| Some((n, t.get_ref().spend.as_ref()?)));
        cfg.spend.tools = tool_spend
            .filter_map(|(n, s)| Some((n.clone(), first.note(self.tool_spend(n, s, units))?)))
            .collect();
        let plan_spend = plans
            .iter()
            .filter_map(|(n, p)| Some((n, p.get_ref().spend.as_ref()?)));
        cfg.spend.plans = plan_spend
            .filter_map(|(n, s)| Some((n.clone(), first.note(self.plan_spend(n, s, units))?)))
            .collect();
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
        if let Some(e) = raw.edge {
            cfg.edge = first.note(self.edge(e));
        }
        if let Some(st) = raw.state {
            first.note(self.state(st, &mut cfg.state));
        }
        if let Some(o) = raw.overload {
            first.note(self.overload(o, &mut cfg.overload));
        }
        if let Some(s) = raw.store {
            first.note(self.store(s, &mut cfg.store));
        }
        if let Some(t) = raw.tasks {
            first.note(self.tasks(t, &mut cfg.tasks));
        }
        if let Some(a) = raw.advice {
            first.note(self.advice(a, &mut cfg.advice));
        }

        first.or(cfg)
    }

    /// `[server]`, over the defaults in `out`.
    pub(super) fn server(&self, s: RawServer, out: &mut ServerConfig) -> Result<(), ConfigError> {
        self.listen(&s, out)?;
        self.server_auth(&s, &mut out.auth)?;
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
    pub(super) fn limits_layer(
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
    pub(super) fn plan(
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
    pub(super) fn tenant(
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
                    let meant = super::lint::did_you_mean(p.get_ref(), known.iter().copied());
                    let known = match meant {
                        Some(m) => {
                            format!("did you mean {m:?}? defined plans: {}", known.join(", "))
                        }
                        None if known.is_empty() => "no plans are defined".to_string(),
                        None => format!("defined plans: {}", known.join(", ")),
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
    pub(super) fn tool(&self, name: &str, tool: &S<RawTool>) -> Result<ToolConfig, ConfigError> {
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
        let bucket = self.optional_bucket(&section, span, t.rate.as_ref(), t.burst.as_ref())?;
        Ok(ToolConfig {
            cost,
            upstream,
            upstreams,
            bucket,
        })
    }

    /// `[telemetry]`, over the defaults in `out`.
    pub(super) fn telemetry(
        &self,
        t: RawTelemetry,
        out: &mut TelemetryConfig,
    ) -> Result<(), ConfigError> {
        out.identity_key = self.identity_key(&t)?;
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
                    (
                        "sample_ratio",
                        o.sample_ratio.as_ref().map(toml::Spanned::span),
                    ),
                    (
                        "max_spans_per_second",
                        o.max_spans_per_second.as_ref().map(toml::Spanned::span),
                    ),
                    ("protocol", o.protocol.as_ref().map(toml::Spanned::span)),
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
                .map(toml::Spanned::into_inner)
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
    pub(super) fn alerts(&self, a: RawAlerts, out: &mut AlertsConfig) -> Result<(), ConfigError> {
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
pub(super) struct FirstProblem(Option<ConfigError>);

impl FirstProblem {
    /// The value of `r`, or `None` once its error is noted.
    pub(super) fn note<T>(&mut self, r: Result<T, ConfigError>) -> Option<T> {
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
    pub(super) fn each<R, T>(
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
    pub(super) fn or<T>(self, value: T) -> Result<T, ConfigError> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(value),
        }
    }
}

/// Of several keys, each with its span when it is set, the one set earliest in the file.
pub(super) fn earliest<K>(
    keys: impl IntoIterator<Item = (K, Option<std::ops::Range<usize>>)>,
) -> Option<(K, std::ops::Range<usize>)> {
    keys.into_iter()
        .filter_map(|(key, span)| Some((key, span?)))
        .min_by_key(|(_, span)| span.start)
}
