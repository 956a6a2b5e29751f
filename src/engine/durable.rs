//! The part of the engine's state worth keeping across a restart, as plain data.
//!
//! What is kept is what a restart would otherwise hand back for free to the callers who should not
//! have it: daily quota use, penalty boxes, AIMD cuts and adaptive-throttle windows. Buckets are not
//! kept: they refill within seconds anyway, and restart full.
//!
//! Every instant is written on the wall clock (milliseconds since the Unix epoch), because the
//! monotonic clock starts again with the process: exporting turns "this long from now" into a wall
//! instant, importing turns it back with the new process's clock, so a penalty that ended while the
//! daemon was down is gone and a window slides on by the time it was down. A quota is kept with its
//! UTC day; a quota of a day that is over is not restored.
//!
//! The engine only converts; reading and writing the file is someone else's (`crate::state`).
//! Import takes what it is given at face value except for values that could not have been exported
//! (a negative use, a multiplier outside (0, 1]), which it drops rather than trusts.

use serde::{Deserialize, Serialize};

use super::adaptive::SreWindow;
use crate::clock::{utc_day, Nanos, NS_PER_MS};

/// Use of a daily quota on one UTC day.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QuotaUse {
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    pub used: f64,
}

impl QuotaUse {
    /// The use to restore at `wall_ms`: `None` for another day or a value no engine exports.
    pub fn today(self, wall_ms: i64) -> Option<f64> {
        (self.day == utc_day(wall_ms) && self.used.is_finite() && self.used > 0.0)
            .then_some(self.used)
    }
}

/// One subject's kept state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubjectDurable {
    pub subject: String,
    pub quota: QuotaUse,
}

/// One slot of an adaptive-throttle window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WindowSlot {
    /// When the slot began, wall clock.
    pub at_ms: i64,
    pub requests: u64,
    pub accepts: u64,
}

/// One upstream's kept state, for one tenant or (shared upstreams) for all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpstreamDurable {
    pub upstream: String,
    /// End of the penalty box, wall clock; absent when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub penalty_until_ms: Option<i64>,
    /// AIMD multiplier of the configured rate (1: full rate).
    #[serde(default = "one")]
    pub multiplier: f64,
    /// When the last 429 came, wall clock (an AIMD cut is forgotten a window after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_429_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub window: Vec<WindowSlot>,
}

fn one() -> f64 {
    1.0
}

/// One tenant's kept state.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TenantDurable {
    pub tenant: String,
    /// The tenant's own daily quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<QuotaUse>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subjects: Vec<SubjectDurable>,
    /// Upstreams that are not shared (each tenant has its own penalty and rate for them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upstreams: Vec<UpstreamDurable>,
    /// Spend of the day (tenant and subjects) and of live agent runs.
    #[serde(default, skip_serializing_if = "super::spend::DurableSpend::is_empty")]
    pub spend: super::spend::DurableSpend,
}

impl TenantDurable {
    /// Nothing worth writing.
    pub fn is_empty(&self) -> bool {
        self.quota.is_none()
            && self.subjects.is_empty()
            && self.upstreams.is_empty()
            && self.spend.is_empty()
    }
}

/// Converts between the monotonic clock of this process and the wall clock, at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Instants {
    pub now: Nanos,
    pub wall_ms: i64,
}

impl Instants {
    /// A monotonic instant on the wall clock (rounded up to the millisecond for instants to come,
    /// so a penalty never ends early).
    pub fn to_wall(self, t: Nanos) -> i64 {
        if t >= self.now {
            let ahead = (t - self.now).div_ceil(NS_PER_MS);
            self.wall_ms
                .saturating_add(i64::try_from(ahead).unwrap_or(i64::MAX))
        } else {
            let behind = (self.now - t) / NS_PER_MS;
            self.wall_ms
                .saturating_sub(i64::try_from(behind).unwrap_or(i64::MAX))
        }
    }

    /// A wall instant on this process's monotonic clock (0 for instants before its range).
    pub fn to_mono(self, wall_ms: i64) -> Nanos {
        let delta = i128::from(wall_ms) - i128::from(self.wall_ms);
        let t = i128::from(self.now) + delta * i128::from(NS_PER_MS);
        t.clamp(0, i128::from(Nanos::MAX)) as Nanos
    }

    /// A penalty's end to restore: `None` once it is over.
    pub fn penalty(self, until_ms: Option<i64>) -> Option<Nanos> {
        let t = self.to_mono(until_ms?);
        (t > self.now).then_some(t)
    }
}

/// A multiplier to restore: `None` for one no engine exports.
pub fn valid_multiplier(m: f64) -> Option<f64> {
    (m.is_finite() && m > 0.0 && m <= 1.0).then_some(m)
}

impl SreWindow {
    /// The window's slots on the wall clock.
    pub fn export(&self, at: Instants, window_ns: u64) -> Vec<WindowSlot> {
        let len = SreWindow::slot_len(window_ns);
        self.slots()
            .iter()
            .map(|&(slot, requests, accepts)| WindowSlot {
                at_ms: at.to_wall(slot.saturating_mul(len)),
                requests,
                accepts,
            })
            .collect()
    }

