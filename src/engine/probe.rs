//! Probing a shared upstream's learned ceiling: where its rate holds, when it tries more, how far,
//! and what a probe's outcome changes. Plain data driven by `now`, the same for both stores: the
//! memory store keeps one [`Probe`] per shared upstream, the Redis store keeps its fields in the
//! upstream's state hash and has this module compute every change (`store::redis`).
//!
//! Rates here are multipliers of the configured rate, as everywhere in AIMD.
//!
//! * A 429 outside a probe teaches a **ceiling**: what the upstream served just before it (never
//!   above the rate in force). The rate is cut (`aimd_factor`) to at most the **hold**, `probe_hold`
//!   of the ceiling, and each healthy answer wins `aimd_recover` back up to the hold, never past it.
//!   At the hold no 429 is drawn: the upstream is given slightly less than it takes.
//! * Every so often (`probe_every` at first) the rate goes above the ceiling for [`PROBE_LEN`]: the
//!   ceiling plus `probe_step` of it. A probe that draws a 429 leaves the ceiling where it was (the
//!   limit lies between it and the target), cuts the rate as any 429 does, doubles the wait before
//!   the next probe (up to [`WIDEST`] times `probe_every`) and takes the step back to `probe_step`.
//!   An upstream whose limit stays put is so probed less and less often, by the smallest step.
//! * A probe the upstream served without a 429, at a rate past the ceiling, is **clean**: the
//!   ceiling rises to what was served, the next probe comes [`AFTER_CLEAN`] later and twice as far
//!   (up to [`STEP_MAX`]), and the wait is back to `probe_every`. A raised limit is so found again
//!   in a few probes (5%, 10%, 20%, 40% above the old ceiling...). A clean probe at the configured
//!   rate forgets the ceiling: the configured rate applies again.
//! * A probe with too little demand to reach past the ceiling tells nothing: the next one comes
//!   after the same wait, as far.

use crate::clock::{Nanos, NS_PER_MS, NS_PER_SEC};
use crate::config::{Aimd, Probing};

use super::adaptive::aimd_recover;

/// How long a probe lasts: long enough that an upstream which takes less than the target answers
/// 429 within it (unless its own burst hides a small excess), short enough to cost few 429s.
pub const PROBE_LEN: Nanos = 3 * NS_PER_SEC;
/// The first part of a probe is not counted towards its verdict: the fair shares of a contended
/// upstream follow a raised rate within a second (they are recomputed from demand reports), so
/// only the rest of the probe shows what the upstream takes at the target.
pub const RAMP: Nanos = NS_PER_SEC;
/// Answers that arrive this soon after a probe ended still belong to it: they were sent in it.
pub const GRACE: Nanos = 250 * NS_PER_MS;
/// After a clean probe, the next one comes this much later.
pub const AFTER_CLEAN: Nanos = NS_PER_SEC;
/// The wait between probes widens up to this many times `probe_every`.
pub const WIDEST: u64 = 3;
/// How far above the ceiling a probe goes at most, as a share of the ceiling (twice it).
pub const STEP_MAX: f64 = 1.0;
/// A 429 this soon after the one that moved the rate answers a call sent before it: it tells
/// nothing new, and moves nothing.
pub const EPISODE: Nanos = NS_PER_SEC;

/// What is known and planned about one upstream's capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// The multiplier outside a probe window.
    pub m: f64,
    /// Where 429s began, as a multiplier (1 while nothing is learned).
    pub ceiling: f64,
    /// The wait before the next probe after one that drew a 429 or told nothing.
    pub interval: Nanos,
    /// How far above the ceiling the next probe goes, as a share of it.
    pub step: f64,
    /// When the next (or current) probe starts; 0: none planned.
    pub at: Nanos,
    /// The multiplier during that probe.
    pub target: f64,
    /// When the last 429 that moved the rate arrived.
    pub cut_at: Nanos,
    /// Multiplier-seconds the upstream served during the current probe, past its [`RAMP`].
    pub units: f64,
}

