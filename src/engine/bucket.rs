//! Token buckets in GCRA form, with reservation, refund and staggered retry hints.
//!
//! A bucket is stored as its *theoretical arrival time* (`tat`): the monotonic instant at which it will be
//! full again. With `T` the time one token takes to refill and `τ = burst·T`, taking `c` tokens at `now`
//! moves `tat` to `max(tat, now) + c·T`, and fits when the new `tat` is at most `now + τ`. This is the
//! generic cell rate algorithm: one integer of state, exact integer-nanosecond arithmetic, and a refund is
//! a subtraction because reservations are additive.
//!
//! *Holding* is a reservation past `now + τ`: the caller is told to wait `tat' − now − τ` and the tokens
//! are already its own, so holds queue up in FIFO order inside the bucket itself.
//!
//! The second word, `promised`, spreads retry hints. When a call is refused, it is promised the next
//! free slot *after* every slot already promised to earlier refused calls, so N callers refused in the
//! same instant hear N different waits, one refill apart. If each comes back when told, each finds its
//! token instead of colliding with the others again (a plain bucket tells all of them the same wait).
//! Limits without a bucket of their own (an upstream's penalty box and adaptive throttle, concurrency
//! slots) spread their hints the same way with [`stagger`], on a cursor of their own and a step the
//! caller chooses.
//!
//! The parameters (rate and burst) are not stored: they are passed in on every call, so a config reload
//! applies at once; [`Bucket::rescale`] keeps the number of missing tokens across a change of rate.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock::{Nanos, NS_PER_SEC};
use crate::config::BucketSpec;

/// Tolerance for a cost just over the burst (see [`Gcra::oversized`]).
const WHOLE_TOKEN_EPSILON: f64 = 1e-6;

/// Relative tolerance for the float error of counting tokens (`burst - missing_ns / t`, a few units in
/// the last place of `burst`), so that exactly 19 tokens are never counted as 18.999… and shown as 18.
/// It hides less than a nanosecond's worth of tokens in any bucket faster than one token per 1 000 s.
const TOKEN_COUNT_GUARD: f64 = 1e-12;

/// The longest full refill a bucket may have, in nanoseconds: about 73 years, so that `now + 2τ` and
/// the promise horizon stay far inside u64 for centuries of uptime.
pub const MAX_TAU: u64 = 1 << 61;

/// A bucket's parameters in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gcra {
    /// Nanoseconds per token.
    pub t: f64,
    /// Bucket size in tokens.
    pub burst: f64,
    /// Nanoseconds to refill the whole bucket (`burst · t`).
    pub tau: u64,
}

impl Gcra {
    pub fn new(spec: BucketSpec) -> Self {
        let mut t = NS_PER_SEC as f64 / spec.rate.per_sec;
        // The config refuses buckets slower than this; a throttled rate can still approach zero. A
        // slower refill would push `now + τ` past the end of the u64 scale, where the sums saturate
        // and the bucket could no longer refuse anything.
        let tau = t * spec.burst;
        if tau.is_nan() || tau > MAX_TAU as f64 {
            t = MAX_TAU as f64 / spec.burst;
        }
        Gcra {
            t,
            burst: spec.burst,
            tau: round_to_u64(t * spec.burst),
        }
    }

    /// The nanoseconds `cost` tokens take to refill, rounded down: what a bucket records as spent is
    /// then never more than its calls spent, so a bucket never counts one whole token fewer than it
    /// holds, and the whole tokens it shows are exactly what it would admit. (Rounded to the
    /// nearest, three calls of cost 1 at a refill of 666 666 666.7 ns each recorded 1 ns too many,
    /// and counting whole tokens needed a tolerance of a millionth of a token, which also hid real
    /// spending that small.)
    pub fn increment(&self, cost: f64) -> u64 {
        // Truncation is `floor` for a positive number (and 0 for anything else).
        (cost * self.t).min(u64::MAX as f64 / 4.0) as u64
    }

    /// Whether `cost` is more than the bucket can ever hold.
    pub fn oversized(&self, cost: f64) -> bool {
        cost > self.burst + WHOLE_TOKEN_EPSILON
    }

