//! Parsing of an upstream's `Retry-After` value (RFC 9110 §10.2.3).
//!
//! It is either delay-seconds (a non-negative integer) or an HTTP-date (the IMF-fixdate form, or the two
//! obsolete forms RFC 9110 still requires recipients to accept). A date is turned into a delay against
//! the wall clock at the time it is reported. The engine only ever sees the resulting delay, which it
//! keeps on the monotonic clock: header syntax and wall-clock dates stop at the API.

use std::time::{Duration, UNIX_EPOCH};

/// The longest penalty admitted from one upstream answer; a bigger value is clamped, not trusted.
pub const MAX_PENALTY: Duration = Duration::from_secs(24 * 3600);

/// Parses `value` into a delay from `wall_ms`. Dates in the past give a zero delay.
pub fn parse_retry_after(value: &str, wall_ms: i64) -> Result<Duration, String> {
    let v = value.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        let secs: u64 = v.parse().unwrap_or(u64::MAX);
        return Ok(Duration::from_secs(secs).min(MAX_PENALTY));
    }
    match httpdate::parse_http_date(v) {
        Ok(at) => {
            let at_ms = at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            let delay_ms = at_ms.saturating_sub(wall_ms).max(0) as u64;
            Ok(Duration::from_millis(delay_ms).min(MAX_PENALTY))
        }
        Err(_) => Err(format!(
            "retry_after {value:?} is neither delay-seconds (\"30\") nor an HTTP-date (\"Wed, 21 Oct 2026 07:28:00 GMT\")"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-10-21T07:27:30Z
    const NOW: i64 = 1_792_567_650_000;

    #[test]
    fn delay_seconds() {
        assert_eq!(
            parse_retry_after("30", NOW).unwrap(),
            Duration::from_secs(30)
        );
        assert_eq!(parse_retry_after(" 0 ", NOW).unwrap(), Duration::ZERO);
        assert_eq!(
            parse_retry_after("99999999999999999999999", NOW).unwrap(),
            MAX_PENALTY
        );
    }

    #[test]
    fn http_dates_in_all_three_forms() {
        for v in [
            "Wed, 21 Oct 2026 07:28:00 GMT",
            "Wednesday, 21-Oct-26 07:28:00 GMT",
            "Wed Oct 21 07:28:00 2026",
        ] {
            assert_eq!(
                parse_retry_after(v, NOW).unwrap(),
                Duration::from_secs(30),
                "{v}"
            );
        }
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2026 07:00:00 GMT", NOW).unwrap(),
            Duration::ZERO
        );
        // A date years away is a day at most, as a delay is.
        assert_eq!(
            parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", NOW).unwrap(),
            MAX_PENALTY
        );
    }

    #[test]
    fn a_date_is_measured_from_the_wall_clock_to_the_millisecond() {
        // 250 ms past a whole second, a date 45 s after that second is 44.75 s away.
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2026 07:28:15 GMT", NOW + 250).unwrap(),
            Duration::from_millis(44_750)
        );
    }

    #[test]
    fn garbage_is_an_error() {
        for v in ["soon", "-5", "1.5", "", "Wed, 32 Oct 2026 07:28:00 GMT"] {
            assert!(parse_retry_after(v, NOW).is_err(), "{v}");
        }
    }
}