impl Default for Probe {
    fn default() -> Self {
        Probe {
            m: 1.0,
            ceiling: 1.0,
            interval: 0,
            step: 0.0,
            at: 0,
            target: 1.0,
            cut_at: 0,
            units: 0.0,
        }
    }
}

/// The seconds in `ns`, as a float.
fn secs(ns: Nanos) -> f64 {
    ns as f64 / NS_PER_SEC as f64
}

impl Probe {
    /// A 429 taught a ceiling (perhaps the configured rate itself): the rate holds below it and a
    /// probe is planned above it.
    pub fn learned(&self) -> bool {
        self.at != 0
    }

    /// The multiplier the rate holds at below the ceiling.
    pub fn hold(&self, p: &Probing) -> f64 {
        (self.ceiling * p.hold).min(1.0)
    }

    /// Whether `now` falls inside the planned probe.
    pub fn probing(&self, now: Nanos) -> bool {
        self.at != 0 && self.at <= now && now < self.at.saturating_add(PROBE_LEN)
    }

    /// The multiplier in force at `now`: the probe's target inside a probe, else the held rate.
    pub fn multiplier(&self, now: Nanos) -> f64 {
        if self.probing(now) {
            self.target.max(self.m)
        } else {
            self.m
        }
    }

    /// The next instant at which [`Probe::multiplier`] changes with time alone (no answer needed):
    /// the start or the end of the planned probe; `Nanos::MAX` when none is planned.
    pub fn next_change(&self, now: Nanos) -> Nanos {
        if self.at == 0 {
            Nanos::MAX
        } else if now < self.at {
            self.at
        } else if now < self.at.saturating_add(PROBE_LEN) {
            self.at.saturating_add(PROBE_LEN)
        } else {
            Nanos::MAX
        }
    }

    /// Plans the next probe at `at`, `step` of the ceiling above it.
    fn plan(&mut self, at: Nanos) {
        self.at = at.max(1);
        self.target = (self.ceiling * (1.0 + self.step)).min(1.0);
        self.units = 0.0;
    }

    /// A 429 at `now`. `served` is what the upstream served over the last seconds, as a multiplier
    /// (`None` when too little was seen to tell). Returns whether anything moved.
    pub fn refused(&mut self, now: Nanos, served: Option<f64>, a: &Aimd, p: &Probing) -> bool {
        if self.cut_at != 0 && now < self.cut_at.saturating_add(EPISODE) {
            return false;
        }
        let in_force = self.multiplier(now);
        let in_probe =
            self.learned() && self.at <= now && now < self.at.saturating_add(PROBE_LEN + GRACE);
        let was_learned = self.learned();
        // A probe that draws a 429 says the limit lies between the ceiling and the target: the
        // ceiling stands. (What was served just before says nothing more: it is mostly the held
        // rate, below the ceiling. Should the upstream now take less than the hold, a 429 at the
        // hold teaches that.)
        if !in_probe {
            self.ceiling = served
                .map_or(in_force, |s| s.min(in_force))
                .clamp(a.floor.min(1.0), 1.0);
        }
        self.cut_at = now;
        // Only a probe that drew a 429 widens the wait. A 429 at the hold (the upstream takes
        // less than it did, or calls bunched) teaches a new ceiling and probes again after
        // `probe_every`, so a ceiling a bunch of calls pulled too low is soon found again.
        self.interval = if in_probe && was_learned && self.interval > 0 {
            self.interval.saturating_mul(2).min(p.every_ns() * WIDEST)
        } else {
            p.every_ns()
        };
        self.step = p.step;
        if a.factor >= 1.0 {
            // Cuts are switched off: the rate stays, and nothing is probed.
            self.at = 0;
            return false;
        }
        let hold = self.hold(p);
        self.m = (in_force * a.factor).min(hold).max(a.floor).min(1.0);
        self.plan(now.saturating_add(self.interval));
        true
    }

