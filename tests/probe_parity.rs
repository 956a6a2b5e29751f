//! The probe schedule's formulas that exist both in the engine (`engine::probe`) and in the shared
//! store's script (`src/store/admitd.lua`) give the same answers for the same inputs: the
//! multiplier in force around a probe window, the count of a healthy answer towards a running probe
//! (past its ramp), and the step back towards the hold.
//!
//! Each case writes a state into a real Redis, runs the script on it, and applies the engine's
//! functions to the same state at the instant the script ran (it answers its own clock).

mod common;

use std::time::Duration;

use admitd::config::{Aimd, Probing};
use admitd::engine::probe::{StoredProbe, PROBE_LEN, RAMP};
use common::redis::RedisServer;
use serde_json::{json, Value};

const KEY: &str = "admitd:{x}:up:api";
const US: f64 = 1e6;

/// The script as the store loads it (the engine's constants written in).
fn script() -> &'static str {
    common::script::text()
}

fn aimd() -> Aimd {
    Aimd {
        factor: 0.5,
        floor: 0.1,
        recover: 0.05,
    }
}

fn probing() -> Probing {
    Probing {
        every: Duration::from_secs(10),
        step: 0.05,
        hold: 0.9,
    }
}

/// The store's clock, in microseconds.
fn store_now(r: &RedisServer) -> f64 {
    let t = r.cli(&["TIME"]);
    let mut parts = t.lines().map(|x| x.trim().parse::<f64>().unwrap());
    parts.next().unwrap() * US + parts.next().unwrap()
}

/// Writes `fields` as the upstream's state (replacing what was there).
fn set_state(r: &RedisServer, fields: &[(&str, f64)]) {
    r.cli(&["DEL", KEY]);
    let mut args = vec!["HSET".to_string(), KEY.to_string()];
    for (k, v) in fields {
        args.push((*k).to_string());
        args.push(format!("{v}"));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    r.cli(&args);
}

/// One healthy answer worth `q`, through the script: the state it returns (with `now`).
fn healthy_answer(r: &RedisServer, q: f64) -> Value {
    let p = probing();
    let spec = json!({
        "u": {"n": "api", "p": "admitd:{x}:pen:api", "s": KEY, "aw": 0, "forget": 120e6,
              "x": false, "af": 0.5, "afl": 0.1, "ar": 0.05, "q": q,
              "pr": {"h": p.hold, "e": p.every.as_micros() as f64, "sp": p.step,
                     "pl": (PROBE_LEN / 1000) as f64, "rp": (RAMP / 1000) as f64, "tau": 1e6}},
        "limited": false, "retry_after": -1, "default_penalty": 1e6,
    });
    let out = r.cli(&[
        "EVAL",
        script(),
        "1",
        KEY,
        "upstream",
        &spec.to_string(),
        "",
    ]);
    let json = out.lines().nth(2).unwrap_or_else(|| panic!("{out}"));
    serde_json::from_str::<Value>(json).unwrap()["st"].clone()
}

/// The multiplier the script reads for the state, through its snapshot operation.
fn script_multiplier(r: &RedisServer) -> f64 {
    let spec = json!({"h": "admitd:{t:a}:h", "z": "admitd:{t:a}:ls",
        "tenant_quota": "admitd:{t:a}:q:t", "subject_quota": "admitd:{t:a}:q:s:",
        "index": "", "max_subjects": 100, "pens": [], "ups": [KEY], "forget": 120e6,
        "pl": (PROBE_LEN / 1000) as f64});
    let out = r.cli(&[
        "EVAL",
        script(),
        "1",
        "admitd:{t:a}:h",
        "snapshot",
        &spec.to_string(),
        "",
    ]);
    serde_json::from_str::<Value>(out.trim()).unwrap()["ups"][0]
        .as_f64()
        .unwrap()
}

fn engine_state(fields: &[(&str, f64)]) -> StoredProbe {
    StoredProbe::from_fields(|k| fields.iter().find(|f| f.0 == k).map(|f| f.1))
}

fn ns(us: f64) -> u64 {
    (us as u64) * 1000
}

#[test]
fn the_script_and_the_engine_count_and_recover_alike() {
    let r = RedisServer::start();
    let (a, p) = (aimd(), probing());
    let q = 1.0 / 60.0;
    // (probe start relative to the store's clock in seconds, m, ceiling, probe units so far)
    let cases = [
        (-1.5, 0.3, 1.0 / 3.0, 0.2),  // inside the probe, past its ramp: counted
        (-0.2, 0.3, 1.0 / 3.0, 0.0),  // inside its ramp: not counted
        (-10.0, 0.3, 1.0 / 3.0, 0.5), // ended: not counted
        (20.0, 0.2, 1.0 / 3.0, 0.0),  // planned: below the hold, a step back
        (20.0, 0.29, 1.0 / 3.0, 0.0), // a step back stops at the hold
        (20.0, 0.96, 1.0, 0.0),       // never past the configured rate
    ];
    for (at, m, c, pu) in cases {
        let t = store_now(&r);
        let fields = [
            ("m", m),
            ("c", c),
            ("pa", (t + at * US).round()),
            ("pt", c * 1.05),
            ("pu", pu),
            ("iv", 10.0 * US),
            ("sp", 0.05),
        ];
        set_state(&r, &fields);
        let out = healthy_answer(&r, q);
        let now = ns(out["now"].as_f64().unwrap());
        let mut engine = engine_state(&fields);
        engine.probe.count(now, q);
        engine.probe.recover(&a, &p);
        let case = format!("probe at {at} s, m {m}, ceiling {c}: script {out}");
        assert!(
            (out["m"].as_f64().unwrap() - engine.probe.m).abs() < 1e-12,
            "{case}"
        );
        assert!(
            (out["pu"].as_f64().unwrap() - engine.probe.units).abs() < 1e-12,
            "{case}"
        );
    }
}

#[test]
fn the_script_and_the_engine_read_the_same_multiplier_around_a_probe() {
    let r = RedisServer::start();
    // (probe start relative to the store's clock in seconds): before, inside, after the window.
    for at in [30.0, -1.0, -10.0] {
        let t = store_now(&r);
        let fields = [
            ("m", 0.3),
            ("c", 1.0 / 3.0),
            ("pa", (t + at * US).round()),
            ("pt", 0.35),
        ];
        set_state(&r, &fields);
        let script = script_multiplier(&r);
        let engine = engine_state(&fields).probe.multiplier(ns(store_now(&r)));
        assert!(
            (script - engine).abs() < 1e-12,
            "probe at {at} s: script {script}, engine {engine}"
        );
    }
    // A state without a schedule follows plain AIMD: its cut is forgotten after `forget`.
    set_state(&r, &[("m", 0.5), ("cut", store_now(&r) - 200.0 * US)]);
    assert_eq!(script_multiplier(&r), 1.0);
}
