//! Every metric name, its help text, label and histogram bucket layout, in one place.
//!
//! Dashboards and alert rules (in `dashboards/` and `alerts/`) depend on these names; docs/metrics.md
//! documents them. Conventions: `admitd_` prefix, `_total` on counters, base units (`_seconds`).

use metrics::Unit;

pub const ADMISSIONS: &str = "admitd_admissions_total";
pub const ADMISSION_WAIT: &str = "admitd_admission_wait_seconds";
pub const RETRY_AFTER: &str = "admitd_retry_after_seconds";
pub const DECISION_DURATION: &str = "admitd_decision_duration_seconds";
pub const TOOL_DURATION: &str = "admitd_tool_duration_seconds";
pub const UPSTREAM_RESPONSES: &str = "admitd_upstream_responses_total";
pub const LEASE_EXPIRIES: &str = "admitd_lease_expiries_total";
pub const INFLIGHT: &str = "admitd_inflight";
pub const WAITING: &str = "admitd_waiting";
pub const BUCKET_UTILIZATION: &str = "admitd_bucket_utilization";
pub const GLOBAL_UTILIZATION: &str = "admitd_global_utilization";
pub const UPSTREAM_PENALTY: &str = "admitd_upstream_penalty_seconds";
pub const UPSTREAM_EFFECTIVE_RATE: &str = "admitd_upstream_effective_rate";
pub const UPSTREAM_THROTTLE: &str = "admitd_upstream_throttle_probability";
pub const DAILY_QUOTA_USED: &str = "admitd_daily_quota_used";
pub const DAILY_QUOTA_LIMIT: &str = "admitd_daily_quota_limit";
pub const TENANT_SHED_RATIO: &str = "admitd_tenant_shed_ratio";
pub const ALERT_FIRING: &str = "admitd_alert_firing";
pub const TENANT_ACTORS: &str = "admitd_tenant_actors";
pub const EVENTS_DROPPED: &str = "admitd_telemetry_events_dropped_total";
pub const SPANS_DROPPED: &str = "admitd_spans_dropped_total";
pub const SPANS_EXPORTED: &str = "admitd_spans_exported_total";
pub const REFUSAL_LOGS_SUPPRESSED: &str = "admitd_refusal_logs_suppressed_total";
pub const BUILD_INFO: &str = "admitd_build_info";
pub const EDGE_CHECKS: &str = "admitd_edge_checks_total";
pub const OVERLOAD: &str = "admitd_overload_total";
pub const STORE_MODE: &str = "admitd_store_mode";
pub const STORE_ERRORS: &str = "admitd_store_errors_total";
pub const STORE_REQUEST: &str = "admitd_store_request_seconds";
pub const STORE_FALLBACK: &str = "admitd_store_fallback_decisions_total";
pub const STORE_GLOBAL: &str = "admitd_store_global_decisions_total";
pub const TASKS_INFLIGHT: &str = "admitd_tasks_inflight";
pub const TASKS_STARTED: &str = "admitd_tasks_started_total";
pub const TASK_POLLS: &str = "admitd_task_polls_total";
pub const UNCHECKED_ADMISSIONS: &str = "admitd_unchecked_admissions_total";
pub const SPEND_TOTAL: &str = "admitd_spend_total";
pub const SPEND_DAILY_REMAINING: &str = "admitd_spend_daily_remaining";
pub const SPEND_DAILY_BUDGET: &str = "admitd_spend_daily_budget";

/// The type of a metric, as its `# TYPE` line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// A metric's `# HELP` text: one short sentence (docs/metrics.md says more), and its unit where the
/// name ends in one.
#[derive(Debug, Clone, Copy)]
pub struct MetricHelp {
    pub name: &'static str,
    pub kind: MetricKind,
    pub unit: Option<Unit>,
    pub help: &'static str,
}

const fn help(
    name: &'static str,
    kind: MetricKind,
    unit: Option<Unit>,
    help: &'static str,
) -> MetricHelp {
    MetricHelp {
        name,
        kind,
        unit,
        help,
    }
}