    /// A healthy answer at `now`, worth `units` of the configured rate times one second (its budget
    /// tokens over the configured rate per second): counted towards a running probe, a step back
    /// towards the hold, and the verdict on a probe that has ended. Returns whether anything moved.
    pub fn served(&mut self, now: Nanos, units: f64, a: &Aimd, p: &Probing) -> bool {
        let counted = self.count(now, units);
        let recovered = self.recover(a, p);
        let judged = self.conclude(now, p);
        counted || recovered || judged
    }

    /// Counts a healthy answer worth `units` towards the probe running at `now`.
    pub fn count(&mut self, now: Nanos, units: f64) -> bool {
        let inside = self.learned() && self.probing(now) && now >= self.at.saturating_add(RAMP);
        if inside {
            self.units += units.max(0.0);
        }
        inside
    }

    /// One healthy answer's step back towards the hold (`aimd_recover`), never past it.
    pub fn recover(&mut self, a: &Aimd, p: &Probing) -> bool {
        let hold = self.hold(p);
        let below = self.learned() && self.m < hold;
        if below {
            self.m = aimd_recover(self.m, a).min(hold);
        }
        below
    }

    /// Judges the planned probe once it has ended (and its grace passed) without a 429.
    pub fn conclude(&mut self, now: Nanos, p: &Probing) -> bool {
        let due = self.learned() && now >= self.at.saturating_add(PROBE_LEN + GRACE);
        if due {
            self.judge(now, p);
        }
        due
    }

    /// A probe that ended without a 429: clean when the upstream served at least halfway from the
    /// ceiling to the target, else it told nothing.
    fn judge(&mut self, now: Nanos, p: &Probing) {
        let used = self.units / secs(PROBE_LEN - RAMP);
        // Halfway from the ceiling to the target (from the hold, for a probe of the configured
        // rate itself): the upstream took clearly more than what was known to pass.
        let base = if self.target > self.ceiling {
            self.ceiling
        } else {
            self.hold(p)
        };
        if used >= base + (self.target - base) / 2.0 {
            let reached_full = self.target >= 1.0 - 1e-9;
            self.ceiling = used.min(self.target).max(self.ceiling);
            if reached_full {
                self.forget();
                return;
            }
            self.step = (self.step * 2.0).min(STEP_MAX);
            self.interval = p.every_ns();
            self.m = self.m.max(self.hold(p));
            self.plan(now.saturating_add(AFTER_CLEAN));
        } else {
            if self.interval == 0 {
                self.interval = p.every_ns();
            }
            if self.step <= 0.0 {
                self.step = p.step;
            }
            self.plan(now.saturating_add(self.interval));
        }
    }

    /// Forgets what was learned: the configured rate applies again and nothing is probed.
    pub fn forget(&mut self) {
        *self = Probe {
            cut_at: self.cut_at,
            ..Probe::default()
        };
    }

    /// A probe state holding at `m` (taken back from a state file): the ceiling is put where that
    /// hold would be, and the first probe comes `probe_every` after `now`.
    pub fn holding(m: f64, now: Nanos, p: &Probing) -> Probe {
        if m >= 1.0 {
            return Probe::default();
        }
        let mut probe = Probe {
            m,
            ceiling: (m / p.hold).min(1.0),
            interval: p.every_ns(),
            step: p.step,
            ..Probe::default()
        };
        probe.plan(now.saturating_add(p.every_ns()));
        probe
    }
}

/// The time constant of the shared store's served meter: a sum of what was served, decaying by
/// e every second.
pub const METER_TAU: Nanos = NS_PER_SEC;
/// The shared store's meter starts over (its start moves to the answer) after this many
/// [`METER_TAU`] without a healthy answer: what it held has decayed to nothing (e^-5 < 1%).
pub const METER_RESTART: f64 = 5.0;
/// The shared store's meter is trusted once it has run this long.
const METER_MIN_AGE: Nanos = 500 * NS_PER_MS;

