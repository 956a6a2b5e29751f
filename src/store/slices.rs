//! Slices of cross-tenant buckets, so that a Redis Cluster has no hot shard.
//!
//! Every call that spends the global bucket (or a `shared = true` upstream's) would otherwise make
//! a second script call to the one shard of its hash tag (`{x}`, `{u:NAME}`), and every decision
//! of the fleet that spends it would meet there. Instead, each replica leases a small slice of the
//! bucket ahead of need (the script's `slice` operation takes up to N whole tokens of the GCRA
//! bucket, atomically, on the bucket's shard), spends it here (an atomic allowance per bucket, in
//! millionths of a token), and asks for the next slice in the background once half of it is spent.
//! A slice is sized from this replica's own rate: `[store] slice` of it (bounded by [`MAX_SHARE`]
//! of the burst), lives at most [`SLICE_LIFE`] after it was taken ([`SHARED_LIFE`] for a shared
//! upstream's, whose penalty and throttle it carries: see [`super::cross`]), and what is left of
//! it goes back to the bucket (the script's `refund`) when it expires, when the replica stops, or
//! never (a replica killed): then it is spent capacity that the bucket refills with its own time,
//! as any other. The tokens a replica holds unspent are at most two slices per bucket, so what a
//! fleet can strand is bounded by replicas × 2 × [`MAX_SHARE`] × burst.
//!
//! Exactness: a replica spends only tokens the bucket gave it, so the fleet never admits more than
//! the bucket allows in total. What moves is when: a token is spent after the bucket gave it out
//! (within the slice's life after its last refill), so in any interval the fleet admits at most
//! what the bucket allows in it plus what the slices held at its start. A call that finds the slice
//! empty (the refill has not come back yet) is decided the old way, on the buckets' shards, exactly;
//! it is never refused for want of a slice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::clock::Nanos;

/// How often the observed rate is brought up to date (at most).
const OBSERVE_EVERY: Nanos = 100_000_000;
/// The most of a bucket's burst one slice may take.
pub const MAX_SHARE: f64 = 1.0 / 16.0;
/// How long after it was taken a slice may still be spent; the rest then goes back.
pub const SLICE_LIFE: Nanos = 1_000_000_000;
/// The same for a slice of a `shared = true` upstream's bucket, which carries the upstream's
/// penalty, AIMD multiplier and adaptive throttle as its refill read them: a replica learns of a
/// 429 reported through another within this (and a round trip). A quarter of the shortest
/// Retry-After header (whole seconds) and of the default penalty (1 s), at a refill per upstream
/// and replica at most 4 times a second when calls are few.
pub const SHARED_LIFE: Nanos = 250_000_000;
/// The shortest pause before a bucket that gave no slice is asked again (it may hold tokens that
/// callers refused earlier were promised).
const RETRY_EMPTY: Nanos = 10_000_000;
/// Millionths of a token: the allowance counts in these, so fractional costs spend exactly.
const UNIT: f64 = 1e6;
/// How long the observed rate looks back: an older rate's weight falls by about e each.
const RATE_WINDOW: Nanos = 1_000_000_000;

/// The rate this replica spends a bucket at, and the slice that covers `[store] slice` of it.
#[derive(Debug, Clone, Default)]
pub struct Sizer {
    /// Tokens per second, smoothed.
    rate: f64,
    /// Tokens spent since `since`.
    spent: f64,
    since: Nanos,
}

impl Sizer {
    /// Notes `tokens` spent (from the slice or not) at `now`.
    pub fn observe(&mut self, tokens: f64, now: Nanos) {
        if self.since == 0 {
            self.since = now;
        }
        self.spent += tokens;
        let elapsed = now.saturating_sub(self.since);
        if elapsed >= OBSERVE_EVERY {
            let seen = self.spent * 1e9 / elapsed as f64;
            // A window past RATE_WINDOW replaces the old rate; a shorter one blends with it.
            let w = (elapsed as f64 / RATE_WINDOW as f64).min(1.0);
            self.rate = if self.rate == 0.0 {
                seen
            } else {
                self.rate * (1.0 - w) + seen * w
            };
            self.spent = 0.0;
            self.since = now;
        }
    }

