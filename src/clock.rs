//! Time sources for the engine.
//!
//! Rates are computed on a monotonic clock (nanoseconds since the clock was made) so that a wall-clock
//! step (NTP, a VM resume) can neither mint tokens nor freeze a bucket. The wall clock is used only where
//! the calendar matters: UTC days for daily quotas and HTTP-dates in upstream `Retry-After` values.
//!
//! Every time-based rule in the engine takes `now` from a [`Clock`], so tests drive a [`FakeClock`] and run
//! instantly and deterministically.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Monotonic time in nanoseconds since the clock's origin.
pub type Nanos = u64;

/// Nanoseconds in one second and one millisecond.
pub const NS_PER_SEC: u64 = 1_000_000_000;
pub const NS_PER_MS: u64 = 1_000_000;

/// A source of monotonic and wall-clock time.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic nanoseconds since this clock's origin; never goes backwards.
    fn mono(&self) -> Nanos;
    /// Milliseconds since the Unix epoch (UTC), for calendar rules only.
    fn wall_ms(&self) -> i64;
}

/// Where the system clock's monotonic reading starts: a day in, not at 0, so that state from
/// before the process started (a state file's adaptive-throttle windows and last 429s, up to an
/// hour old) can be placed in the past of this clock instead of being clamped to its start.
pub const MONO_START: Nanos = 86_400 * NS_PER_SEC;

/// The real clocks of the process.
#[derive(Debug, Clone)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn mono(&self) -> Nanos {
        // An u64 of nanoseconds lasts 584 years of uptime.
        self.origin.elapsed().as_nanos() as u64 + MONO_START
    }
    fn wall_ms(&self) -> i64 {
        coarse_wall_ms()
    }
}

/// The wall clock at the kernel tick's resolution (1-10 ms), which is all a calendar rule needs.
///
/// The tenant actor reads the wall clock on every decision. Linux keeps a copy of it that is updated
/// once a tick (`CLOCK_REALTIME_COARSE`): reading that copy takes about 3 ns, against about 20 ns for
/// the precise clock, which reads the CPU's time-stamp counter and scales it. A UTC day, an HTTP-date
/// and an alert's start time do not need the difference.
///
/// What it assumes: its callers need the calendar to a tick at best, and nothing rate-related reads
/// it (rates use the monotonic clock). What it bought, with the API's single monotonic reading per
/// request: clock reads fell from 1.65% to 0.83% of admitd's CPU samples
/// (`scripts/profile.sh spread --tenants 1000 --subjects 100`; docs/BENCHMARKS.md). Off Linux the
/// precise clock answers.
#[cfg(target_os = "linux")]
fn coarse_wall_ms() -> i64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec, and CLOCK_REALTIME_COARSE exists on every Linux
    // since 2.6.32. Should the call fail all the same, the precise clock answers instead.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &raw mut t) } == 0 {
        // `time_t` and `c_long` are 32 bits wide on some Linux targets.
        #[allow(clippy::unnecessary_cast)]
        return t.tv_sec as i64 * 1000 + t.tv_nsec as i64 / 1_000_000;
    }
    precise_wall_ms()
}

#[cfg(not(target_os = "linux"))]
fn coarse_wall_ms() -> i64 {
    precise_wall_ms()
}

fn precise_wall_ms() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// A clock that only moves when told to. Cheap to clone; clones share the same time.
#[derive(Debug, Clone)]
pub struct FakeClock {
    mono: Arc<AtomicU64>,
    wall_ms: Arc<AtomicI64>,
}

impl FakeClock {
    /// A fake clock whose monotonic time starts at 0 and whose wall clock starts at `wall_ms`.
    pub fn new(wall_ms: i64) -> Self {
        FakeClock {
            mono: Arc::new(AtomicU64::new(0)),
            wall_ms: Arc::new(AtomicI64::new(wall_ms)),
        }
    }

    /// Moves both clocks forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.mono.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
        self.wall_ms
            .fetch_add(d.as_millis() as i64, Ordering::SeqCst);
    }

    /// Moves both clocks forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance(Duration::from_millis(ms));
    }
}

impl Clock for FakeClock {
    fn mono(&self) -> Nanos {
        self.mono.load(Ordering::SeqCst)
    }
    fn wall_ms(&self) -> i64 {
        self.wall_ms.load(Ordering::SeqCst)
    }
}

/// Rounds nanoseconds up to whole milliseconds.
pub fn ceil_ms(ns: u64) -> u64 {
    ns.div_ceil(NS_PER_MS)
}

/// Rounds nanoseconds up to whole seconds.
pub fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(NS_PER_SEC)
}

/// Milliseconds from `wall_ms` until the next midnight UTC.
pub fn ms_until_utc_midnight(wall_ms: i64) -> u64 {
    const DAY_MS: i64 = 86_400_000;
    let into_day = wall_ms.rem_euclid(DAY_MS);
    (DAY_MS - into_day) as u64
}

/// The UTC day number (days since 1970-01-01) of a wall-clock time.
pub fn utc_day(wall_ms: i64) -> i64 {
    wall_ms.div_euclid(86_400_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_clock_moves_only_when_told() {
        let c = FakeClock::new(1_000);
        assert_eq!(c.mono(), 0);
        c.advance_ms(1500);
        assert_eq!(c.mono(), 1_500 * NS_PER_MS);
        assert_eq!(c.wall_ms(), 2_500);
        let c2 = c.clone();
        c2.advance(Duration::from_nanos(7));
        assert_eq!(c.mono(), 1_500 * NS_PER_MS + 7);
    }

    #[test]
    fn rounding_helpers_round_up() {
        assert_eq!(ceil_ms(1), 1);
        assert_eq!(ceil_ms(NS_PER_MS), 1);
        assert_eq!(ceil_ms(NS_PER_MS + 1), 2);
        assert_eq!(ceil_secs(0), 0);
        assert_eq!(ceil_secs(NS_PER_SEC + 1), 2);
    }

    #[test]
    fn utc_midnight_and_day_numbers() {
        // 2026-10-21T23:59:59.000Z
        let t = 1_792_627_199_000;
        assert_eq!(ms_until_utc_midnight(t), 1_000);
        assert_eq!(utc_day(t) + 1, utc_day(t + 1_000));
        assert_eq!(ms_until_utc_midnight(t + 1_000), 86_400_000);
        assert_eq!(utc_day(-1), -1);
    }

    #[test]
    fn system_clock_is_monotonic() {
        let c = SystemClock::new();
        let a = c.mono();
        let b = c.mono();
        assert!(b >= a);
        assert!(c.wall_ms() > 1_700_000_000_000);
    }

    /// The wall clock a decision reads is the coarse one: within a few kernel ticks of the precise
    /// clock, never running ahead of it by more than rounding, and never behind it by more than
    /// the tick (10 ms at the slowest kernel setting; 50 ms allows for a busy machine between the
    /// two readings).
    #[test]
    fn the_coarse_wall_clock_stays_within_a_tick_of_the_precise_one() {
        let c = SystemClock::new();
        for _ in 0..100 {
            let before = precise_wall_ms();
            let coarse = c.wall_ms();
            let after = precise_wall_ms();
            assert!(coarse <= after, "coarse {coarse} is ahead of {after}");
            assert!(
                before - coarse < 50,
                "coarse {coarse} lags {before} by too much"
            );
        }
    }
}
