//! Every metric name, label and histogram bucket layout, in one place.
//!
//! Dashboards and alert rules (in `dashboards/` and `alerts/`) depend on these names; docs/metrics.md
//! documents them. Conventions: `admitd_` prefix, `_total` on counters, base units (`_seconds`).

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

/// The label value for a subject past the per-tenant cardinality cap (and for any other capped label).
pub const OTHER: &str = "__other__";
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
pub const TOOL_DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
