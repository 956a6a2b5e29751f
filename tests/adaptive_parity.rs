//! The adaptive throttle's window is written twice: in the engine (`engine::adaptive::SreWindow`,
//! its `SRE_SLOTS` slots and `reject_probability`) and in the shared-store script (`sre_record`,
//! `sre_totals` and `reject_probability` in `src/store/admitd.lua`, with the engine's `SRE_SLOTS`
//! written in). These tests feed both the same answers of an upstream at the same instants (accepts,
//! 429s, calls refused by the throttle itself, quiet spells that rotate slots out of the window)
//! and hold them to the same requests and accepts in the window, and the same probability of
//! refusing the next call; and a refused call's least wait (`adaptive_wait` in both) alike.
//!
//! The script's functions are run as the store loads them, on a clock the test moves, by a real
//! Redis. Both count slots of a 24th of the window, the engine in nanoseconds and the store in whole
//! microseconds: the windows here are whole multiples of 24 µs, so the slots' edges are the same
//! instants.

mod common;

use admitd::engine::adaptive::{
    adaptive_wait, SreWindow, ADAPTIVE_WAIT_MAX, ADAPTIVE_WAIT_MIN, SRE_SLOTS,
};
use common::redis::RedisServer;
use common::script::{eval_at_zero, through};

const US: u64 = 1_000;
const SEC: u64 = 1_000_000 * US;

/// What an upstream's throttle sees at one instant.
#[derive(Clone, Copy, Debug)]
enum Event {
    Accepted,
    Limited,
    /// Refused by the throttle itself: a request, never an accept.
    LocalReject,
}

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

/// Events `window` apart on average a slot's tenth, with now and then a quiet spell of up to a
/// whole window and a half; an upstream that turns from accepting to rejecting and back.
fn events(seed: u64, window: u64, n: usize) -> Vec<(u64, Event)> {
    let slot = window / SRE_SLOTS;
    let mut g = Lcg(seed);
    let mut at = 1_700_000_000 * SEC;
    (0..n)
        .map(|i| {
            at += if g.below(40) == 0 {
                g.below(window * 3 / 2 / US) * US
            } else {
                g.below(slot / 5 / US) * US
            };
            let rejecting = (i / 150) % 2 == 1;
            let e = match g.below(10) {
                0..=1 => Event::LocalReject,
                x if rejecting && x < 8 => Event::Limited,
                x if !rejecting && x == 9 => Event::Limited,
                _ => Event::Accepted,
            };
            (at, e)
        })
        .collect()
}

/// After each event, the script's (requests, accepts, probability with K = `k` and at least
/// `least` requests).
fn lua_window(
    r: &RedisServer,
    window: u64,
    k: f64,
    least: u64,
    events: &[(u64, Event)],
) -> Vec<(u64, u64, f64)> {
    let src = through(
        "reject_probability",
        "local key, window, k, least = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])\n\
         local out = {}\n\
         for i = 5, #ARGV, 2 do\n\
           now = tonumber(ARGV[i])\n\
           local e = ARGV[i + 1]\n\
           if e == 'a' then sre_record(key, window, 1, 1)\n\
           else sre_record(key, window, 1, 0) end\n\
           local req, acc = sre_totals(key, window)\n\
           out[#out + 1] = req .. ' ' .. acc .. ' ' .. string.format('%.17g', reject_probability(req, acc, k, least))\n\
         end\n\
         return out",
    );
    let mut args = vec![
        (events[0].0 / US).to_string(),
        (window / US).to_string(),
        format!("{k}"),
        least.to_string(),
    ];
    for (at, e) in events {
        args.push((at / US).to_string());
        args.push(
            match e {
                Event::Accepted => "a",
                Event::Limited => "l",
                Event::LocalReject => "r",
            }
            .to_string(),
        );
    }
    let mut cmd = vec!["EVAL", &src, "1", "admitd:{x}:up:api"];
    cmd.extend(args.iter().map(String::as_str));
    let out = r.cli(&cmd);
    out.lines()
        .map(|l| {
            let mut p = l.split(' ');
            let mut next = || p.next().unwrap_or_else(|| panic!("{out}"));
            (
                next().parse().unwrap(),
                next().parse().unwrap(),
                next().parse().unwrap(),
            )
        })
        .collect()
}

fn same_window(seed: u64, window: u64, k: f64, least: u64) {
    assert_eq!(window % (SRE_SLOTS * US), 0, "slots of whole microseconds");
    let r = RedisServer::start();
    let events = events(seed, window, 600);
    let lua = lua_window(&r, window, k, least, &events);
    assert_eq!(lua.len(), events.len());
    let mut w = SreWindow::default();
    let (mut rotated, mut refusing) = (false, false);
    let mut before = 0;
    for (i, (&(at, e), &(req, acc, p))) in events.iter().zip(&lua).enumerate() {
        match e {
            Event::Accepted => w.record(at, window, true),
            Event::Limited => w.record(at, window, false),
            Event::LocalReject => w.record_local_reject(at, window),
        }
        let engine = w.totals(at, window);
        let engine_p = w.reject_probability(at, window, k, least);
        assert_eq!(
            (engine, engine_p),
            ((req, acc), p),
            "event {i} ({e:?}) at +{} us, window {} s, K {k}",
            (at - events[0].0) / US,
            window / SEC
        );
        rotated |= req <= before;
        refusing |= p > 0.0;
        before = req;
    }
    assert!(rotated, "slots left the window");
    assert!(refusing, "the throttle refused");
}

#[test]
fn a_two_minute_window_counts_and_refuses_alike() {
    same_window(1, 120 * SEC, 2.0, 20);
}

#[test]
fn a_short_window_rotates_its_slots_alike() {
    // 2.4 s: slots of 100 ms, most events in the same slot as the one before.
    same_window(2, 2_400_000 * US, 1.5, 0);
}

#[test]
fn a_window_of_24_ms_has_slots_of_a_millisecond_in_both() {
    same_window(3, 24_000 * US, 2.0, 5);
}

#[test]
fn a_refused_call_waits_alike_however_much_the_upstream_rejects() {
    let r = RedisServer::start();
    let src = through(
        "adaptive_wait",
        "local out = {}\n\
         for i = 2, #ARGV do out[#out + 1] = string.format('%d', adaptive_wait(tonumber(ARGV[i]))) end\n\
         return out",
    );
    // Below the least wait, inside, at and past the most, and an upstream that accepts nothing.
    let ps = [
        0.0,
        0.1,
        1.0 / 3.0,
        0.5,
        0.75,
        0.9,
        0.9375,
        0.95,
        0.97,
        0.999,
        1.0,
    ];
    let args: Vec<String> = ps.iter().map(|p| format!("{p:?}")).collect();
    let lua: Vec<u64> = eval_at_zero(&r, &src, &args)
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let mut inside = false;
    for (p, lua) in ps.iter().zip(lua) {
        let engine = adaptive_wait(*p) / US;
        // The engine truncates nanoseconds, the script microseconds: at most a microsecond apart.
        assert!(
            engine.abs_diff(lua) <= 1,
            "p {p}: engine {engine} us, script {lua} us"
        );
        inside |= lua > ADAPTIVE_WAIT_MIN / US && lua < ADAPTIVE_WAIT_MAX / US;
    }
    assert!(inside, "a case between the bounds");
}
