//! Config tests for the upstream-aware keys: budgets derived from `published_limit`, the AIMD and
//! adaptive-throttling knobs, tool amplification (`upstreams = { name = units }`) and plan weights.
//! Every rejected value must be reported as `FILE:LINE: message` at the offending line.

use std::time::Duration;

use super::*;

fn parse(text: &str) -> Config {
    Config::parse("t.toml", text).unwrap_or_else(|e| panic!("config does not parse: {e}"))
}

fn err(text: &str) -> String {
    match Config::parse("t.toml", text) {
        Ok(_) => panic!("config was accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

/// Asserts that `text` is refused at `line` with a message starting with `message`.
fn assert_err(text: &str, line: usize, message: &str) {
    let e = err(text);
    let want = format!("t.toml:{line}: {message}");
    assert!(
        e.starts_with(&want),
        "got {e:?}, want it to start with {want:?}"
    );
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

// ---- published-limit sizing -------------------------------------------------------------------------

#[test]
fn published_limit_minus_batch_times_headroom_one_is_twelve_per_second() {
    let c = parse(
        "[upstreams.crm]\npublished_limit = \"20/s\"\nreserved_for_batch = \"8/s\"\nheadroom = 1.0\n",
    );
    let u = &c.upstreams["crm"];
    assert_eq!(
        u.bucket,
        Some(BucketSpec::new(12.0, 12.0)),
        "burst: one second, rounded up"
    );
    assert_eq!(u.published_limit, Some(Rate::per_sec(20.0)));
    assert_eq!(u.reserved_for_batch, Some(Rate::per_sec(8.0)));
    assert_eq!(u.headroom, 1.0);
    assert!(!u.shared);
}

#[test]
fn the_default_headroom_is_seventy_percent() {
    let c = parse("[upstreams.crm]\npublished_limit = \"20/s\"\nreserved_for_batch = \"8/s\"\n");
    let u = &c.upstreams["crm"];
    assert_eq!(u.headroom, DEFAULT_HEADROOM);
    assert_eq!(DEFAULT_HEADROOM, 0.7);
    let b = u.bucket.unwrap();
    assert!(close(b.rate.per_sec, 8.4), "{}", b.rate.per_sec);
    assert_eq!(b.burst, 9.0, "ceil(8.4)");
    assert!(close(
        derive_rate(Rate::per_sec(20.0), Some(Rate::per_sec(8.0)), 0.7),
        8.4
    ));
}

#[test]
fn published_limit_variants() {
    // no batch traffic: 70% of the published limit; units convert (1200/min = 20/s)
    let c = parse("[upstreams.a]\npublished_limit = \"1200/min\"\n");
    let b = c.upstreams["a"].bucket.unwrap();
    assert!(close(b.rate.per_sec, 14.0));
    assert_eq!(b.burst, 14.0);
    // an explicit burst wins; shared and the AIMD keys combine with a derived budget
    let c = parse(
        "[upstreams.a]\npublished_limit = \"20/s\"\nreserved_for_batch = \"8/s\"\nheadroom = 0.5\nburst = 3\nshared = true\naimd_factor = 0.8\n",
    );
    let u = &c.upstreams["a"];
    assert_eq!(u.bucket, Some(BucketSpec::new(6.0, 3.0)));
    assert!(u.shared);
    assert_eq!(u.aimd.factor, 0.8);
    // a small remainder still rounds the burst up to at least 1
    let c = parse(
        "[upstreams.a]\npublished_limit = \"10/s\"\nreserved_for_batch = \"9.5/s\"\nheadroom = 0.5\n",
    );
    let b = c.upstreams["a"].bucket.unwrap();
    assert!(close(b.rate.per_sec, 0.25));
    assert_eq!(b.burst, 1.0);
}

#[test]
fn published_limit_errors_name_file_and_line() {
    // rate and published_limit together: reported at `rate`, wherever it is
    assert_err(
        "[upstreams.crm]\npublished_limit = \"20/s\"\nrate = \"10/s\"\n",
        3,
        "upstreams.crm: set either rate or published_limit, not both",
    );
    assert_err(
        "\n[upstreams.crm]\nrate = \"10/s\"\npublished_limit = \"20/s\"\n",
        3,
        "upstreams.crm: set either rate or published_limit, not both",
    );
    // headroom or reserved_for_batch without a published limit
    assert_err(
        "[upstreams.crm]\nrate = \"10/s\"\nheadroom = 0.5\n",
        3,
        "upstreams.crm.headroom needs upstreams.crm.published_limit",
    );
    assert_err(
        "[upstreams.crm]\nreserved_for_batch = \"8/s\"\n",
        2,
        "upstreams.crm.reserved_for_batch needs upstreams.crm.published_limit",
    );
    // batch traffic that leaves nothing (equal or more)
    for reserved in ["20/s", "25/s", "1200/min"] {
        assert_err(
            &format!(
                "[upstreams.crm]\npublished_limit = \"20/s\"\n\nreserved_for_batch = \"{reserved}\"\n"
            ),
            4,
            "upstreams.crm.reserved_for_batch leaves nothing of published_limit for agents",
        );
    }
    // headroom must be in (0, 1]
    for h in ["0", "0.0", "1.5", "-0.5", "nan"] {
        assert_err(
            &format!("[upstreams.crm]\npublished_limit = \"20/s\"\nheadroom = {h}\n"),
            3,
            "upstreams.crm.headroom must be greater than 0 and at most 1",
        );
    }
    // an invalid published limit is a rate error, never ignored
    assert_err(
        "[upstreams.crm]\npublished_limit = \"20/sec\"\n",
        2,
        "upstreams.crm.published_limit: invalid rate \"20/sec\"",
    );
    assert_err(
        "[upstreams.crm]\npublished_limit = \"20/s\"\nreserved_for_batch = \"x\"\n",
        3,
        "upstreams.crm.reserved_for_batch: invalid rate",
    );
}

// ---- AIMD and adaptive keys -------------------------------------------------------------------------

#[test]
fn aimd_and_adaptive_defaults() {
    let c = parse("[upstreams.u]\nrate = \"10/s\"\n");
    let u = &c.upstreams["u"];
    assert_eq!(
        u.aimd,
        Aimd {
            factor: 0.5,
            floor: 0.1,
            recover: 0.05
        }
    );
    assert_eq!(
        u.adaptive,
        Some(Adaptive {
            k: 2.0,
            window: Duration::from_secs(120),
            min_requests: 20
        })
    );
    assert_eq!(u.bucket, Some(BucketSpec::new(10.0, 10.0)));
    assert_eq!(u.published_limit, None);
}

#[test]
fn aimd_and_adaptive_keys_parse() {
    let c = parse(
        "[upstreams.u]\nrate = \"10/s\"\nburst = 10\naimd_factor = 0.7\naimd_floor = 0.25\naimd_recover = 0.02\nadaptive_k = 1.5\nadaptive_window = \"30s\"\nadaptive_min_requests = 0\n",
    );
    let u = &c.upstreams["u"];
    assert_eq!(
        u.aimd,
        Aimd {
            factor: 0.7,
            floor: 0.25,
            recover: 0.02
        }
    );
    assert_eq!(
        u.adaptive,
        Some(Adaptive {
            k: 1.5,
            window: Duration::from_secs(30),
            min_requests: 0
        })
    );
    // the edges of the ranges are accepted: factor 1 (no cut), k from 1 to 100
    let c = parse(
        "[upstreams.a]\naimd_factor = 1\naimd_floor = 1.0\naimd_recover = 1\nadaptive_k = 1\n[upstreams.b]\nadaptive_k = 100\nadaptive_window = \"1h\"\n",
    );
    assert_eq!(c.upstreams["a"].aimd.factor, 1.0);
    assert_eq!(c.upstreams["a"].adaptive.unwrap().k, 1.0);
    assert_eq!(c.upstreams["b"].adaptive.unwrap().k, 100.0);
    assert_eq!(
        c.upstreams["b"].adaptive.unwrap().window,
        Duration::from_secs(3600)
    );
    assert_eq!(
        c.upstreams["a"].bucket, None,
        "an upstream may be adaptive only"
    );
}

#[test]
fn adaptive_k_zero_turns_the_throttle_off() {
    let c = parse("[upstreams.u]\nrate = \"10/s\"\nadaptive_k = 0\nadaptive_window = \"10s\"\n");
    assert_eq!(c.upstreams["u"].adaptive, None);
}

#[test]
fn bad_aimd_and_adaptive_values_name_file_and_line() {
    for (key, value) in [
        ("aimd_factor", "0"),
        ("aimd_factor", "1.5"),
        ("aimd_factor", "-0.5"),
        ("aimd_floor", "0"),
        ("aimd_floor", "2"),
        ("aimd_recover", "0"),
        ("aimd_recover", "-0.1"),
        ("aimd_recover", "1.01"),
    ] {
        assert_err(
            &format!("[upstreams.u]\nrate = \"10/s\"\n\n{key} = {value}\n"),
            4,
            &format!("upstreams.u.{key} must be greater than 0 and at most 1"),
        );
    }
    for k in ["0.5", "0.99", "-1", "101", "inf"] {
        assert_err(
            &format!("[upstreams.u]\nadaptive_k = {k}\n"),
            2,
            "upstreams.u.adaptive_k must be 0 (off) or from 1 to 100",
        );
    }
    assert_err(
        "[upstreams.u]\nadaptive_window = \"500ms\"\n",
        2,
        "upstreams.u.adaptive_window must be at least 1s",
    );
    assert_err(
        "[upstreams.u]\nadaptive_window = \"2h\"\n",
        2,
        "upstreams.u.adaptive_window: \"2h\" is longer than the maximum",
    );
    assert_err(
        "[upstreams.u]\nadaptive_window = \"2 minutes\"\n",
        2,
        "upstreams.u.adaptive_window: invalid duration",
    );
    assert_err(
        "[upstreams.u]\nadaptive_min_requests = -1\n",
        2,
        "upstreams.u.adaptive_min_requests must be a whole number from 0 to 1000000",
    );
    // a misspelt key is an error, never ignored
    assert_err(
        "[upstreams.u]\naimd_factr = 0.5\n",
        2,
        "unknown field `aimd_factr`",
    );
}

// ---- tool amplification -----------------------------------------------------------------------------

#[test]
fn tool_upstreams_parse_with_their_units() {
    let c = parse(
        "[tools.sync_customers]\nupstreams = { erp = 1, crm = 200 }\ncost = 2\n[tools.get_sales]\nupstream = \"warehouse\"\n[tools.plain]\ncost = 3\n",
    );
    let t = &c.tools["sync_customers"];
    assert_eq!(
        t.upstreams,
        vec![("crm".to_string(), 200.0), ("erp".to_string(), 1.0)],
        "in name order"
    );
    assert_eq!(t.upstream, None);
    assert_eq!(t.cost, Some(2.0));
    // a single upstream is the same as `{ name = 1 }`
    let t = &c.tools["get_sales"];
    assert_eq!(t.upstream.as_deref(), Some("warehouse"));
    assert_eq!(t.upstreams, vec![("warehouse".to_string(), 1.0)]);
    assert!(c.tools["plain"].upstreams.is_empty());
    // fractional units are allowed (a call that spends half a unit of an upstream)
    let c = parse("[tools.t]\nupstreams = { cache = 0.5 }\n");
    assert_eq!(c.tools["t"].upstreams, vec![("cache".to_string(), 0.5)]);
    // a table form works too
    let c = parse("[tools.t.upstreams]\ncrm = 200\nerp = 1\n");
    assert_eq!(c.tools["t"].upstreams.len(), 2);
}

#[test]
fn tool_upstream_errors_name_file_and_line() {
    assert_err(
        "[tools.t]\nupstreams = { crm = 200 }\nupstream = \"crm\"\n",
        3,
        "tools.t: set either upstream or upstreams, not both",
    );
    assert_err(
        "[tools.t]\nupstream = \"crm\"\nupstreams = { crm = 200 }\n",
        2,
        "tools.t: set either upstream or upstreams, not both",
    );
    assert_err(
        "[tools.t]\ncost = 1\nupstreams = {}\n",
        3,
        "tools.t.upstreams is empty; list at least one upstream",
    );
    for units in ["0", "-5", "nan"] {
        assert_err(
            &format!("[tools.t]\nupstreams = {{ erp = 1, crm = {units} }}\n"),
            2,
            "tools.t.upstreams.crm must be a number greater than 0",
        );
    }
    assert_err("[tools.t]\nupstreams = { crm = \"lots\" }\n", 2, "");
}

// ---- plan weights -----------------------------------------------------------------------------------

#[test]
fn plan_weights_parse_and_default_to_one() {
    let c = parse(
        "[plans.gold]\nweight = 2\n[plans.free.subject]\nburst = 5\n[tenants.big]\nplan = \"gold\"\n[tenants.small]\nplan = \"free\"\n",
    );
    assert_eq!(c.plans["gold"].weight, 2.0);
    assert_eq!(c.plans["free"].weight, 1.0);
    assert_eq!(c.tenant_weight("big"), 2.0);
    assert_eq!(c.tenant_weight("small"), 1.0);
    assert_eq!(c.tenant_weight("unknown"), 1.0, "no plan: weight 1");
}

#[test]
fn plan_weight_errors_name_file_and_line() {
    for w in ["0", "-1", "0.0001"] {
        assert_err(
            &format!("[plans.gold]\n\nweight = {w}\n"),
            3,
            "plans.gold.weight must be a number from 0.001",
        );
    }
}

#[test]
fn probe_keys_parse_and_default() {
    let c = parse("[upstreams.api]\nrate = \"60/s\"\nshared = true\n");
    assert_eq!(c.upstreams["api"].probe, Probing::default());
    assert_eq!(
        Probing::default(),
        Probing {
            every: Duration::from_secs(10),
            step: 0.05,
            hold: 0.9
        }
    );
    let c = parse(
        "[upstreams.api]\nrate = \"60/s\"\nshared = true\nprobe_every = \"30s\"\n\
         probe_step = 0.1\nprobe_hold = 0.8\n",
    );
    let p = c.upstreams["api"].probe;
    assert_eq!(p.every, Duration::from_secs(30));
    assert!(close(p.step, 0.1) && close(p.hold, 0.8), "{p:?}");
}

#[test]
fn bad_probe_values_name_file_and_line() {
    let head = "[upstreams.api]\nrate = \"60/s\"\nshared = true\n";
    assert_err(
        &format!("{head}probe_every = \"500ms\"\n"),
        4,
        "upstreams.api.probe_every must be at least 1s",
    );
    assert_err(
        &format!("{head}probe_every = \"1h\"\n"),
        4,
        "upstreams.api.probe_every: ",
    );
    assert_err(
        &format!("{head}probe_every = \"soon\"\n"),
        4,
        "upstreams.api.probe_every: ",
    );
    assert_err(
        &format!("{head}probe_step = 0\n"),
        4,
        "upstreams.api.probe_step must be greater than 0 and at most 1, not 0",
    );
    assert_err(
        &format!("{head}\nprobe_hold = 1.5\n"),
        5,
        "upstreams.api.probe_hold must be greater than 0 and at most 1, not 1.5",
    );
    assert!(err(&format!("{head}probe_often = 3\n")).starts_with("t.toml:4:"));
}
