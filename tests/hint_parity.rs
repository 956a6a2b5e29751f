//! Retry hints of limits with no refill of their own are written twice: in the engine
//! (`engine::bucket::stagger` and `stagger_window`, `engine::slots::margin`) and in the shared-store
//! script (`stagger`, `stagger_cached`, `stagger_window`, `slot_margin` in `src/store/admitd.lua`).
//! These tests feed both the same inputs and hold them to the same answers: the staggered slot each
//! refused caller is told (penalty and throttle hints on a key of their own, concurrency hints on a
//! field of the tenant's hash), the window an upstream's hints are spread over, and the margin a
//! concurrency slot hint leaves after the slot's expected end.
//!
//! The script's functions are run as the store loads them (the engine's constants written in), on
//! a clock the test sets, by a real Redis; the script as written, placeholders left in, does not
//! compile there.

mod common;

use admitd::engine::bucket::{stagger, stagger_window};
use admitd::engine::slots::margin;
use common::redis::RedisServer;
use common::script::{eval_at_zero, through};

const US: u64 = 1_000;
const MS: u64 = 1_000 * US;
const SEC: u64 = 1_000 * MS;

/// A small deterministic generator (the same cases every run).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// One refused caller: (base, step, window), in nanoseconds, all whole microseconds.
type Call = (u64, u64, u64);

/// Refused callers as an upstream sees them: hints toward instants that move on, steps of 1 ms to
/// half a second, windows from the waits (some past the horizon), some calls in the same instant.
fn calls(seed: u64, n: usize) -> Vec<Call> {
    let mut g = Lcg(seed);
    let mut base = 1_700_000_000 * SEC;
    // First, callers refused toward one instant, a quarter of the window apart: the fifth is told
    // the window's very end, the sixth starts over.
    let first = vec![(base, 250 * MS, stagger_window(0)); 6];
    first
        .into_iter()
        .chain((0..n).map(|_| {
            if g.below(4) == 0 {
                base += g.below(3_000) * MS;
            }
            let step = (1 + g.below(500)) * MS;
            // Short waits (a one-second window) often, longer ones (some past the horizon) too.
            let wait = if g.below(2) == 0 {
                g.below(1_500) * MS
            } else {
                g.below(90_000) * MS
            };
            (base, step, stagger_window(wait))
        }))
        .collect()
}

/// The slots the script's `stagger` (on the key `c` of a key of its own) and `stagger_cached` (on a
/// field of a hash of the tenant's layout) hand out to `calls`, in microseconds; the calls run in
/// two script calls, so the cursors are read back from Redis between them.
fn lua_slots(r: &RedisServer, calls: &[Call]) -> (Vec<u64>, Vec<u64>) {
    let src = through(
        "stagger_window",
        "local out = {}\n\
         for i = 2, #ARGV, 3 do\n\
           local base, step, window = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])\n\
           now = base\n\
           local a = stagger('pen', 'c', base, step, window)\n\
           local b = stagger_cached('h', 'cs:bot', base, step, window)\n\
           out[#out + 1] = fmt(a)\n\
           out[#out + 1] = fmt(b)\n\
         end\n\
         flush()\n\
         return out",
    );
    let (mut own, mut cached) = (Vec::new(), Vec::new());
    for half in calls.chunks(calls.len().div_ceil(2)) {
        let mut args: Vec<String> = vec![(half[0].0 / US).to_string()];
        for (base, step, window) in half {
            args.extend([base / US, step / US, window / US].map(|x| x.to_string()));
        }
        let mut cmd = vec!["EVAL", &src, "2", "pen", "h"];
        cmd.extend(args.iter().map(String::as_str));
        let out = r.cli(&cmd);
        let got: Vec<u64> = out
            .lines()
            .map(|l| l.parse().unwrap_or_else(|_| panic!("{out}")))
            .collect();
        assert_eq!(got.len(), 2 * half.len(), "{out}");
        for pair in got.chunks(2) {
            own.push(pair[0]);
            cached.push(pair[1]);
        }
    }
    (own, cached)
}