    /// The tokens one slice should take: `span` (`[store] slice`) of the observed rate, at least
    /// one call (`call`) and at most [`MAX_SHARE`] of the `burst` (but never less than one call, or
    /// no call could be spent from a slice). Whole tokens: the bucket gives out whole ones.
    pub fn size(&self, call: f64, burst: f64, span: Nanos) -> f64 {
        let want = self.rate * span as f64 / 1e9;
        let most = (burst * MAX_SHARE).floor().max(call.ceil());
        want.ceil().max(call.ceil()).min(most).max(1.0)
    }
}

/// One bucket's slice in this replica.
#[derive(Debug, Default)]
pub struct Slice {
    /// Millionths of a token this replica may still spend without asking the store.
    left: AtomicU64,
    /// Until when (this process's monotonic nanoseconds) `left` may be spent.
    until: AtomicU64,
    /// A refill is on its way.
    refilling: AtomicBool,
    /// No refill before this instant: the last found the bucket empty, and it holds no token
    /// before then.
    not_before: AtomicU64,
    /// The bucket's whole tokens left and microseconds until full, as the last slice saw them (a
    /// call spent here reports these for its rate-limit headers).
    report: parking_lot::Mutex<(u64, f64)>,
    /// Microseconds per token of the bucket (what a token given back is worth), as last refilled.
    t_us: parking_lot::Mutex<f64>,
    /// Millionths of a token this replica's calls asked of the bucket so far (spent here or not),
    /// fed to the sizer when a refill is due, so that a call takes no lock.
    asked: AtomicU64,
    /// The size of the last slice asked for, in millionths of a token (0: none yet).
    size: AtomicU64,
    /// Counts [`Slice::halt`]s: a refill asked for before one is not spent.
    epoch: AtomicU64,
    /// The rate this replica spends at, and how much of it the sizer has seen (in `asked`'s units).
    sizer: parking_lot::Mutex<(Sizer, u64)>,
}

/// What [`Slice::spend`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Spent {
    /// Spent here; the bucket as the last slice saw it.
    Local { left: u64, reset_us: f64 },
    /// Not enough here: decide the call on the store.
    Empty,
}