    /// Seconds a full refill takes, rounded up (the `w` of `RateLimit-Policy`).
    pub fn window_secs(&self) -> u64 {
        self.tau.div_ceil(NS_PER_SEC).max(1)
    }

    /// Whole tokens in a bucket that is full at `tat`, seen at `now`.
    fn whole_tokens(&self, tat: Nanos, now: Nanos) -> u64 {
        let missing_ns = tat.saturating_sub(now) as f64;
        let tokens = self.burst - missing_ns / self.t;
        if tokens <= 0.0 {
            0
        } else {
            // Truncation is `floor` for a positive number, without a call into libm. Only float error
            // is forgiven: 19.999999 tokens (a cost of 0.000001 spent) are 19 whole ones.
            (tokens + self.burst * TOKEN_COUNT_GUARD) as u64
        }
    }
}

/// `x.round() as u64` (half away from zero; negative and NaN give 0) for `x` up to 2^63, without
/// the call into libm that `round` is on the x86-64 baseline: the decisions round a few times per
/// layer.
#[inline]
fn round_to_u64(x: f64) -> u64 {
    let whole = x as u64;
    // Exact: below 2^52 the fraction of a double is computed without error, and above it there is
    // no fraction.
    if x - whole as f64 >= 0.5 {
        whole.saturating_add(1)
    } else {
        whole
    }
}

/// What taking from a bucket did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Taken; the caller must wait this many nanoseconds before proceeding (0: at once).
    Ok { wait: u64 },
    /// Not taken: the tokens would be there in this many nanoseconds, more than the caller may wait.
    Short { shortfall: u64 },
}

/// How far ahead promises may run: a caller that ignores its hint and comes straight back (a loop)
/// takes a new promise every time, and without a horizon the cursor would run away from the refill.
pub const PROMISE_HORIZON: Nanos = 60 * NS_PER_SEC;

/// How long after its slot a promise still counts. A caller that waited as told arrives a little after
/// its slot (its own sleep, the network, a busy machine); one that has not come back by then has given
/// up, and its promise stops holding back calls that may wait and the promises made after it.
pub const PROMISE_GRACE: Nanos = NS_PER_SEC;

/// What a refused call is told by a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promise {
    /// Its own slot, after every slot promised earlier: come back in this many nanoseconds.
    Slot(u64),
    /// Every slot up to the promise horizon is promised already: the first slot past it is this many
    /// nanoseconds away, and nothing was promised. The caller spreads such hints (see
    /// [`crate::engine::tenant`]) rather than telling them all the same instant.
    Booked(u64),
}

impl Promise {
    /// Nanoseconds until the slot (promised or, when booked, the first one past the horizon).
    pub fn wait(self) -> u64 {
        match self {
            Promise::Slot(w) | Promise::Booked(w) => w,
        }
    }
}

/// Whether a promise cursor still stands for callers expected back: it is ahead of the bucket's own
/// schedule (some promised token was not taken yet) and its last slot, which is never before
/// `not_before`, is less than [`PROMISE_GRACE`] old.
fn cursor_live(cursor: Nanos, tat: Nanos, now: Nanos, tau: u64, not_before: Nanos) -> bool {
    cursor > tat.max(now)
        && cursor
            .saturating_sub(tau)
            .max(not_before)
            .saturating_add(PROMISE_GRACE)
            > now
}

/// The promise for a call of `inc` refused at `now` that cannot come back before `not_before`, given the
/// promise cursor (the bucket's full-at instant once every promised caller has taken its token) and the
/// bucket's `tat`. Returns the new cursor (unchanged when booked) and the promise.
///
/// A take at `x` moves `tat` to `max(tat, x) + inc`, so the next promised take moves it to
/// `max(cursor, tat, now, not_before) + inc`, and may happen once that is within a refill of `x`.
fn promise_at(
    cursor: Nanos,
    tat: Nanos,
    now: Nanos,
    not_before: Nanos,
    inc: u64,
    tau: u64,
) -> (Nanos, Promise) {
    let cursor = if cursor_live(cursor, tat, now, tau, not_before) {
        cursor
    } else {
        0
    };
    let base = tat.max(now).max(not_before);
    let limit = base
        .saturating_add(inc)
        .saturating_add(PROMISE_HORIZON.max(tau));
    let next = cursor.max(base).saturating_add(inc);
    let at = |slot: Nanos| slot.saturating_sub(tau).max(not_before).max(now) - now;
    if next > limit {
        (cursor, Promise::Booked(at(limit)))
    } else {
        (next, Promise::Slot(at(next)))
    }
}