#[test]
fn staggered_hints_are_the_same_slots_in_both() {
    let r = RedisServer::start();
    for seed in [1, 2, 3] {
        let calls = calls(seed, 300);
        let (own, cached) = lua_slots(&r, &calls);
        r.cli(&["FLUSHALL"]);
        let mut last = 0;
        for (i, &(base, step, window)) in calls.iter().enumerate() {
            let engine = stagger(&mut last, base, step, window) / US;
            assert_eq!(
                (own[i], cached[i]),
                (engine, engine),
                "caller {i} of seed {seed}: base +{} ms, step {} ms, window {} ms",
                (base - calls[0].0) / MS,
                step / MS,
                window / MS
            );
        }
        // The cases reach every branch: a slot after the last, a slot at the base, a start over.
        let starts_over = calls
            .iter()
            .zip(&own)
            .skip(1)
            .zip(&own)
            .any(|((&(base, step, _), &slot), &prev)| slot == base / US && prev + step / US > slot);
        assert!(starts_over, "seed {seed} never starts over");
    }
}

#[test]
fn an_upstreams_hints_are_spread_over_the_same_window() {
    let r = RedisServer::start();
    let src = through(
        "stagger_window",
        "local out = {}\n\
         for i = 2, #ARGV do out[#out + 1] = fmt(stagger_window(tonumber(ARGV[i]))) end\n\
         return out",
    );
    let waits = [
        0,
        1,
        500 * MS,
        SEC - US,
        SEC,
        SEC + US,
        30 * SEC,
        60 * SEC - US,
        60 * SEC,
        60 * SEC + US,
        3_600 * SEC,
    ];
    let args: Vec<String> = waits.iter().map(|w| (w / US).to_string()).collect();
    let lua: Vec<u64> = eval_at_zero(&r, &src, &args)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let engine: Vec<u64> = waits.iter().map(|&w| stagger_window(w) / US).collect();
    assert_eq!(lua, engine, "waits {waits:?}");
}

#[test]
fn a_concurrency_hint_leaves_the_same_margin_after_the_slot() {
    let r = RedisServer::start();
    let src = through(
        "slot_margin",
        "local out = {}\n\
         for i = 2, #ARGV do out[#out + 1] = string.format('%.17g', slot_margin(tonumber(ARGV[i]))) end\n\
         return out",
    );
    // Runs in microseconds, as the store keeps them (a moving average: not always whole): below
    // the least margin, inside, at both ends, above the most.
    let runs: [f64; 12] = [
        0.0,
        1.0,
        100_000.0,
        399_999.0,
        400_000.0,
        400_001.0,
        1_000_000.0,
        1_234_567.8,
        4_999_999.0,
        5_000_000.0,
        5_000_001.0,
        3_600e6,
    ];
    let args: Vec<String> = runs.iter().map(|r| format!("{r}")).collect();
    let lua: Vec<f64> = eval_at_zero(&r, &src, &args)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    for (run, lua) in runs.iter().zip(lua) {
        let engine = margin((run * 1e3).round() as u64) as f64 / 1e3;
        // The engine counts whole nanoseconds, the script microseconds as a double.
        assert!(
            (engine - lua).abs() <= 1e-3,
            "run {run} us: engine {engine} us, script {lua} us"
        );
    }
}

/// The store loads only the rendered text: the script as written, its placeholders left in, is
/// not Lua, so no path could run it with a constant missing.
#[test]
fn the_script_with_its_placeholders_left_in_does_not_compile() {
    let r = RedisServer::start();
    let written = include_str!("../src/store/admitd.lua");
    assert!(
        written.contains("${PROMISE_HORIZON}"),
        "the script names its constants"
    );
    let out = r
        .try_cli(&["SCRIPT", "LOAD", written])
        .unwrap_or_else(|e| e);
    assert!(out.contains("Error compiling script"), "{out}");
    let loaded = r.cli(&["SCRIPT", "LOAD", common::script::text()]);
    assert_eq!(loaded.len(), 40, "the rendered script loads: {loaded}");
}
