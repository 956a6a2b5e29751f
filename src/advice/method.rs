//! The method: the shape of each key's traffic over a period, and limits proposed from the spread
//! of those shapes across keys.
//!
//! For every key (a subject, a tenant, a subject's calls of one tool, a tenant's calls to one
//! upstream) the period gives its rate, the units it sent in each fixed one-second window, its
//! largest burst (the most units in any one second, sliding), the calls it had in flight when each
//! of its calls began (released calls only: an unreleased call has no known end), and how long its
//! calls ran. A limit is then proposed from percentiles *across keys*, never across all calls, so
//! one runaway is one key out of many and does not set the numbers:
//!
//! - `rate`: twice the 95th percentile of the keys' rates;
//! - `burst`: the 95th percentile of the keys' largest bursts (and no less than the largest single
//!   call, which could never fit otherwise);
//! - `concurrency` (subjects and tenants): the larger of the 95th percentile of the keys' most
//!   calls in flight and the proposed call rate times the 95th percentile of the durations
//!   (Little's law), kept as configured when fewer than half the calls were released.
//!
//! A tenant (and a tenant's use of an upstream) is measured on the calls its subjects would send
//! under the proposed subject limit: a runaway subject inside a tenant would be held to that limit,
//! so it does not size the tenant either. Rates and bursts are in cost units, as buckets count.

use std::collections::{BTreeMap, BinaryHeap, HashMap};

use serde::Serialize;

use super::recording::{Period, PeriodCall, OTHER};
use crate::config::Config;

/// Nearest-rank percentile `q` (0..=1) of sorted values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// The shape of one key's traffic over a period.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shape {
    pub calls: u64,
    /// Cost units per second over the period.
    pub rate: f64,
    /// Calls per second over the period.
    pub call_rate: f64,
    /// Units per fixed one-second window of the period (idle seconds count as 0).
    pub window_p50: f64,
    pub window_p95: f64,
    pub window_p99: f64,
    /// The most units in any one second (sliding).
    pub burst: f64,
    /// Calls in flight when each released call began: 95th percentile and most.
    pub inflight_p95: f64,
    pub inflight_max: f64,
    pub released: u64,
    /// Durations of the released calls, in milliseconds: 95th percentile (`None` without any).
    pub duration_p95_ms: Option<f64>,
    /// The largest single call, in units.
    pub largest_call: f64,
}

/// The shape of calls (in time order) over a period of `over_ms`.
pub fn shape(calls: &[&PeriodCall], over_ms: u64) -> Shape {
    let secs = (over_ms as f64 / 1000.0).max(1.0);
    let mut s = Shape {
        calls: calls.len() as u64,
        ..Shape::default()
    };
    let units: f64 = calls.iter().map(|c| c.cost()).sum();
    s.rate = units / secs;
    s.call_rate = calls.len() as f64 / secs;
    s.largest_call = calls.iter().map(|c| c.cost()).fold(0.0, f64::max);

    // Fixed windows: the idle ones are the 0s below the busy ones.
    let mut windows: BTreeMap<u64, f64> = BTreeMap::new();
    for c in calls {
        *windows.entry(c.at_ms() / 1000).or_default() += c.cost();
    }
    let busy = sorted(windows.into_values().collect());
    let all = secs.ceil() as usize;
    let idle = all.saturating_sub(busy.len());
    let window = |q: f64| {
        let rank = ((q * all.max(busy.len()) as f64).ceil() as usize).max(1);
        if rank <= idle {
            0.0
        } else {
            busy.get(rank - idle - 1)
                .copied()
                .unwrap_or_else(|| busy.last().copied().unwrap_or(0.0))
        }
    };
    s.window_p50 = window(0.5);
    s.window_p95 = window(0.95);
    s.window_p99 = window(0.99);

    // Sliding one-second windows.
    let (mut from, mut inside) = (0usize, 0.0f64);
    for (i, c) in calls.iter().enumerate() {
        inside += c.cost();
        while calls[from].at_ms() + 1000 <= c.at_ms() {
            inside -= calls[from].cost();
            from += 1;
        }
        debug_assert!(from <= i);
        s.burst = s.burst.max(inside);
    }

    // In flight: released calls only, each from its decision to its release.
    let mut ends: BinaryHeap<std::cmp::Reverse<u64>> = BinaryHeap::new();
    let mut inflight = Vec::new();
    let mut durations = Vec::new();
    for c in calls {
        let Some(held) = c.held_ms() else { continue };
        while ends.peek().is_some_and(|e| e.0 <= c.at_ms()) {
            ends.pop();
        }
        ends.push(std::cmp::Reverse(c.at_ms() + u64::from(held)));
        inflight.push(ends.len() as f64);
        if let Some(d) = c.duration_ms() {
            durations.push(f64::from(d));
        }
    }
    s.released = inflight.len() as u64;
    let inflight = sorted(inflight);
    s.inflight_p95 = percentile(&inflight, 0.95);
    s.inflight_max = inflight.last().copied().unwrap_or(0.0);
    let durations = sorted(durations);
    s.duration_p95_ms = (!durations.is_empty()).then(|| percentile(&durations, 0.95));
    s
}