    /// A window from exported slots: each slot goes where its start falls on this process's clock,
    /// and slots that have left the window meanwhile are dropped.
    pub fn import(slots: &[WindowSlot], at: Instants, window_ns: u64) -> SreWindow {
        let len = SreWindow::slot_len(window_ns);
        let mut placed: Vec<(u64, u64, u64)> = Vec::new();
        let mut sorted = slots.to_vec();
        sorted.sort_by_key(|s| s.at_ms);
        for s in sorted {
            // A slot from the future (the wall clock went back) counts as now.
            let start = at.to_mono(s.at_ms).min(at.now);
            let slot = start / len;
            match placed.last_mut() {
                Some(last) if last.0 == slot => {
                    last.1 = last.1.saturating_add(s.requests);
                    last.2 = last.2.saturating_add(s.accepts);
                }
                _ => placed.push((slot, s.requests, s.accepts.min(s.requests))),
            }
        }
        let mut w = SreWindow::from_slots(placed);
        w.totals(at.now, window_ns);
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::NS_PER_SEC;

    const DAY_MS: i64 = 86_400_000;

    #[test]
    fn instants_convert_both_ways_and_penalties_that_ended_are_gone() {
        let before = Instants {
            now: 5 * NS_PER_SEC,
            wall_ms: 100 * DAY_MS,
        };
        let until = before.to_wall(35 * NS_PER_SEC);
        assert_eq!(until, 100 * DAY_MS + 30_000);
        // Down for 10 s; the new process's clock reads 1 s.
        let after = Instants {
            now: NS_PER_SEC,
            wall_ms: 100 * DAY_MS + 10_000,
        };
        assert_eq!(after.penalty(Some(until)), Some(21 * NS_PER_SEC));
        // Down for 31 s: over.
        let late = Instants {
            now: NS_PER_SEC,
            wall_ms: 100 * DAY_MS + 31_000,
        };
        assert_eq!(late.penalty(Some(until)), None);
        assert_eq!(late.penalty(None), None);
        // An instant before the new clock's range is its start.
        assert_eq!(after.to_mono(0), 0);
        // A penalty never ends early by rounding.
        assert_eq!(before.to_wall(5 * NS_PER_SEC + 1), 100 * DAY_MS + 1);
    }

    #[test]
    fn a_quota_of_a_past_day_or_a_value_never_exported_is_not_restored() {
        let q = QuotaUse {
            day: 100,
            used: 7.0,
        };
        assert_eq!(q.today(100 * DAY_MS + 5), Some(7.0));
        assert_eq!(q.today(101 * DAY_MS), None, "a new UTC day resets it");
        for used in [-1.0, 0.0, f64::NAN, f64::INFINITY] {
            assert_eq!(QuotaUse { day: 100, used }.today(100 * DAY_MS), None);
        }
        assert_eq!(valid_multiplier(0.5), Some(0.5));
        for m in [0.0, -0.5, 1.5, f64::NAN] {
            assert_eq!(valid_multiplier(m), None);
        }
    }

    #[test]
    fn a_window_survives_export_and_import_and_slides_by_the_downtime() {
        let window = 120 * NS_PER_SEC;
        let mut w = SreWindow::default();
        let base = 1_000 * NS_PER_SEC;
        for i in 0..30u64 {
            w.record(base + i * NS_PER_SEC, window, i % 3 != 0);
        }
        let at = Instants {
            now: base + 30 * NS_PER_SEC,
            wall_ms: 50 * DAY_MS,
        };
        let totals = w.totals(at.now, window);
        assert_eq!(totals, (30, 20));
        let slots = w.export(at, window);
        // Straight back: the same totals.
        let mut same = SreWindow::import(&slots, at, window);
        assert_eq!(same.totals(at.now, window), totals);
        // After 60 s down, on a clock that starts near zero but has room behind it: still all in.
        let later = Instants {
            now: 200 * NS_PER_SEC,
            wall_ms: 50 * DAY_MS + 60_000,
        };
        let mut w2 = SreWindow::import(&slots, later, window);
        assert_eq!(w2.totals(later.now, window), totals);
        // After 100 s down, the first part has left the window.
        let much_later = Instants {
            now: 200 * NS_PER_SEC,
            wall_ms: 50 * DAY_MS + 100_000,
        };
        let mut w3 = SreWindow::import(&slots, much_later, window);
        let (r, a) = w3.totals(much_later.now, window);
        assert!(r < 30 && r > 0, "{r}");
        assert!(a <= r);
        // Long gone: empty.
        let gone = Instants {
            now: 200 * NS_PER_SEC,
            wall_ms: 51 * DAY_MS,
        };
        assert!(SreWindow::import(&slots, gone, window).is_empty());
    }

    #[test]
    fn the_format_reads_what_it_writes_and_defaults_what_is_left_out() {
        let t = TenantDurable {
            spend: Default::default(),
            tenant: "acme".into(),
            quota: Some(QuotaUse { day: 3, used: 2.5 }),
            subjects: vec![SubjectDurable {
                subject: "bot".into(),
                quota: QuotaUse { day: 3, used: 1.0 },
            }],
            upstreams: vec![UpstreamDurable {
                upstream: "warehouse".into(),
                penalty_until_ms: Some(12),
                multiplier: 0.25,
                last_429_ms: Some(10),
                window: vec![WindowSlot {
                    at_ms: 9,
                    requests: 4,
                    accepts: 1,
                }],
            }],
        };
        let text = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<TenantDurable>(&text).unwrap(), t);
        let bare: TenantDurable =
            serde_json::from_str(r#"{"tenant":"a","upstreams":[{"upstream":"u"}]}"#).unwrap();
        assert_eq!(bare.upstreams[0].multiplier, 1.0);
        assert!(bare.quota.is_none() && bare.subjects.is_empty());
        assert!(TenantDurable::default().is_empty());
    }
}
