//! The poll schedule of MCP tasks: how often each of a tenant's tasks may be polled (`tasks/get`),
//! as plain arithmetic on `now`.
//!
//! `pollIntervalMs` is a rate control lever: it is the server telling the client when to come back.
//! The interval handed out is never below `[tasks] poll_interval`, at least (tasks in flight) ÷
//! `poll_rate` so that all of a tenant's tasks together poll at most `poll_rate` times a second,
//! and never above `max_poll_interval`. On top of that the tenant's polls are laid out one every
//! 1 ÷ `poll_rate` along a cursor (the next free place), so that tasks started together are told
//! different times and do not come back in lockstep: ten tasks started at once at `2/s` are due at
//! 5, 5.5, ... 9.5 seconds, and from then on each about every 5 seconds, half a second apart.
//!
//! The same arithmetic runs in the shared store's script for Redis mode (`schedule_poll` in
//! `store/admitd.lua`); `tests/store_scenarios.rs` holds both stores to the same answers.

use crate::clock::{Nanos, NS_PER_MS};
use crate::config::TasksConfig;

/// How early a poll may come and still count as on time: clients' timers and the two clocks
/// involved (the client's sleep, the daemon's monotonic clock) are not exact to the millisecond.
pub const POLL_GRACE_NS: u64 = 50 * NS_PER_MS;

/// `[tasks]` as the schedule reads it, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollPolicy {
    /// The shortest interval.
    pub min_ns: u64,
    /// The tenant's polls are at least this far apart on the cursor (1 ÷ `poll_rate`).
    pub spacing_ns: u64,
    /// The longest interval.
    pub max_ns: u64,
}

impl PollPolicy {
    pub fn new(cfg: &TasksConfig) -> Self {
        let min_ns = cfg.poll_interval.as_nanos().min(u128::from(u64::MAX)) as u64;
        let max_ns =
            (cfg.max_poll_interval.as_nanos().min(u128::from(u64::MAX)) as u64).max(min_ns);
        // A rate is positive and at most 1e15/s (the config's rule): at least one nanosecond apart.
        let spacing_ns = ((1e9 / cfg.poll_rate).ceil() as u64).clamp(1, max_ns.max(1));
        PollPolicy {
            min_ns,
            spacing_ns,
            max_ns,
        }
    }

    /// The interval that keeps `in_flight` tasks to `poll_rate` in all, within the bounds.
    pub fn base_ns(&self, in_flight: u64) -> u64 {
        self.spacing_ns
            .saturating_mul(in_flight)
            .clamp(self.min_ns, self.max_ns)
    }

    /// When a task with `in_flight` tasks of its tenant in flight (itself included) is next due,
    /// told at `now`, with the tenant's cursor moved past it. Whole milliseconds after `now` (the
    /// client is told milliseconds, so the daemon holds it to exactly what it told).
    pub fn schedule(&self, cursor: &mut Nanos, in_flight: u64, now: Nanos) -> Nanos {
        let earliest = now.saturating_add(self.base_ns(in_flight));
        let latest = now.saturating_add(self.max_ns);
        let at = earliest.max(*cursor).min(latest);
        let interval_ms = (at - now).div_ceil(NS_PER_MS);
        let due = now.saturating_add(interval_ms.saturating_mul(NS_PER_MS));
        *cursor = due.saturating_add(self.spacing_ns);
        due
    }
}

/// The interval, in whole milliseconds, from `now` to `due` (as [`PollPolicy::schedule`] made it).
pub fn interval_ms(due: Nanos, now: Nanos) -> u64 {
    due.saturating_sub(now).div_ceil(NS_PER_MS)
}