/// How a value spreads across keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Spread {
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
}

impl Spread {
    fn of(values: impl Iterator<Item = f64>) -> Spread {
        let v = sorted(values.collect());
        Spread {
            p50: round3(percentile(&v, 0.5)),
            p95: round3(percentile(&v, 0.95)),
            max: round3(v.last().copied().unwrap_or(0.0)),
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The traffic of one kind of key, spread across its keys (what the advice shows as `observed`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Observed {
    pub keys: usize,
    pub calls: u64,
    /// Cost units per second.
    pub rate_per_s: Spread,
    /// Units per one-second window: each key's 99th percentile.
    pub window_p99: Spread,
    /// Each key's largest burst (units in one second).
    pub burst: Spread,
    /// Each key's most calls in flight.
    pub inflight_max: Spread,
    /// Each key's 95th percentile of call durations, in milliseconds.
    pub duration_p95_ms: Spread,
}

/// A proposed limit and what each of its numbers came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Proposed {
    /// In the config's rate syntax.
    pub rate: String,
    #[serde(skip)]
    pub rate_per_s: f64,
    pub burst: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    pub from: BTreeMap<&'static str, String>,
}

/// Everything the method proposes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Proposal {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject: Option<Proposed>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<Proposed>,
    pub tools: BTreeMap<String, Proposed>,
    pub upstreams: BTreeMap<String, Proposed>,
}

/// `per_s` in the config's rate syntax, rounded up to a whole number in the largest unit that keeps
/// it at least 1 (never below what was asked for), and at most the largest rate a config may hold
/// (1e15 per second): calls of absurd cost must not propose a config that does not validate.
pub fn rate_text(per_s: f64) -> String {
    let per_s = if per_s.is_finite() {
        per_s.min(1e15)
    } else {
        1e15
    };
    if per_s >= 100.0 {
        format!("{}/s", per_s.ceil() as u64)
    } else if per_s * 60.0 >= 1.0 {
        format!("{}/min", (per_s * 60.0 - 1e-9).ceil().max(1.0) as u64)
    } else {
        format!("{}/h", (per_s * 3600.0 - 1e-9).ceil().max(1.0) as u64)
    }
}

fn fmt(x: f64) -> String {
    if x >= 100.0 || x == x.round() {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// A limit for keys of one kind (`what`, plural, for the explanations) from their shapes.
/// `concurrency`: propose one (subjects, tenants). `None` without any traffic.
fn propose(shapes: &[Shape], what: &str, concurrency: bool) -> Option<Proposed> {
    let busy: Vec<&Shape> = shapes.iter().filter(|s| s.calls > 0).collect();
    if busy.is_empty() {
        return None;
    }
    let n = busy.len();
    let rates = sorted(busy.iter().map(|s| s.rate).collect());
    let p95_rate = percentile(&rates, 0.95);
    let rate_per_s = (2.0 * p95_rate).max(1.0 / 3600.0);
    let mut from = BTreeMap::new();
    from.insert(
        "rate",
        format!(
            "2 x the 95th percentile of the rates of {n} {what} ({}/s; median {}/s, most {}/s)",
            fmt(p95_rate),
            fmt(percentile(&rates, 0.5)),
            fmt(rates[n - 1])
        ),
    );
    let bursts = sorted(busy.iter().map(|s| s.burst).collect());
    let p95_burst = percentile(&bursts, 0.95);
    let largest_call = busy.iter().map(|s| s.largest_call).fold(0.0, f64::max);
    let burst = p95_burst.max(largest_call).ceil().max(1.0);
    from.insert(
        "burst",
        if largest_call > p95_burst {
            format!(
                "the largest single call ({}), above the 95th percentile of the largest bursts of {n} {what} ({})",
                fmt(largest_call),
                fmt(p95_burst)
            )
        } else {
            format!(
                "the 95th percentile of the largest bursts in one second of {n} {what} ({}; most {})",
                fmt(p95_burst),
                fmt(bursts[n - 1])
            )
        },
    );
    let concurrency = concurrency
        .then(|| {
            let calls: u64 = busy.iter().map(|s| s.calls).sum();
            let released: u64 = busy.iter().map(|s| s.released).sum();
            if released * 2 < calls {
                from.insert(
                    "concurrency",
                    format!("kept as configured: only {released} of {calls} calls were released in the period, so how long calls run is not known"),
                );
                return None;
            }
            let inflight = sorted(busy.iter().map(|s| s.inflight_max).collect());
            let p95_inflight = percentile(&inflight, 0.95);
            let durations = sorted(busy.iter().filter_map(|s| s.duration_p95_ms).collect());
            let p95_duration_s = percentile(&durations, 0.95) / 1000.0;
            let call_rates = sorted(busy.iter().map(|s| s.call_rate).collect());
            let call_rate = 2.0 * percentile(&call_rates, 0.95);
            let little = call_rate * p95_duration_s;
            // Never below the burst: calls the bucket lets through at once must not be refused
            // for running at once.
            let c = p95_inflight.max(little).max(burst).ceil().max(1.0);
            from.insert(
                "concurrency",
                format!(
                    "the largest of: the 95th percentile of the most calls in flight of {n} {what} ({}); 2 x the 95th percentile call rate ({}/s) x the 95th percentile duration ({} ms); the burst",
                    fmt(p95_inflight),
                    fmt(call_rate / 2.0),
                    fmt(p95_duration_s * 1000.0)
                ),
            );
            Some(c.min(f64::from(u32::MAX)) as u32)
        })
        .flatten();
    let proposed_per_s = parsed_rate(&rate_text(rate_per_s)).unwrap_or(rate_per_s);
    Some(Proposed {
        rate: rate_text(rate_per_s),
        rate_per_s: proposed_per_s,
        burst: burst_within(burst, proposed_per_s),
        concurrency,
        from,
    })
}

/// `burst` as a proposal may hold it: at most 1e15, and at most a year of refill at `per_s`, far
/// inside the 50 years a config accepts even for an upstream throttled to an `aimd_floor` of 0.02
/// (calls of absurd cost in a slow recording must not propose a bucket that does not validate).
pub fn burst_within(burst: f64, per_s: f64) -> u64 {
    let year = per_s * 365.25 * 86_400.0;
    burst.min(1e15).min(year.floor()).max(1.0) as u64
}

fn parsed_rate(text: &str) -> Option<f64> {
    crate::config::parse_rate(text).ok().map(|r| r.per_sec)
}

/// Calls of one key, in time order.
type Groups<'a, K> = HashMap<K, Vec<&'a PeriodCall>>;

fn group<'a, K: std::hash::Hash + Eq>(
    calls: impl Iterator<Item = &'a PeriodCall>,
    key: impl Fn(&PeriodCall) -> Option<K>,
) -> Groups<'a, K> {
    let mut g: Groups<'a, K> = HashMap::new();
    for c in calls {
        if let Some(k) = key(c) {
            g.entry(k).or_default().push(c);
        }
    }
    g
}

/// The calls a token bucket of `rate_per_s` and `burst` lets through, per key (a plain model of a
/// bucket, enough to keep a runaway subject from sizing its tenant).
fn within_bucket<'a>(
    groups: &Groups<'a, (u32, u32)>,
    rate_per_s: f64,
    burst: f64,
) -> Vec<&'a PeriodCall> {
    let mut passed = Vec::new();
    for calls in groups.values() {
        let (mut tokens, mut last) = (burst, 0u64);
        for c in calls {
            tokens =
                (tokens + (c.at_ms().saturating_sub(last)) as f64 / 1000.0 * rate_per_s).min(burst);
            last = c.at_ms();
            if tokens + 1e-9 >= c.cost() {
                tokens -= c.cost();
                passed.push(*c);
            }
        }
    }
    passed.sort_by_key(|c| c.at_ms());
    passed
}