impl Slice {
    /// Spends `tokens` from the slice if it holds them and has not expired.
    pub fn spend(&self, tokens: f64, now: Nanos) -> Spent {
        let need = (tokens * UNIT).ceil() as u64;
        self.asked.fetch_add(need, Ordering::Relaxed);
        if now >= self.until.load(Ordering::Acquire) {
            return Spent::Empty;
        }
        let took = self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| l.checked_sub(need));
        if took.is_err() {
            return Spent::Empty;
        }
        let (left, reset_us) = *self.report.lock();
        Spent::Local { left, reset_us }
    }

    /// Gives back tokens spent here by a call that another part of the store refused.
    pub fn unspend(&self, tokens: f64) {
        self.left
            .fetch_add((tokens * UNIT).ceil() as u64, Ordering::AcqRel);
    }

    /// Adds `tokens` a call gave back (its release's cost below its admission's) to the slice, if it
    /// may still be spent; false (nothing changed) once it has expired.
    pub fn give_back(&self, tokens: f64, now: Nanos) -> bool {
        if now >= self.until.load(Ordering::Acquire) {
            return false;
        }
        self.left
            .fetch_add((tokens * UNIT).floor() as u64, Ordering::AcqRel);
        true
    }

    /// Whether a refill should start now: none on its way, and less than half a slice left (or the
    /// slice expired). Marks one as started when it says yes.
    pub fn wants_refill(&self, call: f64, burst: f64, span: Nanos, now: Nanos) -> Option<f64> {
        if now < self.not_before.load(Ordering::Acquire) {
            return None;
        }
        let expired = now >= self.until.load(Ordering::Acquire);
        let size = match self.size.load(Ordering::Acquire) {
            0 => (call * UNIT).ceil() as u64,
            s => s,
        };
        let low = self.left.load(Ordering::Acquire) < size / 2;
        if !(expired || low) || self.refilling.swap(true, Ordering::AcqRel) {
            return None;
        }
        let mut sizer = self.sizer.lock();
        let asked = self.asked.load(Ordering::Relaxed);
        let new = asked.saturating_sub(sizer.1);
        sizer.1 = asked;
        sizer.0.observe(new as f64 / UNIT, now);
        let size = sizer.0.size(call, burst, span);
        self.size.store((size * UNIT) as u64, Ordering::Release);
        Some(size)
    }

    /// Takes what is left of an expired slice away (to give back); 0 while it may still be spent.
    pub fn take_expired(&self, now: Nanos) -> f64 {
        if now < self.until.load(Ordering::Acquire) {
            return 0.0;
        }
        self.left.swap(0, Ordering::AcqRel) as f64 / UNIT
    }

    /// Takes everything left (the replica stops, or the store lost its state).
    pub fn take_all(&self) -> f64 {
        self.left.swap(0, Ordering::AcqRel) as f64 / UNIT
    }

    /// A refill came back: `granted` whole tokens of a bucket of `t_us` microseconds per token and
    /// `burst`, spendable until `now` + `life`. A bucket that gave none is not asked again before
    /// it holds a token (at least [`RETRY_EMPTY`], at most `life` later). `asked`: the
    /// [`Slice::epoch`] the refill was asked in; a slice halted since keeps none of it, and the
    /// tokens to give back are returned.
    pub fn refilled(
        &self,
        granted: f64,
        shape: (f64, f64),
        report: (u64, f64),
        now: Nanos,
        life: Nanos,
        asked: u64,
    ) -> f64 {
        let (t_us, burst) = shape;
        let (left, reset_us) = report;
        *self.t_us.lock() = t_us;
        if self.epoch.load(Ordering::Acquire) != asked {
            self.refilling.store(false, Ordering::Release);
            return granted;
        }
        if granted < 1.0 {
            let first_us = (reset_us - (burst - 1.0) * t_us).max(0.0);
            let wait = ((first_us * 1e3) as Nanos).clamp(RETRY_EMPTY, life);
            self.not_before
                .fetch_max(now.saturating_add(wait), Ordering::AcqRel);
        }
        *self.report.lock() = (left, reset_us);
        self.left
            .fetch_add((granted * UNIT) as u64, Ordering::AcqRel);
        self.until
            .store(now.saturating_add(life), Ordering::Release);
        self.refilling.store(false, Ordering::Release);
        0.0
    }

    /// What a token of the bucket is worth in microseconds, as last refilled.
    pub fn t_us(&self) -> f64 {
        *self.t_us.lock()
    }

    /// Where the slice's halts stand, for a refill to say when it was asked.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Stops the slice at once (its upstream is under a penalty, or throttled): nothing more is
    /// spent here, no refill is asked before `not_before`, and a refill on its way is given back
    /// when it arrives. Returns the tokens the slice held, and what one is worth in microseconds,
    /// to give back to the bucket.
    pub fn halt(&self, not_before: Nanos) -> (f64, f64) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.until.store(0, Ordering::Release);
        self.not_before.fetch_max(not_before, Ordering::AcqRel);
        let t_us = *self.t_us.lock();
        (self.left.swap(0, Ordering::AcqRel) as f64 / UNIT, t_us)
    }

    /// A refill failed: the next call may ask again.
    pub fn refill_failed(&self) {
        self.refilling.store(false, Ordering::Release);
    }
}

/// Every cross-tenant bucket's slice in this replica, by the bucket's key.
#[derive(Debug, Default)]
pub struct Slices {
    map: parking_lot::RwLock<HashMap<String, Arc<Slice>>>,
}

impl Slices {
    /// The slice of the bucket `key`, if this replica has one.
    pub fn peek(&self, key: &str) -> Option<Arc<Slice>> {
        self.map.read().get(key).cloned()
    }

    /// The slice of the bucket `key`, made empty on first use.
    pub fn get(&self, key: &str) -> Arc<Slice> {
        if let Some(s) = self.map.read().get(key) {
            return Arc::clone(s);
        }
        Arc::clone(self.map.write().entry(key.to_string()).or_default())
    }