/// The next slot of a [`stagger`]ed hint: `step` after the last slot handed out, but not before
/// `base` (the first call refused toward it gets `base` itself); starting over at `base` past
/// `base + window`.
fn staggered_slot(last: Nanos, base: Nanos, step: u64, window: u64) -> Nanos {
    let next = last.saturating_add(step).max(base);
    if next > base.saturating_add(window) {
        base
    } else {
        next
    }
}

/// Spreads the retry hints of calls refused by a limit that has no refill of its own to promise
/// from (a penalty box, an adaptive throttle, concurrency slots): the first call refused toward an instant is told that
/// instant, each next one `step` later, so that callers who come back as told arrive one by one
/// instead of together. The spread covers at most `window` and then starts over: a caller that
/// ignores its hint and comes straight back (a loop) takes a slot every time, and must not push
/// everyone else's hint further and further out. `last` is the limit's cursor, the last slot handed
/// out (0: none); returns the slot.
pub fn stagger(last: &mut Nanos, base: Nanos, step: u64, window: u64) -> Nanos {
    *last = staggered_slot(*last, base, step, window);
    *last
}

/// The shortest window a [`stagger`] of upstream hints covers.
pub const STAGGER_MIN_WINDOW: Nanos = NS_PER_SEC;

/// The window the hints of calls refused for `wait` by an upstream (its penalty box or its adaptive
/// throttle) are staggered over: `wait` itself, at least [`STAGGER_MIN_WINDOW`], at most
/// [`PROMISE_HORIZON`]. The shared-store script computes the same (`stagger_window`).
pub fn stagger_window(wait: u64) -> u64 {
    wait.clamp(STAGGER_MIN_WINDOW, PROMISE_HORIZON)
}

/// [`stagger`] on a cursor shared across tenants (a shared upstream's penalty box and adaptive
/// throttle).
pub fn stagger_atomic(last: &AtomicU64, base: Nanos, step: u64, window: u64) -> Nanos {
    let prev = last
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
            Some(staggered_slot(l, base, step, window))
        })
        .unwrap_or_else(|l| l);
    staggered_slot(prev, base, step, window)
}

/// Shortfall in nanoseconds when the bucket is full at `tat`.
fn shortfall(tat: Nanos, now: Nanos, inc: u64, tau: u64) -> u64 {
    (tat.max(now).saturating_add(inc)).saturating_sub(now.saturating_add(tau))
}

/// A single-owner bucket (inside a tenant actor).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bucket {
    tat: Nanos,
    promised: Nanos,
}

impl Bucket {
    /// Takes `inc` nanoseconds of tokens if they are there within `max_wait` nanoseconds. A call is
    /// held only if no earlier promise is waiting for the tokens it would reserve: a hold jumping
    /// ahead of promised callers would take the slot one of them was told to come back for.
    pub fn take(&mut self, g: &Gcra, now: Nanos, inc: u64, max_wait: u64) -> Take {
        self.take_as(g, now, inc, max_wait, false)
    }

    /// [`Bucket::take`] for a caller that may be `returning` for a slot promised to it: such a call
    /// may be held into promised tokens, its own among them (it comes back a little before the
    /// bucket has its token when an earlier promised caller came back late).
    pub fn take_as(
        &mut self,
        g: &Gcra,
        now: Nanos,
        inc: u64,
        max_wait: u64,
        returning: bool,
    ) -> Take {
        let short = shortfall(self.tat, now, inc, g.tau);
        let behind_promises = short > 0 && !returning && self.promises_waiting(g, now, 0);
        if short > max_wait || behind_promises {
            return Take::Short { shortfall: short };
        }
        self.tat = self.tat.max(now).saturating_add(inc);
        Take::Ok { wait: short }
    }