/// The shapes of each group.
fn shapes<K>(groups: &Groups<'_, K>, over_ms: u64) -> Vec<Shape> {
    groups.values().map(|calls| shape(calls, over_ms)).collect()
}

fn observed(shapes: &[Shape]) -> Observed {
    Observed {
        keys: shapes.len(),
        calls: shapes.iter().map(|s| s.calls).sum(),
        rate_per_s: Spread::of(shapes.iter().map(|s| s.rate)),
        window_p99: Spread::of(shapes.iter().map(|s| s.window_p99)),
        burst: Spread::of(shapes.iter().map(|s| s.burst)),
        inflight_max: Spread::of(shapes.iter().map(|s| s.inflight_max)),
        duration_p95_ms: Spread::of(shapes.iter().filter_map(|s| s.duration_p95_ms)),
    }
}

/// What the method saw and proposes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Method {
    pub proposal: Proposal,
    /// By kind of key: `subject`, `tenant`, `tool:NAME`, `upstream:NAME`.
    pub observed: BTreeMap<String, Observed>,
    /// Calls whose subject was folded into `__other__` (past `[advice] max_subjects`): counted for
    /// their tenant, left out of the subjects' percentiles and of the replay.
    pub folded_calls: u64,
}

/// Runs the method over a period, for a daemon running `cfg`.
pub fn run(period: &Period, cfg: &Config) -> Method {
    let over = period.over_ms;
    let other = period
        .names
        .iter()
        .position(|n| n == OTHER)
        .map(|i| i as u32);
    let folded = |c: &PeriodCall| Some(c.subject()) == other;
    let mut m = Method {
        folded_calls: period.calls.iter().filter(|c| folded(c)).count() as u64,
        ..Method::default()
    };

    let subjects = group(period.calls.iter(), |c| {
        (!folded(c)).then_some((c.tenant(), c.subject()))
    });
    let subject_shapes = shapes(&subjects, over);
    m.proposal.subject = propose(&subject_shapes, "subjects", true);
    m.observed
        .insert("subject".into(), observed(&subject_shapes));

    // Tenants and upstreams see what the proposed subject limit lets through.
    let mut through = match &m.proposal.subject {
        Some(p) => within_bucket(&subjects, p.rate_per_s, p.burst as f64),
        None => Vec::new(),
    };
    through.extend(period.calls.iter().filter(|c| folded(c)));
    through.sort_by_key(|c| c.at_ms());
    let tenants = group(through.iter().copied(), |c| Some(c.tenant()));
    let tenant_shapes = shapes(&tenants, over);
    m.proposal.tenant = propose(&tenant_shapes, "tenants", true);
    if let (Some(t), Some(s)) = (&mut m.proposal.tenant, &m.proposal.subject) {
        // A tenant's limit below one subject's would make the subject's meaningless.
        if t.rate_per_s < s.rate_per_s {
            t.rate = s.rate.clone();
            t.rate_per_s = s.rate_per_s;
            t.from.insert(
                "rate",
                "the proposed subject rate (the tenants' own came out lower)".into(),
            );
        }
        if t.burst < s.burst {
            t.burst = s.burst;
            t.from.insert(
                "burst",
                "the proposed subject burst (the tenants' own came out lower)".into(),
            );
        }
    }
    m.observed.insert("tenant".into(), observed(&tenant_shapes));

    // Per tool: each subject's calls of it (scope subject_tool).
    let by_tool = group(period.calls.iter(), |c| (!folded(c)).then_some(c.tool()));
    for (tool, calls) in &by_tool {
        let name = period.name(*tool);
        if name == OTHER {
            continue;
        }
        let pairs = group(calls.iter().copied(), |c| Some((c.tenant(), c.subject())));
        let s = shapes(&pairs, over);
        if let Some(p) = propose(&s, &format!("subjects calling {name}"), false) {
            m.proposal.tools.insert(name.to_string(), p);
        }
        m.observed.insert(format!("tool:{name}"), observed(&s));
    }

    // Per upstream: each tenant's calls to it, or everyone's when it is shared.
    let by_upstream = group(through.iter().copied(), PeriodCall::upstream);
    for (upstream, calls) in &by_upstream {
        let name = period.name(*upstream);
        if name == OTHER {
            continue;
        }
        let configured = cfg.upstreams.get(name);
        let shared = configured.is_some_and(|u| u.shared);
        let pairs = group(calls.iter().copied(), |c| {
            Some(if shared { 0 } else { c.tenant() })
        });
        let s = shapes(&pairs, over);
        m.observed.insert(format!("upstream:{name}"), observed(&s));
        if configured.is_some_and(|u| u.published_limit.is_some()) {
            // Its budget is derived from what the upstream publishes: that is the better source.
            continue;
        }
        let what = if shared {
            "callers of the shared"
        } else {
            "tenants calling"
        };
        if let Some(p) = propose(&s, &format!("{what} {name}"), false) {
            m.proposal.upstreams.insert(name.to_string(), p);
        }
    }
    m
}