/// Whether a poll at `now` comes no earlier than told (`Ok`), or how long until it is due.
pub fn check(due: Nanos, now: Nanos) -> Result<(), u64> {
    if now.saturating_add(POLL_GRACE_NS) >= due {
        Ok(())
    } else {
        Err(due - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::NS_PER_SEC;
    use std::time::Duration;

    const SEC: u64 = NS_PER_SEC;
    const MS: u64 = NS_PER_MS;

    fn policy(min_ms: u64, rate: f64, max_ms: u64) -> PollPolicy {
        PollPolicy::new(&TasksConfig {
            poll_interval: Duration::from_millis(min_ms),
            poll_rate: rate,
            max_poll_interval: Duration::from_millis(max_ms),
            lease_ttl: Duration::from_secs(3600),
        })
    }

    #[test]
    fn the_interval_is_tasks_over_rate_within_its_bounds() {
        let p = policy(2_000, 2.0, 60_000);
        assert_eq!(p.spacing_ns, SEC / 2);
        assert_eq!(p.base_ns(1), 2 * SEC, "never below poll_interval");
        assert_eq!(p.base_ns(4), 2 * SEC);
        assert_eq!(p.base_ns(10), 5 * SEC, "ten tasks at 2/s: 5 s each");
        assert_eq!(p.base_ns(1_000), 60 * SEC, "capped at max_poll_interval");
        assert_eq!(p.base_ns(u64::MAX), 60 * SEC, "no overflow");
    }

    #[test]
    fn tasks_started_together_are_staggered_one_spacing_apart() {
        let p = policy(2_000, 2.0, 60_000);
        let mut cursor = 0;
        let now = 100 * SEC;
        // Ten tasks already in flight, ten polls told at the same instant.
        let dues: Vec<u64> = (0..10).map(|_| p.schedule(&mut cursor, 10, now)).collect();
        let want: Vec<u64> = (0..10).map(|i| now + 5 * SEC + i * SEC / 2).collect();
        assert_eq!(dues, want);
        // Each then polls when due: every answer is about 5 s again, still half a second apart.
        let next: Vec<u64> = dues
            .iter()
            .map(|&d| p.schedule(&mut cursor, 10, d))
            .collect();
        for (d, n) in dues.iter().zip(&next) {
            assert_eq!(n - d, 5 * SEC);
        }
    }

    #[test]
    fn the_interval_grows_with_load_and_shrinks_back() {
        let p = policy(2_000, 2.0, 60_000);
        let mut cursor = 0;
        assert_eq!(p.schedule(&mut cursor, 1, 0), 2 * SEC);
        // Much later, forty tasks in flight: 20 s.
        assert_eq!(p.schedule(&mut cursor, 40, 1_000 * SEC), 1_020 * SEC);
        // And once they are done, a lone task is back at the floor (the cursor is in the past).
        assert_eq!(p.schedule(&mut cursor, 1, 2_000 * SEC), 2_002 * SEC);
    }

    #[test]
    fn the_cap_holds_even_when_the_cursor_runs_ahead() {
        let p = policy(1_000, 1.0, 10_000);
        let mut cursor = 0;
        for _ in 0..100 {
            let due = p.schedule(&mut cursor, 100, 0);
            assert!(due <= 10 * SEC, "{due}");
            assert!(due >= SEC);
        }
        assert!(cursor <= 11 * SEC, "the cursor stays within one cap of now");
    }

    #[test]
    fn dues_are_whole_milliseconds_from_now() {
        let p = policy(100, 3.0, 1_000);
        let mut cursor = 0;
        let now = 7 * SEC + 123_456;
        for _ in 0..5 {
            let due = p.schedule(&mut cursor, 1, now);
            assert_eq!((due - now) % MS, 0);
            assert!(interval_ms(due, now) >= 100);
        }
    }

    #[test]
    fn a_poll_early_by_more_than_the_grace_is_told_the_time_left() {
        let due = 10 * SEC;
        assert_eq!(check(due, 4 * SEC), Err(6 * SEC));
        assert_eq!(check(due, due - POLL_GRACE_NS - 1), Err(POLL_GRACE_NS + 1));
        assert_eq!(check(due, due - POLL_GRACE_NS), Ok(()));
        assert_eq!(check(due, due), Ok(()));
        assert_eq!(check(due, due + 60 * SEC), Ok(()));
    }
}