    /// The shortfall, in nanoseconds, of taking `inc` now (0 when it fits).
    pub fn peek(&self, g: &Gcra, now: Nanos, inc: u64) -> u64 {
        shortfall(self.tat, now, inc, g.tau)
    }

    /// Gives back tokens taken earlier.
    pub fn refund(&mut self, inc: u64) {
        self.tat = self.tat.saturating_sub(inc);
    }

    /// Promises a refused call that cannot come back before `not_before` (0: at once) the next free
    /// slot after those already promised.
    pub fn promise(&mut self, g: &Gcra, now: Nanos, not_before: Nanos, inc: u64) -> Promise {
        let (cursor, p) = promise_at(self.promised, self.tat, now, not_before, inc, g.tau);
        self.promised = cursor;
        p
    }

    /// Whether callers promised a slot of this bucket are still expected back (see
    /// [`PROMISE_GRACE`]); `not_before` as given to their promises.
    pub fn promises_waiting(&self, g: &Gcra, now: Nanos, not_before: Nanos) -> bool {
        cursor_live(self.promised, self.tat, now, g.tau, not_before)
    }

    /// Whole tokens left at `now`.
    pub fn remaining(&self, g: &Gcra, now: Nanos) -> u64 {
        g.whole_tokens(self.tat, now)
    }

    /// Nanoseconds until the bucket is full.
    pub fn reset_ns(&self, now: Nanos) -> u64 {
        self.tat.saturating_sub(now)
    }

    /// True when the bucket is full and owes no promises: it is then the same as a new bucket.
    pub fn is_resting(&self, now: Nanos) -> bool {
        self.tat <= now && self.promised <= now
    }

    /// Keeps the number of missing tokens when the parameters change from `old` to `new`.
    pub fn rescale(&mut self, now: Nanos, old: &Gcra, new: &Gcra) {
        self.tat = rescale_instant(self.tat, now, old, new);
        self.promised = rescale_instant(self.promised, now, old, new);
    }
}

fn rescale_instant(at: Nanos, now: Nanos, old: &Gcra, new: &Gcra) -> Nanos {
    if at <= now || old == new {
        return at;
    }
    let missing_tokens = (at - now) as f64 / old.t;
    now.saturating_add((missing_tokens * new.t).round() as u64)
}

/// A bucket shared between threads (the global layer and shared upstreams): the same algorithm over
/// atomics, so every tenant actor can take from it without a lock or a message hop.
///
/// Its promise cursors are kept by each tenant, not in the bucket: staggering spreads one tenant's
/// herd of refused callers, and a tenant whose loop ignores its hints (and so takes a new promise on
/// every call) only pushes back its own hints, never another tenant's.
#[derive(Debug, Default)]
pub struct AtomicBucket {
    tat: AtomicU64,
}

