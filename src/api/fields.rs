//! Request fields that several routes read alike: names, HTTP status codes, `Retry-After` values
//! and percent-encoded path segments. One rule each, so every route refuses the same input the
//! same way.

use std::time::Duration;

use serde::Deserialize;

use super::error::ApiError;
use super::retry_after::{parse_retry_after, MAX_PENALTY};
use crate::names::check_name;

/// Checks a name field of a request.
pub fn name_field(field: &str, value: &str) -> Result<(), ApiError> {
    check_name(value).map_err(|e| {
        ApiError::invalid(format!(
            "{field} {e} (names are 1 to 128 bytes of UTF-8 without control characters)"
        ))
    })
}

/// `retry_after` as sent: a string (delay-seconds or HTTP-date) or, leniently, a bare number of seconds.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum RetryAfterValue {
    Text(String),
    Seconds(f64),
}

impl RetryAfterValue {
    pub fn parse(&self, wall_ms: i64) -> Result<(Duration, String), ApiError> {
        match self {
            RetryAfterValue::Text(s) => parse_retry_after(s, wall_ms)
                .map(|d| (d, s.clone()))
                .map_err(ApiError::invalid),
            RetryAfterValue::Seconds(x) if x.is_finite() && *x >= 0.0 => {
                let d = Duration::from_secs_f64(x.min(MAX_PENALTY.as_secs_f64()));
                Ok((d, format!("{x}")))
            }
            RetryAfterValue::Seconds(x) => Err(ApiError::invalid(format!(
                "retry_after {x} must not be negative"
            ))),
        }
    }
}

/// An HTTP status code from a JSON number: `429` and `429.0` are the same number in JSON.
pub fn status_field(field: &str, status: f64) -> Result<u16, ApiError> {
    if (100.0..=599.0).contains(&status) && status.fract() == 0.0 {
        Ok(status as u16)
    } else {
        Err(ApiError::invalid(format!(
            "{field} {status} is not an HTTP status code (100 to 599)"
        )))
    }
}

/// Decodes a percent-encoded path segment; `None` when it is not valid UTF-8 once decoded.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("acme").as_deref(), Some("acme"));
        assert_eq!(percent_decode("a%20b").as_deref(), Some("a b"));
        assert_eq!(percent_decode("%C3%BC").as_deref(), Some("ü"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%C3"), None);
        assert_eq!(percent_decode("%"), None);
    }

    #[test]
    fn status_codes_are_checked() {
        assert_eq!(status_field("s", 429.0).unwrap(), 429);
        assert!(status_field("s", 600.0).is_err());
        assert!(status_field("s", -1.0).is_err());
        // A fraction is no status code; NaN and infinities never reach here (JSON has none).
        assert!(status_field("s", 429.5).is_err());
    }
}
