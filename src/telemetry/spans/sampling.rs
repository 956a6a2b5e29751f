//! Trace context for admitd's spans: the caller's W3C `traceparent`, the sampling decision that says
//! which calls get spans, and the ids of new traces and spans.
//!
//! Sampling is parent-based, as OpenTelemetry's default `parentbased_traceidratio` sampler: a call
//! whose caller sent a `traceparent` gets spans exactly when the caller's trace is sampled, and other
//! calls by `[telemetry.otlp] sample_ratio` of their trace id. It lives apart from the span actor
//! because it is pure: a function of the header and the id, tested without an actor or a clock.

use std::time::{SystemTime, UNIX_EPOCH};

/// The caller's span, from a W3C `traceparent` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

/// Parses a `traceparent` header (W3C Trace Context level 1): `00-<32 hex>-<16 hex>-<2 hex>`, lower
/// case, with non-zero ids. Versions above 00 are read by the 00 layout, as the recommendation asks;
/// version `ff` and anything malformed is no parent at all (the call starts a new trace).
pub fn parse_traceparent(header: &str) -> Option<Parent> {
    let b = header.trim().as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let version = hex(&b[0..2])?;
    match version {
        0xff => return None,
        0 if b.len() != 55 => return None,
        _ if b.len() > 55 && b[55] != b'-' => return None,
        _ => {}
    }
    let trace_id = hex(&b[3..35])?;
    let span_id = hex(&b[36..52])? as u64;
    let flags = hex(&b[53..55])?;
    if trace_id == 0 || span_id == 0 {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// Lower-case hex digits (at most 32) as a number.
fn hex(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |n, &c| {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        Some(n << 4 | u128::from(d))
    })
}

/// Which calls get a span: the parent's decision when there is a parent, else a share of trace ids
/// (OpenTelemetry's `TraceIdRatioBased` rule on the low 64 bits of the trace id).
#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    /// Root traces whose low 64 trace-id bits, shifted right by one, are below this are sampled
    /// (2^63 at ratio 1: every trace).
    bound: u64,
}

impl Sampler {
    pub fn new(ratio: f64) -> Self {
        let ratio = if ratio.is_finite() {
            ratio.clamp(0.0, 1.0)
        } else {
            0.0
        };
        Sampler {
            bound: (ratio * (1u64 << 63) as f64) as u64,
        }
    }

    pub fn sampled(&self, parent: Option<Parent>, trace_id: u128) -> bool {
        match parent {
            Some(p) => p.sampled,
            None => ((trace_id as u64) >> 1) < self.bound,
        }
    }
}

/// Span and trace ids: splitmix64, seeded per process. Ids need to be unique, not secret.
pub(super) struct Ids(u64);

impl Ids {
    pub(super) fn seeded() -> Self {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Ids(t ^ u64::from(std::process::id()).rotate_left(32))
    }

    /// A new trace id.
    pub(super) fn trace_id(&mut self) -> u128 {
        u128::from(self.next()) << 64 | u128::from(self.next())
    }

    pub(super) fn next(&mut self) -> u64 {
        loop {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z != 0 {
                return z;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn traceparents_follow_the_w3c_layout() {
        let p = parse_traceparent(TP).unwrap();
        assert_eq!(p.trace_id, 0x0af7651916cd43dd8448eb211c80319c);
        assert_eq!(p.span_id, 0xb7ad6b7169203331);
        assert!(p.sampled);
        let unsampled = parse_traceparent(&TP.replace("-01", "-00")).unwrap();
        assert!(!unsampled.sampled);
        // A later version may append fields after a dash; version 00 may not.
        assert!(parse_traceparent(&format!("01{}-later", &TP[2..])).is_some());
        for bad in [
            "",
            "garbage",
            &format!("{TP}-later"),
            &TP.to_uppercase(),
            &format!("ff{}", &TP[2..]),
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
            "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn sampling_follows_the_parent_or_the_ratio_of_trace_ids() {
        let parent = |sampled| {
            Some(Parent {
                trace_id: 1,
                span_id: 1,
                sampled,
            })
        };
        assert!(Sampler::new(0.0).sampled(parent(true), 1));
        assert!(!Sampler::new(1.0).sampled(parent(false), 1));
        let mut ids = Ids(42);
        let roots: Vec<u128> = (0..20_000).map(|_| ids.trace_id()).collect();
        let share = |ratio| {
            let s = Sampler::new(ratio);
            roots.iter().filter(|&&t| s.sampled(None, t)).count() as f64 / roots.len() as f64
        };
        assert_eq!(share(1.0), 1.0);
        assert_eq!(share(0.0), 0.0);
        let quarter = share(0.25);
        assert!((0.23..0.27).contains(&quarter), "{quarter}");
    }
}
