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

/// A shared upstream's report as the script reads it, on the state key `s`: with AIMD, a probe
/// (`probed`) and an adaptive window of `aw` microseconds (0: none) as asked.
fn report(s: &str, aimd: bool, probed: bool, aw: f64) -> Value {
    let p = probing();
    let mut u = json!({"n": "api", "p": format!("{s}:pen"), "s": s, "aw": aw, "forget": 120e6,
                       "x": true});
    if aimd {
        u["af"] = json!(0.5);
        u["afl"] = json!(0.1);
        u["ar"] = json!(0.05);
    }
    if probed {
        u["q"] = json!(1.0 / 60.0);
        u["pr"] = json!({"h": p.hold, "e": p.every.as_micros() as f64, "sp": p.step,
                         "pl": (PROBE_LEN / 1000) as f64, "rp": (RAMP / 1000) as f64, "tau": 1e6});
    }
    u
}

/// Writes `fields` into each of `keys` (replacing what was there).
fn set_states(r: &RedisServer, keys: &[&str], fields: &[(&str, String)]) {
    for key in keys {
        r.cli(&["DEL", key]);
        let mut args = vec!["HSET".to_string(), key.to_string()];
        for (k, v) in fields {
            args.push((*k).to_string());
            args.push(v.clone());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        r.cli(&args);
    }
}

/// Every field of the hash `key`, sorted.
fn fields_of(r: &RedisServer, key: &str) -> Vec<(String, String)> {
    let out = r.cli(&["HGETALL", key]);
    let lines: Vec<String> = out.lines().map(|l| l.trim().to_string()).collect();
    let mut f: Vec<(String, String)> = lines
        .chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].clone(), c[1].clone()))
        .collect();
    f.sort();
    f
}

/// `state` as [`fields_of`] lists a hash.
fn fields_of_state(state: &[(&str, String)]) -> Vec<(String, String)> {
    let mut f: Vec<(String, String)> = state
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    f.sort();
    f
}

/// Runs `ops` (operation, spec) in one script call: one instant of the store's clock for all.
fn batch(r: &RedisServer, ops: &[(&str, Value)]) -> String {
    let specs: Vec<String> = ops.iter().map(|(_, s)| s.to_string()).collect();
    let mut args = vec!["EVAL", script(), "1", "admitd:{u:a}:up", "batch"];
    for ((op, _), spec) in ops.iter().zip(&specs) {
        args.push(op);
        args.push(spec);
        args.push("");
    }
    r.cli(&args)
}

/// What a shared upstream has: AIMD, probing, an adaptive window (microseconds, 0: none).
type Has = (bool, bool, f64);

#[test]
fn gathered_answers_change_the_state_as_the_same_answers_one_by_one() {
    let r = RedisServer::start();
    let (one, all) = ("admitd:{u:a}:up", "admitd:{u:b}:up");
    let healthy = |u: &Value| {
        json!({"u": u, "limited": false, "ok": true, "healthy": true,
               "retry_after": -1, "default_penalty": 1e6})
    };
    let t = store_now(&r);
    let at = |s: f64| format!("{}", (t + s * US).round());
    // (what the upstream has, its state before)
    let cases: Vec<(Has, Vec<(&str, String)>)> = vec![
        // AIMD alone, after a cut: 7 recoveries of 0.05 from 0.5.
        (
            (true, false, 0.0),
            vec![("m", "0.5".into()), ("cut", at(-1.0))],
        ),
        // Near the top: the snap to 1 and no further.
        (
            (true, false, 0.0),
            vec![("m", "0.93".into()), ("cut", at(-1.0))],
        ),
        // A cut older than `forget`: back at 1, nothing to recover.
        (
            (true, false, 0.0),
            vec![("m", "0.3".into()), ("cut", at(-200.0))],
        ),
        // An adaptive window (with AIMD): every answer a request and an accept of this slot.
        (
            (true, false, 30e6),
            vec![("m", "0.6".into()), ("cut", at(-1.0))],
        ),
        // Probed, inside a probe past its ramp: counted towards it, the meter decays then adds.
        (
            (true, true, 0.0),
            vec![
                ("m", "0.3".into()),
                ("c", format!("{}", 1.0 / 3.0)),
                ("pa", at(-1.5)),
                ("pt", "0.35".into()),
                ("pu", "0.2".into()),
                ("sv", "0.4".into()),
                ("st", at(-0.3)),
                ("s0", at(-4.0)),
            ],
        ),
        // Probed, below the hold with a quiet meter (restarted) and the probe planned later.
        (
            (true, true, 30e6),
            vec![
                ("m", "0.2".into()),
                ("c", format!("{}", 1.0 / 3.0)),
                ("pa", at(20.0)),
                ("pt", "0.35".into()),
                ("sv", "0.4".into()),
                ("st", at(-30.0)),
                ("s0", at(-40.0)),
            ],
        ),
    ];
    for ((aimd, probed, aw), state) in cases {
        // A cut older than `forget` is read as no cut: nothing to recover.
        let moves = state.iter().all(|(k, v)| *k != "cut" || *v != at(-200.0));
        set_states(&r, &[one, all], &state);
        let (u1, u2) = (report(one, aimd, probed, aw), report(all, aimd, probed, aw));
        // Seven answers one by one on `one`, and the same seven gathered on `all`, at one instant.
        let mut ops: Vec<(&str, Value)> = (0..7).map(|_| ("upstream", healthy(&u1))).collect();
        ops.push(("answers", json!({"u": u2, "a": [[0, 7, 0]]})));
        let out = batch(&r, &ops);
        let case = format!("aimd {aimd}, probed {probed}, window {aw}, state {state:?}: {out}");
        // Every field the same, to the last digit.
        let (a, b) = (fields_of(&r, one), fields_of(&r, all));
        assert_eq!(a, b, "{case}");
        if moves {
            assert_ne!(a, fields_of_state(&state), "nothing moved: {case}");
        }
    }
}