impl AtomicBucket {
    pub fn take(&self, g: &Gcra, now: Nanos, inc: u64, max_wait: u64) -> Take {
        let mut cur = self.tat.load(Ordering::Acquire);
        loop {
            let short = shortfall(cur, now, inc, g.tau);
            if short > max_wait {
                return Take::Short { shortfall: short };
            }
            let next = cur.max(now).saturating_add(inc);
            match self
                .tat
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Take::Ok { wait: short },
                Err(actual) => cur = actual,
            }
        }
    }

    pub fn peek(&self, g: &Gcra, now: Nanos, inc: u64) -> u64 {
        shortfall(self.tat.load(Ordering::Acquire), now, inc, g.tau)
    }

    pub fn refund(&self, inc: u64) {
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_sub(inc))
            });
    }

    /// Like [`Bucket::promise`], with the caller's own promise cursor.
    pub fn promise(
        &self,
        cursor: &mut Nanos,
        g: &Gcra,
        now: Nanos,
        not_before: Nanos,
        inc: u64,
    ) -> Promise {
        let tat = self.tat.load(Ordering::Acquire);
        let (c, p) = promise_at(*cursor, tat, now, not_before, inc, g.tau);
        *cursor = c;
        p
    }

    /// Like [`Bucket::promises_waiting`], for the caller's own promise cursor.
    pub fn promises_waiting(&self, cursor: Nanos, g: &Gcra, now: Nanos, not_before: Nanos) -> bool {
        cursor_live(
            cursor,
            self.tat.load(Ordering::Acquire),
            now,
            g.tau,
            not_before,
        )
    }

    pub fn remaining(&self, g: &Gcra, now: Nanos) -> u64 {
        g.whole_tokens(self.tat.load(Ordering::Acquire), now)
    }

    pub fn reset_ns(&self, now: Nanos) -> u64 {
        self.tat.load(Ordering::Acquire).saturating_sub(now)
    }

    pub fn rescale(&self, now: Nanos, old: &Gcra, new: &Gcra) {
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(rescale_instant(t, now, old, new))
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::NS_PER_MS;

    #[test]
    fn rounding_without_libm_matches_round() {
        let mut cases = vec![
            0.0,
            -0.0,
            0.49999999999999994,
            0.5,
            1.5,
            2.5,
            -0.5,
            -2.7,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            4_503_599_627_370_495.5,
            4_503_599_627_370_497.0,
            9.2e18,
            u64::MAX as f64 / 4.0,
            3e19,
        ];
        let mut x = 0.001f64;
        while x < 1e19 {
            cases.extend([x, x + 0.5, x * 1.37, (x * 7.0).trunc() + 0.5]);
            x *= 1.9;
        }
        for x in cases {
            assert_eq!(round_to_u64(x), x.round() as u64, "{x:e}");
            if x > 0.0 {
                assert_eq!(x as u64, x.floor() as u64, "{x:e}");
            }
        }
    }

    fn g(per_sec: f64, burst: f64) -> Gcra {
        Gcra::new(BucketSpec::new(per_sec, burst))
    }

    #[test]
    fn full_bucket_gives_burst_then_refills_at_rate() {
        let g = g(2.0, 20.0);
        let mut b = Bucket::default();
        let now = 10 * NS_PER_SEC;
        let inc = g.increment(1.0);
        for i in 0..20 {
            assert_eq!(b.take(&g, now, inc, 0), Take::Ok { wait: 0 });
            assert_eq!(b.remaining(&g, now), 19 - i);
        }
        assert_eq!(
            b.take(&g, now, inc, 0),
            Take::Short {
                shortfall: 500 * NS_PER_MS
            }
        );
        // half a second later exactly one token is back
        let later = now + 500 * NS_PER_MS;
        assert_eq!(b.remaining(&g, later), 1);
        assert_eq!(b.take(&g, later, inc, 0), Take::Ok { wait: 0 });
        assert_eq!(
            b.take(&g, later, inc, 0),
            Take::Short {
                shortfall: 500 * NS_PER_MS
            }
        );
        assert_eq!(b.reset_ns(later), 10 * NS_PER_SEC);
    }

    #[test]
    fn a_hold_reserves_and_queues_in_order() {
        let g = g(10.0, 1.0);
        let mut b = Bucket::default();
        let now = NS_PER_SEC;
        let inc = g.increment(1.0);
        assert_eq!(b.take(&g, now, inc, 0), Take::Ok { wait: 0 });
        assert_eq!(
            b.take(&g, now, inc, 250 * NS_PER_MS),
            Take::Ok {
                wait: 100 * NS_PER_MS
            }
        );
        assert_eq!(
            b.take(&g, now, inc, 250 * NS_PER_MS),
            Take::Ok {
                wait: 200 * NS_PER_MS
            }
        );
        assert_eq!(
            b.take(&g, now, inc, 250 * NS_PER_MS),
            Take::Short {
                shortfall: 300 * NS_PER_MS
            }
        );
        // cancelling the last hold gives its slot to the next caller
        b.refund(inc);
        assert_eq!(
            b.take(&g, now, inc, 250 * NS_PER_MS),
            Take::Ok {
                wait: 200 * NS_PER_MS
            }
        );
    }

    #[test]
    fn a_bucket_throttled_towards_no_rate_still_holds_only_its_burst() {
        // A rate so slow that burst · T overflows the nanosecond scale: the refill is capped instead,
        // and the bucket refuses past its burst as every bucket does.
        for per_sec in [1.0 / 86_400.0 * 1e-6, 1e-300, f64::MIN_POSITIVE] {
            let g = g(per_sec, 100_000.0);
            assert_eq!(g.tau, MAX_TAU);
            let mut b = Bucket::default();
            let now = 5 * NS_PER_SEC;
            assert_eq!(
                b.take(&g, now, g.increment(60_000.0), 0),
                Take::Ok { wait: 0 }
            );
            assert_eq!(b.remaining(&g, now), 40_000);
            assert!(matches!(
                b.take(&g, now, g.increment(45_000.0), 0),
                Take::Short { .. }
            ));
            // (At this scale a nanosecond is below the precision of a token's time: take a little less.)
            assert_eq!(
                b.take(&g, now, g.increment(39_999.0), 0),
                Take::Ok { wait: 0 }
            );
            assert!(matches!(
                b.take(&g, now, g.increment(2.0), 0),
                Take::Short { .. }
            ));
            // One token is left, and a token takes hours to come back.
            assert_eq!(b.remaining(&g, now + 1_000 * NS_PER_SEC), 1);
        }
        // A slow bucket inside the bound keeps its exact refill.
        let g = g(1.0 / 86_400.0, 3_650.0);
        assert_eq!(g.tau, 3_650 * 86_400 * NS_PER_SEC);
    }

    #[test]
    fn refund_restores_exactly() {
        let g = g(1.0, 5.0);
        let mut b = Bucket::default();
        let inc = g.increment(3.0);
        b.take(&g, 0, inc, 0);
        assert_eq!(b.remaining(&g, 0), 2);
        b.refund(inc);
        assert_eq!(b.remaining(&g, 0), 5);
        assert!(b.is_resting(0));
    }

    #[test]
    fn promises_spread_refused_callers_one_refill_apart() {
        let g = g(2.0, 20.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        for _ in 0..20 {
            b.take(&g, 0, inc, 0);
        }
        let hints: Vec<u64> = (0..4).map(|_| b.promise(&g, 0, 0, inc).wait()).collect();
        assert_eq!(
            hints,
            vec![
                500 * NS_PER_MS,
                1000 * NS_PER_MS,
                1500 * NS_PER_MS,
                2000 * NS_PER_MS
            ]
        );
        assert!(!b.is_resting(0));
        // once the promised slots have passed and the bucket refilled, it is at rest again
        assert!(b.is_resting(12 * NS_PER_SEC));
    }

    #[test]
    fn a_caller_that_keeps_coming_back_cannot_push_promises_past_the_horizon() {
        let g = g(1.0, 1.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        b.take(&g, 0, inc, 0);
        let hints: Vec<Promise> = (0..10_000).map(|_| b.promise(&g, 0, 0, inc)).collect();
        // One slot a second up to the refill schedule (1 s) plus the horizon, then booked: the
        // first slot past the horizon, promised to nobody.
        assert_eq!(hints[0], Promise::Slot(NS_PER_SEC));
        assert_eq!(hints[59], Promise::Slot(60 * NS_PER_SEC));
        assert_eq!(hints[60], Promise::Slot(NS_PER_SEC + PROMISE_HORIZON));
        assert!(hints[61..]
            .iter()
            .all(|h| *h == Promise::Booked(NS_PER_SEC + PROMISE_HORIZON)));
        let a = AtomicBucket::default();
        a.take(&g, 0, inc, 0);
        let mut cursor = 0;
        let hints: Vec<Promise> = (0..10_000)
            .map(|_| a.promise(&mut cursor, &g, 0, 0, inc))
            .collect();
        assert_eq!(hints[60], Promise::Slot(NS_PER_SEC + PROMISE_HORIZON));
        assert_eq!(hints[9_999], Promise::Booked(NS_PER_SEC + PROMISE_HORIZON));
    }

    #[test]
    fn a_promise_that_cannot_come_back_before_a_penalty_ends_gets_the_slot_after_it() {
        // 5/s, burst 5, full; the upstream asked for 2 s. The first five are told the end of the
        // penalty (the burst is there then), each next one a refill step later.
        let g = g(5.0, 5.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        let now = 10 * NS_PER_SEC;
        let end = now + 2 * NS_PER_SEC;
        let hints: Vec<u64> = (0..8)
            .map(|_| b.promise(&g, now, end, inc).wait())
            .collect();
        let ms = |m: u64| m * NS_PER_MS;
        assert_eq!(
            hints,
            vec![
                ms(2000),
                ms(2000),
                ms(2000),
                ms(2000),
                ms(2000),
                ms(2200),
                ms(2400),
                ms(2600)
            ]
        );
        // Each caller that comes back as told finds its token.
        let mut arrivals: Vec<Nanos> = hints.iter().map(|h| now + h).collect();
        arrivals.sort_unstable();
        for at in arrivals {
            assert_eq!(b.take(&g, at, inc, 0), Take::Ok { wait: 0 }, "at {at}");
        }
    }

    #[test]
    fn a_hold_does_not_jump_ahead_of_a_promise_until_its_grace_is_over() {
        let g = g(2.0, 1.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        assert_eq!(b.take(&g, 0, inc, 0), Take::Ok { wait: 0 });
        // Refused and promised the next token, in 500 ms.
        assert_eq!(b.promise(&g, 0, 0, inc), Promise::Slot(500 * NS_PER_MS));
        // A call that may wait 2 s is not held into that token: it is refused (and promised the one
        // after).
        let t = 30 * NS_PER_MS;
        assert!(matches!(
            b.take(&g, t, inc, 2 * NS_PER_SEC),
            Take::Short { .. }
        ));
        assert_eq!(b.promise(&g, t, 0, inc), Promise::Slot(970 * NS_PER_MS));
        // The promised callers come back and find their tokens.
        assert_eq!(b.take(&g, 500 * NS_PER_MS, inc, 0), Take::Ok { wait: 0 });
        assert!(b.promises_waiting(&g, 500 * NS_PER_MS, 0));
        assert_eq!(b.take(&g, NS_PER_SEC, inc, 0), Take::Ok { wait: 0 });
        // Every promise taken: holds queue again.
        assert!(!b.promises_waiting(&g, NS_PER_SEC, 0));
        assert_eq!(
            b.take(&g, NS_PER_SEC, inc, NS_PER_SEC),
            Take::Ok {
                wait: 500 * NS_PER_MS
            }
        );
    }

    #[test]
    fn a_caller_returning_for_its_promise_is_held_when_an_earlier_one_came_back_late() {
        // Burst 1 at 2/s: two callers promised the slots at 500 ms and 1 s.
        let g = g(2.0, 1.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        b.take(&g, 0, inc, 0);
        assert_eq!(b.promise(&g, 0, 0, inc), Promise::Slot(500 * NS_PER_MS));
        assert_eq!(b.promise(&g, 0, 0, inc), Promise::Slot(NS_PER_SEC));
        // The first comes back 20 ms late: a full bucket of one token could not keep those 20 ms.
        assert_eq!(b.take(&g, 520 * NS_PER_MS, inc, 0), Take::Ok { wait: 0 });
        // The second, on time, is 20 ms early for the token. Any other call would not be held into
        // a promised token; the caller returning for its own is.
        let t = NS_PER_SEC;
        assert!(matches!(
            b.take_as(&g, t, inc, NS_PER_SEC, false),
            Take::Short { .. }
        ));
        assert_eq!(
            b.take_as(&g, t, inc, NS_PER_SEC, true),
            Take::Ok {
                wait: 20 * NS_PER_MS
            }
        );
    }

    #[test]
    fn a_promise_whose_caller_never_comes_back_expires_after_the_grace() {
        let g = g(1.0, 1.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        b.take(&g, 0, inc, 0);
        for k in 1..=3 {
            assert_eq!(b.promise(&g, 0, 0, inc), Promise::Slot(k * NS_PER_SEC));
        }
        // Nobody came back. Within the grace of the last slot (3 s), holds still wait behind it.
        let t = 3 * NS_PER_SEC + PROMISE_GRACE - NS_PER_MS;
        assert!(b.promises_waiting(&g, t, 0));
        assert!(matches!(b.take(&g, t, inc, NS_PER_SEC), Take::Ok { .. }));
        b.refund(inc);
        // Past it, the promises are forgotten: the next refusal gets the bucket's own next slot,
        // not one behind callers who gave up.
        let t = 3 * NS_PER_SEC + PROMISE_GRACE + NS_PER_MS;
        assert!(!b.promises_waiting(&g, t, 0));
        assert_eq!(b.take(&g, t, inc, 0), Take::Ok { wait: 0 });
        assert_eq!(b.promise(&g, t, 0, inc), Promise::Slot(NS_PER_SEC));
    }

    #[test]
    fn oversized_and_window() {
        let g = g(5.0 / 60.0, 5.0);
        assert!(g.oversized(5.5));
        assert!(!g.oversized(5.0));
        assert_eq!(g.window_secs(), 60);
        assert_eq!(self::g(5000.0, 5000.0).window_secs(), 1);
        assert_eq!(self::g(3.0, 1.0).window_secs(), 1);
    }

    #[test]
    fn fractional_rates_keep_whole_tokens_exact() {
        let g = g(3.0, 20.0);
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        b.take(&g, 0, inc, 0);
        assert_eq!(b.remaining(&g, 0), 19);
        let g7 = self::g(7.0 / 60.0, 7.0);
        let mut b = Bucket::default();
        let inc = g7.increment(1.0);
        for left in (0..7).rev() {
            b.take(&g7, 0, inc, 0);
            assert_eq!(b.remaining(&g7, 0), left);
        }
    }

    /// `r` counts whole tokens: a bucket short of the smallest fraction of a token shows one fewer,
    /// and one that holds a whole number of tokens after calls of awkward costs at awkward rates
    /// shows exactly that number.
    #[test]
    fn whole_tokens_are_neither_rounded_up_nor_one_short() {
        let g2 = g(2.0, 20.0);
        for cost in [1e-6, 1e-3, 0.4] {
            let mut b = Bucket::default();
            b.take(&g2, 0, g2.increment(cost), 0);
            assert_eq!(b.remaining(&g2, 0), 19, "cost {cost}");
        }
        for (rate, cost) in [
            (1.5, 1.0f64),
            (3.0, 1.0),
            (0.7, 0.1),
            (7.0 / 60.0, 0.01),
            (1e6, 1.0),
        ] {
            let g = g(rate, 20.0);
            let mut b = Bucket::default();
            let calls = (1.0 / cost).round() as u64;
            for _ in 0..calls * 3 {
                b.take(&g, 0, g.increment(cost), 0);
            }
            assert_eq!(b.remaining(&g, 0), 17, "rate {rate}, cost {cost}");
            // And what it shows, it admits.
            assert!(matches!(
                b.take(&g, 0, g.increment(17.0), 0),
                Take::Ok { wait: 0 }
            ));
            assert_eq!(b.remaining(&g, 0), 0, "rate {rate}, cost {cost}");
        }
    }

    #[test]
    fn rescale_keeps_missing_tokens() {
        let old = g(1.0, 10.0);
        let new = g(2.0, 10.0);
        let mut b = Bucket::default();
        b.take(&old, 0, old.increment(4.0), 0);
        assert_eq!(b.remaining(&old, 0), 6);
        b.rescale(0, &old, &new);
        assert_eq!(b.remaining(&new, 0), 6);
        assert_eq!(b.reset_ns(0), 2 * NS_PER_SEC);
    }

    #[test]
    fn atomic_bucket_matches_the_plain_one() {
        let g = g(2.0, 20.0);
        let a = AtomicBucket::default();
        let mut cursor = 0;
        let mut b = Bucket::default();
        let inc = g.increment(1.0);
        for step in 0..60u64 {
            let now = step * 100 * NS_PER_MS;
            let wait = if step % 3 == 0 { 300 * NS_PER_MS } else { 0 };
            // The plain bucket holds no call ahead of its promises; the shared one leaves that to
            // the caller, who keeps the cursor.
            let a_wait = if a.promises_waiting(cursor, &g, now, 0) {
                0
            } else {
                wait
            };
            assert_eq!(a.take(&g, now, inc, a_wait), b.take(&g, now, inc, wait));
            assert_eq!(a.remaining(&g, now), b.remaining(&g, now));
            if step % 7 == 0 {
                a.refund(inc);
                b.refund(inc);
            }
            assert_eq!(
                a.promise(&mut cursor, &g, now, 0, inc),
                b.promise(&g, now, 0, inc)
            );
        }
    }
}