/// The help text of every metric above.
pub const METRIC_HELP: &[MetricHelp] = {
    use MetricKind::{Counter, Gauge, Histogram};
    const COUNT: Option<Unit> = Some(Unit::Count);
    const SECONDS: Option<Unit> = Some(Unit::Seconds);
    &[
        help(ADMISSIONS, Counter, COUNT, "Admission decisions, one per call to POST /v1/admit that gets a decision."),
        help(ADMISSION_WAIT, Histogram, SECONDS, "Time admitd held an admitted or shadow-shed call waiting for capacity."),
        help(RETRY_AFTER, Histogram, SECONDS, "Retry hints handed out on retryable sheds."),
        help(DECISION_DURATION, Histogram, SECONDS, "Time spent deciding one admission, excluding any wait."),
        help(TOOL_DURATION, Histogram, SECONDS, "Tool run time as reported on release."),
        help(UPSTREAM_RESPONSES, Counter, COUNT, "Upstream answers reported on release or through POST /v1/feedback."),
        help(LEASE_EXPIRIES, Counter, COUNT, "Leases never released and freed by lease_ttl."),
        help(INFLIGHT, Gauge, COUNT, "Calls admitted and not yet released or expired."),
        help(WAITING, Gauge, COUNT, "Calls queued for a concurrency slot."),
        help(BUCKET_UTILIZATION, Gauge, None, "Tokens used over burst, 0 to 1, of one bucket layer of the tenant."),
        help(GLOBAL_UTILIZATION, Gauge, None, "Tokens used over burst, 0 to 1, of the global bucket."),
        help(UPSTREAM_PENALTY, Gauge, SECONDS, "Seconds left in the penalty box after an upstream 429."),
        help(UPSTREAM_EFFECTIVE_RATE, Gauge, None, "Cost units per second the upstream budget allows now, after AIMD cuts."),
        help(UPSTREAM_THROTTLE, Gauge, None, "Share of calls to the upstream the adaptive throttle refuses now, 0 to 1."),
        help(DAILY_QUOTA_USED, Gauge, None, "Cost units the tenant spent today (UTC day)."),
        help(DAILY_QUOTA_LIMIT, Gauge, None, "The tenant's daily quota in cost units."),
        help(TENANT_SHED_RATIO, Gauge, None, "Shed calls over all calls of the tenant in the alert window, 0 when the window is empty."),
        help(ALERT_FIRING, Gauge, None, "1 while the in-daemon alert fires for the tenant, else 0."),
        help(TENANT_ACTORS, Gauge, COUNT, "Live per-tenant actors."),
        help(EVENTS_DROPPED, Counter, COUNT, "Telemetry events dropped because a telemetry mailbox was full."),
        help(SPANS_DROPPED, Counter, COUNT, "Admission spans not exported, by reason."),
        help(SPANS_EXPORTED, Counter, COUNT, "Admission spans the OTLP collector accepted."),
        help(REFUSAL_LOGS_SUPPRESSED, Counter, COUNT, "Refusals not written to the log because of refusal_log_per_sec."),
        help(BUILD_INFO, Gauge, None, "Always 1, labelled with the admitd version."),
        help(EDGE_CHECKS, Counter, COUNT, "Answers of GET /v1/edge/check, by result."),
        help(OVERLOAD, Counter, COUNT, "Admissions refused with a 503 before being decided, by reason."),
        help(STORE_MODE, Gauge, None, "1 for how admissions are decided now: memory, shared, or the on_error mode while the store is down."),
        help(STORE_ERRORS, Counter, COUNT, "Calls to the shared store that failed, by kind (timeout, connection, script)."),
        help(STORE_REQUEST, Histogram, SECONDS, "How long each operation on the shared store waited for its answer (batched operations share one)."),
        help(STORE_FALLBACK, Counter, COUNT, "Admissions decided without the shared store while it was unreachable, by on_error mode."),
        help(STORE_GLOBAL, Counter, COUNT, "Cluster decisions spending a global or shared upstream's bucket, from slices or on its shard."),
        help(TASKS_INFLIGHT, Gauge, COUNT, "MCP tasks admitted and not yet released or expired."),
        help(TASKS_STARTED, Counter, COUNT, "Admissions answered as MCP tasks."),
        help(TASK_POLLS, Counter, COUNT, "Polls of MCP tasks (POST /v1/tasks/poll), admitted on time or refused as early."),
        help(UNCHECKED_ADMISSIONS, Counter, COUNT, "Calls admitted unchecked by on_error = fail_open while the shared store was unreachable."),
        help(SPEND_TOTAL, Counter, None, "Spend settled at release or lease expiry, in the unit's own figures (dollars, tokens, ...)."),
        help(SPEND_DAILY_REMAINING, Gauge, None, "What the tenant's daily budget of the unit has left today (UTC); below zero when overspent."),
        help(SPEND_DAILY_BUDGET, Gauge, None, "The tenant's daily budget of the unit."),
    ]
};

/// The help text of a metric, by name.
pub fn help_of(name: &str) -> Option<&'static str> {
    METRIC_HELP.iter().find(|m| m.name == name).map(|m| m.help)
}

/// Gives the installed recorder every metric's help text and unit, for its `# HELP` lines. The
/// metrics admitd keeps itself ([`super::histogram`]) write theirs from [`METRIC_HELP`] directly.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    for m in METRIC_HELP {
        match (m.kind, m.unit) {
            (MetricKind::Counter, Some(unit)) => describe_counter!(m.name, unit, m.help),
            (MetricKind::Counter, None) => describe_counter!(m.name, m.help),
            (MetricKind::Gauge, Some(unit)) => describe_gauge!(m.name, unit, m.help),
            (MetricKind::Gauge, None) => describe_gauge!(m.name, m.help),
            (MetricKind::Histogram, Some(unit)) => describe_histogram!(m.name, unit, m.help),
            (MetricKind::Histogram, None) => describe_histogram!(m.name, m.help),
        }
    }
}

/// The label value for a subject past the per-tenant cardinality cap (and for any other capped label).
pub use crate::engine::labels::OTHER;
/// The label value for a call without an upstream.
pub const NO_UPSTREAM: &str = "none";
/// The tenant label of cross-tenant series (shared upstream penalties).
pub const SHARED_TENANT: &str = "__shared__";
/// The alert name of the shed-ratio alert.
pub const SHED_RATIO_ALERT: &str = "shed_ratio_high";

pub const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0,
];
pub const RETRY_AFTER_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0, 86_400.0,
];
pub const DECISION_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];
pub const STORE_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];
pub const TOOL_DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
