//! The promise cursor is written twice: in the engine (`engine/bucket.rs`, `promise_at` and
//! `cursor_live`, with `PROMISE_HORIZON` and `PROMISE_GRACE`) and in the shared-store script
//! (`promise_at` and `cursor_live` in `src/store/admitd.lua`, with the engine's two constants
//! written in as `HORIZON` and `GRACE` when the store builds the script it loads). These
//! tests feed both the same bucket, the same instants and the same refused callers, and hold them
//! to the same answers: each promise's wait, whether the horizon is booked, and whether the
//! promises before it are still waiting.
//!
//! The script's functions are run as the store loads them: its text up to and including
//! `promise_at`, with the store's clock replaced by the instant the test gives, evaluated by a real
//! Redis.

mod common;

use admitd::config::BucketSpec;
use admitd::engine::bucket::{Bucket, Gcra, Promise, Take};
use common::redis::RedisServer;

const US: u64 = 1_000;

/// The script's text up to the end of `promise_at`, on a clock the caller sets (ARGV[1], in
/// microseconds), then one call of it: ARGV[2..6] are cursor, tat, not_before, inc and tau.
fn script_promise() -> String {
    common::script::through(
        "promise_at",
        "local a = {}\nfor i = 2, 6 do a[i - 1] = tonumber(ARGV[i]) end\n\
         local live = cursor_live(a[1], a[2], a[5], a[3]) and 1 or 0\n\
         local c, w, b = promise_at(a[1], a[2], a[3], a[4], a[5])\n\
         return {string.format('%d', c), string.format('%.17g', w), b, live}",
    )
}

/// One promise as the script makes it at `now`, from `[cursor, tat, not_before, inc, tau]`: (new cursor, wait in microseconds, booked, whether the
/// promises before it were still waiting).
fn lua_promise(r: &RedisServer, src: &str, now: u64, state: [u64; 5]) -> (u64, f64, bool, bool) {
    let [cursor, tat, nb, inc, tau] = state;
    let args: Vec<String> = [now, cursor, tat, nb, inc, tau]
        .iter()
        .map(|x| x.to_string())
        .collect();
    let mut cmd = vec!["EVAL", src, "0"];
    cmd.extend(args.iter().map(String::as_str));
    let out = r.cli(&cmd);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    (
        lines[0].parse().unwrap(),
        lines[1].parse().unwrap(),
        lines[2] == "1",
        lines[3] == "1",
    )
}

/// A bucket drained at `start` by `taken` calls, then `refused` callers refused at instants `step`
/// apart, each that cannot come back before `nb_after` past its refusal: the engine's and the
/// script's promises agree call by call.
fn same_promises(rate: f64, burst: f64, taken: u32, refused: u32, step: u64, nb_after: u64) {
    let r = RedisServer::start();
    let src = script_promise();
    let g = Gcra::new(BucketSpec::new(rate, burst));
    let inc = g.increment(1.0);
    assert_eq!(
        inc % US,
        0,
        "a whole number of microseconds per token keeps the units exact"
    );
    assert_eq!(g.tau % US, 0);
    let start: u64 = 1_700_000_000 * 1_000_000 * US;
    let mut b = Bucket::default();
    for _ in 0..taken {
        assert!(matches!(b.take(&g, start, inc, 0), Take::Ok { .. }));
    }
    let tat = start + u64::from(taken) * inc;
    let mut cursor_us = 0u64;
    for i in 0..u64::from(refused) {
        let now = start + i * step;
        let nb = if nb_after > 0 { now + nb_after } else { 0 };
        let waiting = b.promises_waiting(&g, now, nb);
        let engine = b.promise(&g, now, nb, inc);
        let (c, wait_us, booked, lua_waiting) = lua_promise(
            &r,
            &src,
            now / US,
            [cursor_us, tat / US, nb / US, inc / US, g.tau / US],
        );
        cursor_us = c;
        let (e_wait, e_booked) = match engine {
            Promise::Slot(w) => (w, false),
            Promise::Booked(w) => (w, true),
        };
        assert_eq!(
            (e_wait as f64 / US as f64, e_booked, waiting),
            (wait_us, booked, lua_waiting),
            "refused caller {i} at +{} us (rate {rate}/s, burst {burst})",
            i * step / US
        );
    }
}

#[test]
fn callers_refused_at_once_are_promised_the_same_slots_up_to_the_horizon() {
    // 10 a second: 100 ms a token, so the 60 s horizon books after about 600 promises.
    same_promises(10.0, 5.0, 5, 700, 0, 0);
}

#[test]
fn callers_refused_over_time_keep_or_lose_their_promises_alike() {
    // Refusals 300 ms apart against a refill of 100 ms a token: promises are used up and new ones
    // start again from the bucket; the grace of a promise nobody came back for runs out alike.
    same_promises(10.0, 5.0, 5, 60, 300 * 1_000 * US, 0);
}

#[test]
fn callers_that_cannot_come_back_before_a_penalty_ends_are_promised_past_it() {
    same_promises(4.0, 2.0, 2, 40, 50 * 1_000 * US, 2_000 * 1_000 * US);
}

#[test]
fn a_promise_nobody_came_back_for_lapses_after_the_same_grace() {
    // 10 a second with a burst of 50 (a 5 s refill): callers 700 ms apart find the last promise's
    // slot 0.6 s, then 1.3 s behind them, inside and then past its grace.
    same_promises(10.0, 50.0, 50, 20, 700 * 1_000 * US, 0);
}
