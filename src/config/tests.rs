//! Config parsing and validation tests: the example file, every key's checks and the `FILE:LINE` of
//! each refusal.

use std::path::Path;
use std::time::Duration;

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
            message: "alerts.shed_ratio must be between 0 and 1 (exclusive), not 1.5".to_string(),
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
    let e = err(
        "[telemetry.otlp]\nendpoint = \"http://127.0.0.1:4318/v1/traces\"\nsample_ratio = 1.5\n",
    );
    assert!(
        e.starts_with("cfg.toml:3: telemetry.otlp.sample_ratio must be between 0 and 1, not 1.5"),
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
fn load_reports_missing_file() {
    let e = Config::load(Path::new("/nonexistent/admitd.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("/nonexistent/admitd.toml: cannot read"),
        "{e}"
    );
}

#[test]
fn a_replicas_share_divides_every_limit_and_keeps_one_token_and_one_slot() {
    let c = Config::parse(
        "t.toml",
        "[limits.subject]\nrate = \"120/min\"\nburst = 20\nconcurrency = 8\ndaily_quota = 1000\n\
         [limits.tenant]\nburst = 1\nconcurrency = 1\n\
         [plans.free.subject]\nrate = \"30/min\"\nburst = 5\n\
         [tools.t]\nrate = \"3/s\"\nburst = 6\n[upstreams.u]\nrate = \"9/s\"\nburst = 9\n",
    )
    .unwrap();
    let d = c.divided(3);
    assert_eq!(d.limits.subject.bucket.rate.per_sec, 2.0 / 3.0);
    assert_eq!(d.limits.subject.bucket.burst, 20.0 / 3.0);
    assert_eq!(d.limits.subject.concurrency, Some(2));
    assert_eq!(d.limits.subject.daily_quota, Some(1000.0 / 3.0));
    // A burst of one and a single slot are kept: below them a replica could admit nothing.
    assert_eq!(d.limits.tenant.bucket.burst, 1.0);
    assert_eq!(d.limits.tenant.concurrency, Some(1));
    let free = &d.plans["free"].subject;
    assert_eq!(free.rate.unwrap().per_sec, 0.5 / 3.0);
    assert_eq!(free.burst, Some(5.0 / 3.0));
    assert_eq!(d.tools["t"].bucket.unwrap().rate.per_sec, 1.0);
    assert_eq!(d.upstreams["u"].bucket.unwrap().burst, 3.0);
    assert_eq!(c.divided(1), c);
}
