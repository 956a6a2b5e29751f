//! Retry hints for calls refused for want of a concurrency slot: when a slot is expected to free.
//!
//! A concurrency slot has no refill to promise from: it frees when a call in flight ends. So the
//! engine learns how long calls run, per subject and tool ([`RunTimes`], a running 90th percentile
//! of the last [`SAMPLES`] runs that releases report), and lays out a small calendar at each refusal
//! ([`next_slot`]): the expected end of every call in flight, then the calls queued for a slot (they
//! come first), then the callers already promised a slot, each holding it for its expected run. The
//! refused caller is promised the earliest slot left, never sooner than a floor, so callers who wait as
//! told come back one by one as slots really free instead of all at once, or before any could.
//!
//! Promises ([`SlotPromise`]) are kept until their caller takes a slot (the first call to take one
//! after a promise is due is taken to be its caller) or until [`PROMISE_GRACE`] after their time.

use std::hash::BuildHasher;

use crate::clock::{Nanos, NS_PER_MS, NS_PER_SEC};

use super::bucket::PROMISE_GRACE;

/// The run time assumed for a call nothing was learned about yet.
pub const DEFAULT_RUN_NS: u64 = NS_PER_SEC;

/// Runs remembered per subject and tool.
pub const SAMPLES: usize = 16;

/// Subject-and-tool pairs a tenant remembers run times for, at most; past that it starts over.
const BOOK_ENTRIES: usize = 4096;

/// Promises one scope (a subject, or the tenant) keeps at most; a refusal past that is not recorded
/// (its caller is still told a slot, after every recorded one).
pub const MAX_PROMISES: usize = 256;

/// The last runs of one subject and tool, in microseconds (a run longer than an hour counts as one).
#[derive(Debug, Clone, Default)]
pub struct RunTimes {
    ring: [u32; SAMPLES],
    len: u8,
    next: u8,
}

impl RunTimes {
    pub fn record(&mut self, run_ns: u64) {
        let us = (run_ns / 1_000).min(3_600_000_000) as u32;
        self.ring[self.next as usize] = us;
        self.next = ((self.next as usize + 1) % SAMPLES) as u8;
        self.len = (self.len + 1).min(SAMPLES as u8);
    }

    /// The 90th percentile of the runs remembered (the largest but one of sixteen).
    pub fn p90(&self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let mut v: Vec<u32> = self.ring[..self.len as usize].to_vec();
        v.sort_unstable();
        let i = ((v.len() * 9).div_ceil(10)).clamp(1, v.len()) - 1;
        Some(u64::from(v[i]) * 1_000)
    }
}

/// What a tenant learned about how long its calls run: per subject and tool, and per tool for a
/// subject not seen yet.
#[derive(Default)]
pub struct RunTimeBook {
    by_call: std::collections::HashMap<u64, RunTimes>,
    by_tool: std::collections::HashMap<u64, RunTimes>,
    hasher: foldhash::fast::RandomState,
}

impl RunTimeBook {
    fn key(&self, subject: &str, tool: &str) -> u64 {
        self.hasher.hash_one((subject, tool))
    }

    fn tool_key(&self, tool: &str) -> u64 {
        self.hasher.hash_one(tool)
    }

    pub fn record(&mut self, subject: &str, tool: &str, run_ns: u64) {
        if self.by_call.len() >= BOOK_ENTRIES {
            self.by_call.clear();
        }
        if self.by_tool.len() >= BOOK_ENTRIES {
            self.by_tool.clear();
        }
        let (k, t) = (self.key(subject, tool), self.tool_key(tool));
        self.by_call.entry(k).or_default().record(run_ns);
        self.by_tool.entry(t).or_default().record(run_ns);
    }

    /// How long a call of `subject` to `tool` is expected to run.
    pub fn estimate(&self, subject: &str, tool: &str) -> u64 {
        self.by_call
            .get(&self.key(subject, tool))
            .and_then(RunTimes::p90)
            .or_else(|| {
                self.by_tool
                    .get(&self.tool_key(tool))
                    .and_then(RunTimes::p90)
            })
            .unwrap_or(DEFAULT_RUN_NS)
    }
}

/// A slot promised to a refused caller: from `at`, for about `run` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPromise {
    pub at: Nanos,
    pub run: u64,
}

/// The shortest concurrency hint for a call expected to run `run`: a tenth of it, between 10 ms and a
/// second. No slot can be expected to free sooner than the calls in flight report it.
pub fn floor(run: u64) -> u64 {
    (run / 10).clamp(10 * NS_PER_MS, NS_PER_SEC)
}

/// The slot margin is the run divided by this (5%), between [`MARGIN_MIN`] and [`MARGIN_MAX`].
pub const MARGIN_SHARE: u64 = 20;
pub const MARGIN_MIN: Nanos = 20 * NS_PER_MS;
pub const MARGIN_MAX: Nanos = 250 * NS_PER_MS;

/// How long after a slot's expected end its promised caller is told to come: the end is an estimate,
/// and the release that frees the slot travels over the network too. 5% of the run, 20 to 250 ms.
/// The shared-store script computes the same (`slot_margin`, with these constants).
pub fn margin(run: u64) -> u64 {
    (run / MARGIN_SHARE).clamp(MARGIN_MIN, MARGIN_MAX)
}

/// Forgets the promises whose callers did not come back within the grace, and takes the first due
/// promise for a caller that just took a slot (`claim`). Keeps `promises` in time order.
pub fn settle(promises: &mut Vec<SlotPromise>, now: Nanos, claim: bool) {
    promises.retain(|p| p.at.saturating_add(PROMISE_GRACE) > now);
    if claim {
        // A promised caller comes back at or after its time (a few milliseconds early only by
        // clock granularity).
        if let Some(i) = promises
            .iter()
            .position(|p| p.at <= now.saturating_add(5 * NS_PER_MS))
        {
            promises.remove(i);
        }
    }
}