/// Microseconds on the store's clock as nanoseconds.
fn ns(us: f64) -> Nanos {
    (us.max(0.0) as u64).saturating_mul(1000)
}

/// Nanoseconds as microseconds on the store's clock.
fn us(ns: Nanos) -> f64 {
    (ns / 1000) as f64
}

/// A probe schedule as the shared store keeps it (every instant in microseconds on the store's
/// clock), with the store's served meter and the version a write must find to apply.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredProbe {
    pub probe: Probe,
    /// The served meter: a decaying sum of multiplier-seconds, when it was last added to, and when
    /// it (re)started.
    pub meter: (f64, Nanos, Nanos),
    pub version: u64,
    /// What one answer adds to the meter: it is trusted once it holds [`METER_MIN_ANSWERS`] of
    /// them (0: any sum).
    pub unit: f64,
}

/// The least the shared store's meter must hold, in answers, before its rate is trusted.
const METER_MIN_ANSWERS: f64 = 5.0;

impl StoredProbe {
    /// Reads the fields the store returned (`field(name)`; see `PROBE_FIELDS` in the script).
    pub fn from_fields(field: impl Fn(&str) -> Option<f64>) -> StoredProbe {
        let d = Probe::default();
        let probe = Probe {
            m: field("m").filter(|m| *m > 0.0 && *m <= 1.0).unwrap_or(d.m),
            ceiling: field("c")
                .filter(|c| *c > 0.0 && *c <= 1.0)
                .unwrap_or(d.ceiling),
            interval: field("iv").map_or(d.interval, ns),
            step: field("sp").filter(|s| *s >= 0.0).unwrap_or(d.step),
            at: field("pa").map_or(d.at, ns),
            target: field("pt").filter(|t| *t > 0.0).unwrap_or(d.target),
            cut_at: field("ca").map_or(d.cut_at, ns),
            units: field("pu").filter(|u| *u >= 0.0).unwrap_or(d.units),
        };
        StoredProbe {
            probe,
            meter: (
                field("sv").unwrap_or(0.0).max(0.0),
                field("st").map_or(0, ns),
                field("s0").map_or(0, ns),
            ),
            version: field("v").map_or(0, |v| v.max(0.0) as u64),
            unit: 0.0,
        }
    }

    /// The schedule's fields to write back (the meter and the version are the store's).
    pub fn fields(&self) -> Vec<(&'static str, f64)> {
        let p = &self.probe;
        vec![
            ("m", p.m),
            ("c", p.ceiling),
            ("iv", us(p.interval)),
            ("sp", p.step),
            ("pa", us(p.at)),
            ("pt", p.target),
            ("ca", us(p.cut_at)),
            ("pu", p.units),
        ]
    }

    /// What the upstream served lately, as a multiplier: the meter's sum decayed to `now`, over
    /// what a constant rate since the meter started would have summed to; `None` while it has run
    /// too briefly or seen too few answers to tell.
    pub fn served(&self, now: Nanos) -> Option<f64> {
        let (sum, last, started) = self.meter;
        let age = now.saturating_sub(started);
        if started == 0 || age < METER_MIN_AGE {
            return None;
        }
        let tau = secs(METER_TAU);
        let decayed = sum * (-secs(now.saturating_sub(last)) / tau).exp();
        if decayed < METER_MIN_ANSWERS * self.unit {
            return None;
        }
        let full = tau * (1.0 - (-secs(age) / tau).exp());
        Some(decayed / full)
    }

    /// An answer the store counted (a 429 when `limited`): the changes admitd makes to the
    /// schedule, as in memory ([`Probe::refused`], [`Probe::conclude`]). Returns whether the
    /// schedule moved and must be written back.
    pub fn answered(&mut self, now: Nanos, limited: bool, a: &Aimd, p: &Probing) -> bool {
        if limited {
            let served = self.served(now);
            self.probe.refused(now, served, a, p)
        } else {
            self.probe.conclude(now, p)
        }
    }
}

#[cfg(test)]
#[path = "probe_tests.rs"]
mod tests;
