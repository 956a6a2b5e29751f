//! Upstream-aware rate control: AIMD repricing on 429s, Google SRE client-side throttling, and the
//! max-min fair share of a contended shared upstream. Plain data and pure functions, driven by `now`.
//!
//! * **AIMD.** An upstream that answers 429 is telling us its real capacity is below our budget. Each 429
//!   multiplies the budget's effective rate by `aimd_factor` (never below `aimd_floor` of the configured
//!   rate); each successful call gives back `aimd_recover` of it, up to the configured rate.
//! * **Adaptive throttling** (Google SRE book, "Handling Overload"): over a sliding window, count the
//!   requests sent to the upstream and the ones it accepted, and refuse locally with probability
//!   max(0, (requests − K·accepts) / (requests + 1)). While the upstream accepts everything this is
//!   zero; when it rejects most calls, most calls are refused here, cheaply, instead of each one
//!   discovering the 429 upstream. Local refusals count as requests, so the rate of calls that reach the
//!   upstream settles at about K times what it accepts.
//! * **A learned ceiling** (shared upstreams). A 429 tells more than "too much": the rate the upstream
//!   served just before it ([`ServedMeter`]) is about what it takes. The rate holds below that
//!   ceiling and probes above it now and then ([`super::probe`]), so it settles under what the
//!   upstream takes instead of probing into it every second.
//! * **Fair share.** When tenants together want more of a shared upstream than it has, each gets its
//!   max-min fair share (weighted by plan): a tenant that wants less than an equal share gets what it
//!   wants and the rest is split among the others, so one tenant's loop cannot take the whole key.

use std::collections::VecDeque;

use crate::clock::{Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::Aimd;

/// Slots in the adaptive-throttling window (the shared-store script gets it from here).
pub const SRE_SLOTS: u64 = 24;

/// How close to the configured rate a recovering AIMD multiplier snaps to it: 0.2 + 8 × 0.1 is
/// 0.9999999999999999 in floating point (the shared-store script gets it from here).
pub const AIMD_SNAP: f64 = 1e-9;

/// Requests and accepts over a sliding window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SreWindow {
    /// (slot, requests, accepts), oldest first.
    slots: Vec<(u64, u64, u64)>,
}

impl SreWindow {
    /// How long one slot lasts.
    pub(crate) fn slot_len(window_ns: u64) -> u64 {
        (window_ns / SRE_SLOTS).max(1)
    }

    fn slot(now: Nanos, window_ns: u64) -> u64 {
        now / Self::slot_len(window_ns)
    }

    /// (slot, requests, accepts), oldest first (see [`super::durable`]).
    pub(crate) fn slots(&self) -> &[(u64, u64, u64)] {
        &self.slots
    }

    /// A window of the given slots, which must be oldest first (see [`super::durable`]).
    pub(crate) fn from_slots(slots: Vec<(u64, u64, u64)>) -> Self {
        SreWindow { slots }
    }

    fn expire(&mut self, slot: u64) {
        let keep_from = slot.saturating_sub(SRE_SLOTS - 1);
        self.slots.retain(|s| s.0 >= keep_from);
    }

    fn bump(&mut self, now: Nanos, window_ns: u64, requests: u64, accepts: u64) {
        let slot = Self::slot(now, window_ns);
        self.expire(slot);
        match self.slots.last_mut() {
            Some(last) if last.0 == slot => {
                last.1 += requests;
                last.2 += accepts;
            }
            _ => self.slots.push((slot, requests, accepts)),
        }
    }

    /// A request the upstream answered: accepted unless it was a 429.
    pub fn record(&mut self, now: Nanos, window_ns: u64, accepted: bool) {
        self.bump(now, window_ns, 1, u64::from(accepted));
    }

    /// A request refused locally by the throttle (it counts as a request, never as an accept).
    pub fn record_local_reject(&mut self, now: Nanos, window_ns: u64) {
        self.bump(now, window_ns, 1, 0);
    }