    /// Empties every slice and says what each held and what a token of it is worth in
    /// microseconds (to give back, or to forget when the store lost its state).
    pub fn drain(&self) -> Vec<(String, f64, f64)> {
        self.map
            .read()
            .iter()
            .map(|(k, s)| (k.clone(), s.take_all(), *s.t_us.lock()))
            .filter(|(_, n, _)| *n > 0.0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;
    /// `[store] slice = "100ms"`.
    const SPAN: Nanos = 100 * MS;

    /// A sizer fed `per_ms` tokens every millisecond for `ms`, on a fake clock from 1 s.
    fn fed(per_ms: f64, ms: u64) -> Sizer {
        let mut s = Sizer::default();
        for i in 0..=ms {
            s.observe(per_ms, 1_000 * MS + i * MS);
        }
        s
    }

    #[test]
    fn a_slice_covers_a_tenth_of_a_second_of_the_observed_rate() {
        // 2 tokens a millisecond is 2 000 a second: 100 ms of it is 200 tokens.
        let s = fed(2.0, 2_000);
        let size = s.size(1.0, 1e6, SPAN);
        assert!((195.0..=205.0).contains(&size), "{size}");
    }

    #[test]
    fn a_slice_is_at_most_a_sixteenth_of_the_burst_and_at_least_one_call() {
        let s = fed(2.0, 2_000);
        assert_eq!(s.size(1.0, 800.0, SPAN), 50.0);
        // A call larger than the share still fits one slice.
        assert_eq!(s.size(70.0, 800.0, SPAN), 70.0);
        // No rate seen yet: one call.
        assert_eq!(Sizer::default().size(3.0, 1e6, SPAN), 3.0);
        assert_eq!(Sizer::default().size(0.5, 1e6, SPAN), 1.0);
    }

    #[test]
    fn the_rate_follows_a_slowdown_within_its_window() {
        let mut s = fed(2.0, 2_000);
        // Then one token every 10 ms (100 a second) for five seconds.
        for i in 1..=500 {
            s.observe(1.0, 3_000 * MS + i * 10 * MS);
        }
        let size = s.size(1.0, 1e6, SPAN);
        assert!((10.0..=13.0).contains(&size), "{size}");
    }

    #[test]
    fn a_slice_spends_what_it_holds_and_nothing_past_it_or_its_life() {
        let slice = Slice::default();
        let now = 5_000 * MS;
        assert_eq!(slice.spend(1.0, now), Spent::Empty);
        slice.refilled(
            3.0,
            (10.0, 100.0),
            (7, 250.0),
            now,
            SLICE_LIFE,
            slice.epoch(),
        );
        for _ in 0..2 {
            assert_eq!(
                slice.spend(1.25, now + MS),
                Spent::Local {
                    left: 7,
                    reset_us: 250.0
                }
            );
        }
        // 0.5 left: a call of 1 is not spent here.
        assert_eq!(slice.spend(1.0, now + MS), Spent::Empty);
        assert_eq!(
            slice.spend(0.5, now + MS),
            Spent::Local {
                left: 7,
                reset_us: 250.0
            }
        );
        slice.unspend(2.0);
        // Past its life the slice spends nothing and gives back what it holds.
        assert_eq!(slice.spend(1.0, now + SLICE_LIFE), Spent::Empty);
        assert_eq!(slice.take_expired(now + SLICE_LIFE - 1), 0.0);
        assert_eq!(slice.take_expired(now + SLICE_LIFE), 2.0);
        assert_eq!(slice.take_all(), 0.0);
    }

    #[test]
    fn the_slice_asked_for_follows_what_the_calls_asked() {
        let slice = Slice::default();
        let t0 = 5_000 * MS;
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, t0), Some(1.0));
        slice.refilled(1.0, (1_000.0, 1e6), (0, 0.0), t0, SLICE_LIFE, slice.epoch());
        // Two calls a millisecond for 200 ms: the first spends the slice, the rest find it empty.
        for i in 0..400 {
            let spent = slice.spend(1.0, t0 + i * MS / 2);
            assert_eq!(spent == Spent::Empty, i > 0, "call {i}");
        }
        // 2 000 a second: a slice of 100 ms is 200 tokens.
        let size = slice.wants_refill(1.0, 1e6, SPAN, t0 + 200 * MS).unwrap();
        assert!((195.0..=205.0).contains(&size), "{size}");
        // Bounded by the burst's share.
        slice.refill_failed();
        assert_eq!(
            slice.wants_refill(1.0, 800.0, SPAN, t0 + 200 * MS),
            Some(50.0)
        );
    }