#[test]
fn gathered_answers_count_at_their_own_instants() {
    let r = RedisServer::start();
    let key = "admitd:{u:a}:up";
    let u = report(key, true, true, 30e6);
    let q = 1.0 / 60.0;
    let t = store_now(&r);
    let at = |s: f64| (t + s * US).round();
    // The meter's last answer (another replica's) 10 ms ago; this replica gathered two answers
    // 400 ms ago (before it), one healthy and one accepted, unhealthy answer 5 ms ago, and three
    // healthy ones now. The probe started 1.2 s ago: the answers of 400 ms ago fall in its ramp (not
    // counted), the others past it.
    let (sv, st) = (0.4, at(-0.010));
    set_states(
        &r,
        &[key],
        &[
            ("m", "0.1".into()),
            ("c", format!("{}", 1.0 / 3.0)),
            ("pa", format!("{}", at(-1.2))),
            ("pt", "0.35".into()),
            ("pu", "0".into()),
            ("sv", format!("{sv}")),
            ("st", format!("{st}")),
            ("s0", format!("{}", at(-4.0))),
        ],
    );
    let out = batch(
        &r,
        &[(
            "answers",
            json!({"u": u, "a": [[400_000, 2, 0], [5_000, 1, 1], [0, 3, 0]]}),
        )],
    );
    // The hash's own fields (the answer's JSON rounds numbers to 14 digits). The last answers are
    // of now: the meter's last instant is the script's clock.
    let field = |f: &str| -> f64 {
        let v = r.cli(&["HGET", key, f]);
        v.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{f} = {v:?}: {e}: {out}"))
    };
    let now = field("st");
    // The meter as a sum of decaying terms, at `now`: each term decays from its own instant.
    let expected: f64 = sv * (-(now - st) / US).exp()
        + 2.0 * q * (-0.400_f64).exp()
        + q * (-0.005_f64).exp()
        + 3.0 * q;
    let got = field("sv");
    assert!(
        (got - expected).abs() < 1e-12,
        "meter {got}, expected {expected}: {out}"
    );
    // Past the ramp (1 s after the probe's start): the answers of 5 ms ago and now, not those of
    // 400 ms ago.
    let pa = at(-1.2);
    let ramp = (RAMP / 1000) as f64;
    let counted: f64 = [(400_000.0, 2.0), (5_000.0, 1.0), (0.0, 3.0)]
        .iter()
        .filter(|(age, _)| now - age >= pa + ramp)
        .map(|(_, n)| n * q)
        .sum();
    assert!((field("pu") - counted).abs() < 1e-12, "{out}");
    assert!(counted > 0.0 && counted < 6.0 * q, "{out}");
    // Six healthy answers: six recoveries of 0.05 from 0.1, each up to the hold (0.9 of the
    // ceiling), as one answer each.
    let (a, p) = (aimd(), probing());
    let mut engine = engine_state(&[("m", 0.1), ("c", 1.0 / 3.0), ("pa", pa)]);
    for _ in 0..6 {
        engine.probe.recover(&a, &p);
    }
    assert_eq!(field("m"), engine.probe.m, "{out}");
    assert!(engine.probe.m > 0.25, "{}", engine.probe.m);
    // The window: each answer (the accepted, unhealthy one too) in the slot of its instant.
    let len = (30e6 / 24.0_f64).floor();
    let mut slots = std::collections::BTreeMap::<u64, u64>::new();
    for (age, n) in [(400_000.0, 2), (5_000.0, 2), (0.0, 3)] {
        *slots.entry(((now - age) / len).floor() as u64).or_default() += n;
    }
    for (slot, n) in slots {
        let r_ = r.cli(&["HGET", key, &format!("r:{slot}")]);
        let a_ = r.cli(&["HGET", key, &format!("a:{slot}")]);
        assert_eq!(r_.trim(), n.to_string(), "slot {slot}: {out}");
        assert_eq!(a_.trim(), n.to_string(), "slot {slot}: {out}");
    }
}