    /// (requests, accepts) in the window ending at `now`.
    pub fn totals(&mut self, now: Nanos, window_ns: u64) -> (u64, u64) {
        self.expire(Self::slot(now, window_ns));
        self.slots
            .iter()
            .fold((0, 0), |(r, a), s| (r + s.1, a + s.2))
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// True when every slot has left the window at `now` (nothing would be lost by dropping it).
    pub fn is_idle(&self, now: Nanos, window_ns: u64) -> bool {
        window_ns == 0
            || self
                .slots
                .last()
                .is_none_or(|s| s.0 + SRE_SLOTS <= Self::slot(now, window_ns))
    }

    /// The probability of refusing the next request locally (0 below `min_requests` requests).
    pub fn reject_probability(
        &mut self,
        now: Nanos,
        window_ns: u64,
        k: f64,
        min_requests: u64,
    ) -> f64 {
        let (requests, accepts) = self.totals(now, window_ns);
        if requests < min_requests {
            return 0.0;
        }
        throttle_probability(requests, accepts, k)
    }
}

/// max(0, (requests − k·accepts) / (requests + 1)).
pub fn throttle_probability(requests: u64, accepts: u64, k: f64) -> f64 {
    let r = requests as f64;
    ((r - k * accepts as f64) / (r + 1.0)).max(0.0)
}

/// Seconds an adaptive refusal's hint waits per unit of the odds that the upstream refuses
/// (p / (1 − p), with 1 − p at least [`ADAPTIVE_LEAST_ACCEPT`]), between [`ADAPTIVE_WAIT_MIN`] and
/// [`ADAPTIVE_WAIT_MAX`]: the more it rejects, the longer it takes to recover.
pub const ADAPTIVE_WAIT_PER_ODDS: f64 = 2.0;
pub const ADAPTIVE_LEAST_ACCEPT: f64 = 0.05;
pub const ADAPTIVE_WAIT_MIN: Nanos = NS_PER_SEC;
pub const ADAPTIVE_WAIT_MAX: Nanos = 30 * NS_PER_SEC;

/// How long a call the adaptive throttle refused with probability `p` waits at least (before the
/// hints of calls refused together are staggered): 2 × p / (1 − p) seconds, 1 to 30. The
/// shared-store script computes the same (`adaptive_wait`, with these constants).
pub fn adaptive_wait(p: f64) -> Nanos {
    let secs = |ns: Nanos| ns as f64 / NS_PER_SEC as f64;
    let wait = (ADAPTIVE_WAIT_PER_ODDS * p / (1.0 - p).max(ADAPTIVE_LEAST_ACCEPT))
        .clamp(secs(ADAPTIVE_WAIT_MIN), secs(ADAPTIVE_WAIT_MAX));
    (wait * NS_PER_SEC as f64) as u64
}

/// The AIMD multiplier after a 429.
pub fn aimd_cut(m: f64, a: &Aimd) -> f64 {
    (m * a.factor).max(a.floor).min(1.0)
}

/// The AIMD multiplier after a successful call.
pub fn aimd_recover(m: f64, a: &Aimd) -> f64 {
    let next = m + a.recover;
    if next >= 1.0 - AIMD_SNAP {
        1.0
    } else {
        next
    }
}

/// Length of one slot of a [`ServedMeter`].
const METER_SLOT: Nanos = 100 * NS_PER_MS;
/// How far back a [`ServedMeter`] looks: 20 slots, 2 s.
const METER_SLOTS: u64 = 20;
/// The least a [`ServedMeter`] must have seen before its rate is trusted: at least this many answers,
/// over at least half a second (a burst after a quiet spell says little about a sustained rate).
const METER_MIN_ANSWERS: u64 = 10;
const METER_MIN_SPAN: Nanos = 500 * NS_PER_MS;

/// What an upstream served over the last two seconds, in 100 ms slots.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServedMeter {
    /// (slot, answers, budget units they spent), oldest first.
    slots: VecDeque<(u64, u64, f64)>,
}

impl ServedMeter {
    fn expire(&mut self, slot: u64) {
        let keep_from = slot.saturating_sub(METER_SLOTS - 1);
        while self.slots.front().is_some_and(|s| s.0 < keep_from) {
            self.slots.pop_front();
        }
    }

