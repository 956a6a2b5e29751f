//! Parsers for the human-written values in the config file: rates (`120/min`) and durations (`250ms`).
//!
//! They are strict on purpose: a typo such as `5/mins` must stop the daemon with a message that says what
//! is accepted, never be read as something else or silently ignored.

use std::time::Duration;

/// A refill rate, in tokens per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_sec: f64,
}

impl Rate {
    pub fn per_sec(per_sec: f64) -> Rate {
        Rate { per_sec }
    }
}

/// Parses `N/unit` with unit one of `s`, `min`, `h`, `day`; N a positive decimal number.
pub fn parse_rate(text: &str) -> Result<Rate, String> {
    let hint = "write a rate as N/unit with unit one of s, min, h, day (for example \"120/min\")";
    let Some((num, unit)) = text.trim().split_once('/') else {
        return Err(format!("invalid rate {text:?}: {hint}"));
    };
    let n: f64 = parse_positive(num.trim()).ok_or_else(|| {
        format!("invalid rate {text:?}: the count must be a positive decimal number (digits and an optional point); {hint}")
    })?;
    let secs = match unit.trim() {
        "s" => 1.0,
        "min" => 60.0,
        "h" => 3600.0,
        "day" => 86_400.0,
        other => {
            return Err(format!(
                "invalid rate {text:?}: unknown unit {other:?}; {hint}"
            ))
        }
    };
    let per_sec = n / secs;
    if !(per_sec.is_finite() && per_sec > 0.0) {
        return Err(format!("invalid rate {text:?}: {hint}"));
    }
    if per_sec > 1e15 {
        return Err(format!(
            "invalid rate {text:?}: more than 1e15 per second is not a limit"
        ));
    }
    Ok(Rate { per_sec })
}

/// Parses `250ms`, `2s`, `5m`, `1h` or `1d` (decimal numbers allowed: `1.5s`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let hint = "write a duration as a number and a unit: ms, s, m, h or d (for example \"250ms\", \"2s\", \"5m\")";
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("invalid duration {text:?}: {hint}"));
    }
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {text:?}: {hint}"))?;
    let ms = match unit {
        "ms" => 1.0,
        "s" => 1_000.0,
        "m" => 60_000.0,
        "h" => 3_600_000.0,
        "d" => 86_400_000.0,
        "" => {
            return Err(format!(
                "invalid duration {text:?}: the unit is missing; {hint}"
            ))
        }
        other => {
            return Err(format!(
                "invalid duration {text:?}: unknown unit {other:?}; {hint}"
            ))
        }
    };
    let total_ms = n * ms;
    if !total_ms.is_finite() || !(0.0..=1e13).contains(&total_ms) {
        return Err(format!("invalid duration {text:?}: out of range"));
    }
    Ok(Duration::from_micros((total_ms * 1_000.0).round() as u64))
}

fn parse_positive(s: &str) -> Option<f64> {
    if s.is_empty() || !s.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return None;
    }
    let v: f64 = s.parse().ok()?;
    (v.is_finite() && v > 0.0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_rates_are_refused_with_a_reason() {
        let e = parse_rate("99999999999999999999/s").unwrap_err();
        assert!(e.contains("more than 1e15"), "{e}");
        assert!(parse_rate("1000000000000000/s").is_ok());
        let e = parse_rate("1e15/s").unwrap_err();
        assert!(e.contains("decimal number"), "{e}");
    }

    #[test]
    fn rates_in_every_unit() {
        assert_eq!(parse_rate("120/min").unwrap().per_sec, 2.0);
        assert_eq!(parse_rate("5000/s").unwrap().per_sec, 5000.0);
        assert_eq!(parse_rate("3600/h").unwrap().per_sec, 1.0);
        assert_eq!(parse_rate("86400/day").unwrap().per_sec, 1.0);
        assert_eq!(parse_rate(" 0.5 / s ").unwrap().per_sec, 0.5);
    }

    #[test]
    fn bad_rates_are_errors_that_say_what_is_accepted() {
        for bad in [
            "5/mins", "5", "/s", "-1/s", "0/s", "x/s", "5/", "1e3/s", "5/S", "inf/s",
        ] {
            let err = parse_rate(bad).unwrap_err();
            assert!(err.contains("N/unit"), "{bad}: {err}");
        }
        assert!(parse_rate("5/mins").unwrap_err().contains("\"mins\""));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86400));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        for bad in ["2", "s", "2 secs", "-1s", "2sec", "", "1e9d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