/// The slot to promise a call refused for want of one of `cap` slots, expected to run `run`.
///
/// `ends` are the expected ends of the calls in flight (any order; several past `now` are calls that
/// are late), `queued` the expected runs of the calls queued for a slot, in queue order, `promises`
/// the live promises in time order. The call may not come back before `not_before`.
pub fn next_slot(
    ends: &[Nanos],
    cap: u32,
    queued: &[u64],
    promises: &[SlotPromise],
    run: u64,
    now: Nanos,
    not_before: Nanos,
) -> Nanos {
    let cap = cap.max(1) as usize;
    let soonest = now.saturating_add(floor(run));
    // A call in flight that is past its expected end is expected to end soon, not in the past.
    let mut ends: Vec<Nanos> = ends.iter().map(|&e| e.max(soonest)).collect();
    ends.sort_unstable();
    // With more calls in flight than slots (a lowered limit), a slot frees only once the surplus has
    // ended: the slots are the latest `cap` ends.
    let mut slots: Vec<Nanos> = ends[ends.len().saturating_sub(cap)..].to_vec();
    while slots.len() < cap {
        slots.insert(0, now);
    }
    // Gives the earliest slot free at or after `from` to a call running `run`: (start, when the slot
    // freed).
    let mut take = |from: Nanos, run: u64| -> (Nanos, Nanos) {
        let (i, free) = slots
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(_, t)| t)
            .unwrap_or((0, now));
        let start = free.max(from);
        slots[i] = start.saturating_add(run);
        (start, free)
    };
    for &q in queued {
        take(now, q);
    }
    for p in promises {
        take(p.at, p.run);
    }
    let from = not_before.max(now);
    let (start, free) = take(from, run);
    // A slot that frees at a call's expected end is told a margin later; one free already is not.
    let at = if free > from {
        start.saturating_add(margin(run))
    } else {
        start
    };
    at.max(soonest)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = NS_PER_MS;

    #[test]
    fn the_percentile_follows_the_runs_reported() {
        let mut r = RunTimes::default();
        assert_eq!(r.p90(), None);
        r.record(1000 * MS);
        assert_eq!(r.p90(), Some(1000 * MS));
        for _ in 0..15 {
            r.record(100 * MS);
        }
        // One slow run in sixteen is above the 90th percentile... until more come.
        assert_eq!(r.p90(), Some(100 * MS));
        r.record(900 * MS);
        r.record(900 * MS);
        assert_eq!(r.p90(), Some(900 * MS));
        let mut book = RunTimeBook::default();
        assert_eq!(book.estimate("a", "search"), DEFAULT_RUN_NS);
        book.record("a", "search", 300 * MS);
        assert_eq!(book.estimate("a", "search"), 300 * MS);
        // Another subject of the same tool starts from what the tool's calls took.
        assert_eq!(book.estimate("b", "search"), 300 * MS);
        assert_eq!(book.estimate("a", "fetch"), DEFAULT_RUN_NS);
    }

    #[test]
    fn four_slots_busy_for_a_second_give_rounds_of_four() {
        let now = 10_000 * MS;
        let ends = [now + 1000 * MS; 4];
        let mut promises = Vec::new();
        let mut told = Vec::new();
        for _ in 0..16 {
            let at = next_slot(&ends, 4, &[], &promises, 1000 * MS, now, 0);
            promises.push(SlotPromise { at, run: 1000 * MS });
            told.push((at - now) / MS);
        }
        // One round after another, each just after the slots of the round before free.
        assert_eq!(
            told,
            vec![
                1050, 1050, 1050, 1050, 2100, 2100, 2100, 2100, 3150, 3150, 3150, 3150, 4200, 4200,
                4200, 4200
            ]
        );
    }

    #[test]
    fn queued_calls_come_before_promises_and_a_floor_holds() {
        let now = 0;
        // Two slots, one call in flight that is late (expected to have ended): it is expected to end
        // at the floor, not now.
        let ends = [0, 500 * MS];
        let at = next_slot(&ends, 2, &[], &[], 1000 * MS, now, 0);
        assert_eq!(at, floor(1000 * MS) + margin(1000 * MS));
        // A queued call takes that slot first.
        let at = next_slot(&ends, 2, &[1000 * MS], &[], 1000 * MS, now, 0);
        assert_eq!(at, 500 * MS + margin(1000 * MS));
        // And a call that cannot come back before a penalty ends is told the end.
        let at = next_slot(&ends, 2, &[], &[], 1000 * MS, now, 3000 * MS);
        assert_eq!(at, 3000 * MS);
    }

    #[test]
    fn promises_are_taken_by_their_callers_and_expire_after_the_grace() {
        let mut promises = vec![
            SlotPromise {
                at: 1000 * MS,
                run: MS,
            },
            SlotPromise {
                at: 2000 * MS,
                run: MS,
            },
        ];
        // Before its time, a call taking a slot is not the promised caller.
        settle(&mut promises, 500 * MS, true);
        assert_eq!(promises.len(), 2);
        settle(&mut promises, 1000 * MS, true);
        assert_eq!(
            promises,
            vec![SlotPromise {
                at: 2000 * MS,
                run: MS
            }]
        );
        // Its caller gave up: forgotten once the grace is over.
        settle(&mut promises, 2000 * MS + PROMISE_GRACE - MS, false);
        assert_eq!(promises.len(), 1);
        settle(&mut promises, 2000 * MS + PROMISE_GRACE, false);
        assert!(promises.is_empty());
    }
}