    /// One answer served at `now`, worth `units` of the budget (its cost times the upstream's units).
    pub fn record(&mut self, now: Nanos, units: f64) {
        let slot = now / METER_SLOT;
        self.expire(slot);
        let units = units.max(0.0);
        match self.slots.back_mut() {
            Some(last) if last.0 == slot => {
                last.1 += 1;
                last.2 += units;
            }
            _ => self.slots.push_back((slot, 1, units)),
        }
    }

    /// Budget units served per second over the last two seconds (or since the first answer, when
    /// that is more recent); `None` while too little was seen to tell.
    pub fn rate(&mut self, now: Nanos) -> Option<f64> {
        self.expire(now / METER_SLOT);
        let first = self.slots.front()?.0 * METER_SLOT;
        let (answers, units) = self
            .slots
            .iter()
            .fold((0, 0.0), |(a, u), s| (a + s.1, u + s.2));
        let span = now.saturating_sub(first).min(METER_SLOTS * METER_SLOT);
        (answers >= METER_MIN_ANSWERS && span >= METER_MIN_SPAN)
            .then(|| units * NS_PER_SEC as f64 / span as f64)
    }
}

/// Max-min fair shares of `capacity` among `(demand, weight)` claimants, in the same order.
///
/// Water-filling: repeatedly give every unsatisfied claimant its weighted part of what is left; those
/// who want less than that take only what they want, and the surplus goes round again.
pub fn max_min_fair(capacity: f64, claims: &[(f64, f64)]) -> Vec<f64> {
    let mut shares = vec![0.0; claims.len()];
    let mut open: Vec<usize> = (0..claims.len()).filter(|&i| claims[i].0 > 0.0).collect();
    let mut left = capacity.max(0.0);
    while !open.is_empty() && left > 1e-12 {
        let weight: f64 = open.iter().map(|&i| claims[i].1.max(1e-9)).sum();
        let per_weight = left / weight;
        let (done, rest): (Vec<usize>, Vec<usize>) = open
            .iter()
            .partition(|&&i| claims[i].0 - shares[i] <= per_weight * claims[i].1.max(1e-9));
        if done.is_empty() {
            for &i in &rest {
                shares[i] += per_weight * claims[i].1.max(1e-9);
            }
            break;
        }
        for &i in &done {
            left -= claims[i].0 - shares[i];
            shares[i] = claims[i].0;
        }
        open = rest;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::NS_PER_SEC;

    const W: u64 = 120 * NS_PER_SEC;

    #[test]
    fn sre_probability_at_known_counts() {
        assert_eq!(throttle_probability(0, 0, 2.0), 0.0);
        assert_eq!(throttle_probability(100, 100, 2.0), 0.0);
        assert_eq!(throttle_probability(100, 50, 2.0), 0.0);
        // 100 requests, 25 accepted, K = 2: (100 - 50) / 101
        assert!((throttle_probability(100, 25, 2.0) - 50.0 / 101.0).abs() < 1e-12);
        // nothing accepted: (r) / (r + 1)
        assert!((throttle_probability(99, 0, 2.0) - 0.99).abs() < 1e-12);
        assert!((throttle_probability(10, 2, 1.5) - 7.0 / 11.0).abs() < 1e-12);
    }

    #[test]
    fn sre_window_slides() {
        let mut w = SreWindow::default();
        for _ in 0..30 {
            w.record(0, W, false);
        }
        for _ in 0..10 {
            w.record(0, W, true);
        }
        assert_eq!(w.totals(0, W), (40, 10));
        w.record_local_reject(NS_PER_SEC, W);
        assert_eq!(w.totals(NS_PER_SEC, W), (41, 10));
        assert!((w.reject_probability(NS_PER_SEC, W, 2.0, 10) - 21.0 / 42.0).abs() < 1e-12);
        assert_eq!(
            w.reject_probability(NS_PER_SEC, W, 2.0, 42),
            0.0,
            "below min_requests"
        );
        // two minutes later the old slots are gone
        assert_eq!(w.totals(W + 5 * NS_PER_SEC, W), (0, 0));
        assert!(w.is_empty());
    }

    #[test]
    fn aimd_cuts_multiplicatively_and_recovers_additively() {
        let a = Aimd {
            factor: 0.5,
            floor: 0.1,
            recover: 0.05,
        };
        let mut m = 1.0;
        m = aimd_cut(m, &a);
        assert_eq!(m, 0.5);
        m = aimd_cut(m, &a);
        assert_eq!(m, 0.25);
        for _ in 0..5 {
            m = aimd_cut(m, &a);
        }
        assert_eq!(m, 0.1, "floor");
        for _ in 0..10 {
            m = aimd_recover(m, &a);
        }
        assert!((m - 0.6).abs() < 1e-9);
        for _ in 0..100 {
            m = aimd_recover(m, &a);
        }
        assert_eq!(m, 1.0, "never above the configured rate");
    }

    #[test]
    fn the_served_meter_needs_half_a_second_and_ten_answers_and_looks_two_seconds_back() {
        let mut m = ServedMeter::default();
        assert_eq!(m.rate(0), None);
        // 20 answers/s from t = 10 s on (one every 50 ms)
        let t0 = 10 * NS_PER_SEC;
        for i in 0..9 {
            m.record(t0 + i * 50 * NS_PER_MS, 1.0);
        }
        assert_eq!(m.rate(t0 + 600 * NS_PER_MS), None, "nine answers");
        m.record(t0 + 450 * NS_PER_MS, 1.0);
        assert_eq!(m.rate(t0 + 450 * NS_PER_MS), None, "under half a second");
        // since the first answer, when that is less than two seconds ago
        assert_eq!(m.rate(t0 + 500 * NS_PER_MS), Some(20.0));
        for i in 10..60 {
            m.record(t0 + i * 50 * NS_PER_MS, 1.0);
        }
        // 3 s of answers: only the last 20 slots of 100 ms count, the current one (empty so far)
        // and 19 before it, 38 answers over 1.9 s
        assert_eq!(m.rate(t0 + 3 * NS_PER_SEC), Some(20.0));
        // an amplified call counts its units
        m.record(t0 + 3 * NS_PER_SEC, 5.0);
        let r = m.rate(t0 + 3 * NS_PER_SEC).unwrap();
        assert!((r - 43.0 / 1.9).abs() < 1e-9, "{r}");
        // quiet for long: nothing to tell
        assert_eq!(m.rate(t0 + 10 * NS_PER_SEC), None);
    }

    #[test]
    fn max_min_fair_shares() {
        // two light tenants keep their demand; the loop gets what is left
        assert_eq!(
            max_min_fair(20.0, &[(2.0, 1.0), (2.0, 1.0), (1000.0, 1.0)]),
            vec![2.0, 2.0, 16.0]
        );
        // everyone wants more: equal split
        assert_eq!(
            max_min_fair(30.0, &[(100.0, 1.0), (50.0, 1.0), (40.0, 1.0)]),
            vec![10.0, 10.0, 10.0]
        );
        // water-filling in several rounds
        let s = max_min_fair(10.0, &[(1.0, 1.0), (3.0, 1.0), (100.0, 1.0)]);
        assert_eq!(s, vec![1.0, 3.0, 6.0]);
        // uncontended: everyone gets their demand
        assert_eq!(
            max_min_fair(10.0, &[(1.0, 1.0), (2.0, 1.0)]),
            vec![1.0, 2.0]
        );
        // weights: a weight-2 tenant gets twice the share of a weight-1 tenant when both want more
        let s = max_min_fair(30.0, &[(100.0, 2.0), (100.0, 1.0)]);
        assert!(
            (s[0] - 20.0).abs() < 1e-9 && (s[1] - 10.0).abs() < 1e-9,
            "{s:?}"
        );
        assert_eq!(
            max_min_fair(10.0, &[(0.0, 1.0), (50.0, 1.0)]),
            vec![0.0, 10.0]
        );
    }
}