    #[test]
    fn one_refill_at_a_time_once_half_the_slice_is_spent() {
        let slice = Slice::default();
        let now = 5_000 * MS;
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now), Some(1.0));
        assert_eq!(
            slice.wants_refill(1.0, 1e6, SPAN, now),
            None,
            "one on its way"
        );
        slice.refilled(4.0, (10.0, 100.0), (0, 0.0), now, SLICE_LIFE, slice.epoch());
        // Four tokens held against a slice of one: no refill wanted.
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now), None);
        slice.take_all();
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now), Some(1.0));
        slice.refill_failed();
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now), Some(1.0));
        // The bucket had none to give: its first token is 10 ms away (a token is 1 ms, the bucket
        // 100 tokens full in 109 ms), and no refill is asked before.
        slice.refilled(
            0.0,
            (1_000.0, 100.0),
            (0, 109_000.0),
            now,
            SLICE_LIFE,
            slice.epoch(),
        );
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now + 9 * MS), None);
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now + 10 * MS), Some(1.0));
        // None given though the bucket holds tokens (promised to callers refused earlier): asked
        // again no sooner than 10 ms later, not on every call.
        let later = now + 20 * MS;
        slice.refilled(
            0.0,
            (1_000.0, 100.0),
            (50, 50_000.0),
            later,
            SLICE_LIFE,
            slice.epoch(),
        );
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, later + 9 * MS), None);
        assert_eq!(
            slice.wants_refill(1.0, 1e6, SPAN, later + 10 * MS),
            Some(1.0)
        );
    }

    #[test]
    fn a_halted_slice_spends_nothing_asks_nothing_and_keeps_no_refill_asked_before() {
        let slice = Slice::default();
        let now = 5_000 * MS;
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, now), Some(1.0));
        let asked = slice.epoch();
        assert_eq!(
            slice.refilled(6.0, (10.0, 100.0), (7, 250.0), now, SHARED_LIFE, asked),
            0.0
        );
        assert!(matches!(slice.spend(1.0, now + MS), Spent::Local { .. }));
        // A shared slice lives a quarter of a second.
        assert_eq!(slice.spend(1.0, now + SHARED_LIFE), Spent::Empty);
        // A 429: what it holds goes back (at what a token was worth), nothing more is spent here,
        // and no refill is asked before the penalty ends.
        let ends = now + 2_000 * MS;
        assert_eq!(slice.halt(ends), (5.0, 10.0));
        assert_eq!(slice.spend(1.0, now + 2 * MS), Spent::Empty);
        slice.refill_failed();
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, ends - 1), None);
        // A refill asked before the halt comes back after it: none of it is kept.
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, ends), Some(1.0));
        let before = slice.epoch();
        slice.halt(0);
        assert_eq!(
            slice.refilled(3.0, (10.0, 100.0), (0, 0.0), ends, SHARED_LIFE, before),
            3.0
        );
        assert_eq!(slice.spend(1.0, ends + MS), Spent::Empty);
        // The next one is.
        assert_eq!(slice.wants_refill(1.0, 1e6, SPAN, ends + MS), Some(1.0));
        let asked = slice.epoch();
        slice.refilled(3.0, (10.0, 100.0), (0, 0.0), ends + MS, SHARED_LIFE, asked);
        assert!(matches!(
            slice.spend(1.0, ends + 2 * MS),
            Spent::Local { .. }
        ));
    }
}
