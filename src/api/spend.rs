//! The spend fields of the API: `run` and `spend` on `POST /v1/admit`, `spent` and `cost` on
//! `POST /v1/release`, their validation against the configured units, and how an answer reports
//! spend (`spend` on an admission, `unit`/`budget`/`remaining` on a refusal).
//!
//! Kept apart from the routes that read them so that the admission's hand-written answer stays
//! one small function, and so that a release's spend is checked in full before its lease is
//! touched: a bad figure is a 400 that changes nothing, and the lease can still be released.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use compact_str::CompactString;
use serde::{Serialize, Serializer};

use super::{name_field, ApiError};
use crate::config::Config;
use crate::engine::spend::{SpendBudget, SpendView};
use crate::engine::{CallSpend, Settlement};

/// The largest figure a call may report (as every figure in the config).
const MAX_FIGURE: f64 = 1e15;

fn figure(field: &str, unit: &str, x: f64) -> Result<f64, ApiError> {
    if x.is_finite() && (0.0..=MAX_FIGURE).contains(&x) {
        Ok(x)
    } else {
        Err(ApiError::invalid(format!(
            "{field}.{unit} {x} must be a number from 0 to 1e15"
        )))
    }
}

fn unit_known(cfg: &Config, field: &str, unit: &str) -> Result<(), ApiError> {
    if cfg.spend.unit(unit).is_some() {
        return Ok(());
    }
    let known: Vec<&str> = cfg.spend.units.iter().map(|u| u.name.as_str()).collect();
    let known = if known.is_empty() {
        "no spend units are configured".to_string()
    } else {
        format!("configured units: {}", known.join(", "))
    };
    // The unit is the caller's string: quoted through Debug, so control characters are escaped.
    let shown: String = unit.chars().take(64).collect();
    Err(ApiError::invalid(format!(
        "{field} names the unit {shown:?}, which is not configured ({known})"
    )))
}

/// An admission's `run` and `spend`, checked: `None` when no spend unit is configured and the call
/// names no estimate (a `run` alone is then nothing to keep).
pub(super) fn call_spend(
    cfg: &Config,
    run: Option<&str>,
    spend: Option<&BTreeMap<String, f64>>,
) -> Result<Option<Arc<CallSpend>>, ApiError> {
    if let Some(r) = run {
        name_field("run", r)?;
    }
    let mut out = CallSpend::default();
    for (unit, x) in spend.into_iter().flatten() {
        unit_known(cfg, "spend", unit)?;
        out.estimates.push((
            CompactString::from(unit.as_str()),
            figure("spend", unit, *x)?,
        ));
    }
    if cfg.spend.is_empty() {
        return Ok(None);
    }
    out.run = run.map(CompactString::from);
    Ok((out.run.is_some() || !out.estimates.is_empty()).then(|| Arc::new(out)))
}

/// A release's `spent` and `cost`, checked.
pub(super) fn settlement(
    cfg: &Config,
    spent: Option<&BTreeMap<String, f64>>,
    cost: Option<f64>,
) -> Result<Settlement, ApiError> {
    let mut out = Settlement::default();
    for (unit, x) in spent.into_iter().flatten() {
        unit_known(cfg, "spent", unit)?;
        out.spent.push((
            CompactString::from(unit.as_str()),
            figure("spent", unit, *x)?,
        ));
    }
    if let Some(c) = cost {
        if !(c.is_finite() && (0.0..=MAX_FIGURE).contains(&c)) {
            return Err(ApiError::invalid(format!(
                "cost {c} must be a number from 0 to 1e15"
            )));
        }
        out.cost = Some(c);
    }
    Ok(out)
}

/// A figure without the float noise of sums (0.9299999999999999 is 0.93).
pub(super) fn clean(x: f64) -> f64 {
    let y = x * 1e9;
    // `f64::round` is a libm call. Below 2^52 the same figure is the integer part, one further
    // from zero from .5 on (both exact); from 2^52 on every figure is whole. Only a zero's sign
    // can differ, and it is dropped below.
    let r = if y.abs() < 4_503_599_627_370_496.0 {
        let t = (y as i64) as f64;
        if (y - t).abs() >= 0.5 {
            t + 1f64.copysign(y)
        } else {
            t
        }
    } else {
        y
    };
    let r = r / 1e9;
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

/// An admission's `spend`: `{"usd": {"reserved": 0.05, "remaining": 0.93, "budget": "run"}}`.
pub(super) struct SpendField<'a>(pub(super) &'a [SpendView]);

#[derive(Serialize)]
struct UnitField {
    reserved: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    budget: Option<&'static str>,
}

impl SpendField<'_> {
    /// Appends the field as JSON, byte for byte what its [`Serialize`] writes (the test
    /// `admitted_body_matches_serde` holds the two together), without serde's generic path: keys
    /// are written as they are (a unit's name is `[a-z][a-z0-9_]*`, checked again here) and numbers
    /// through `zmij`, the formatter serde_json itself uses; a name is checked when its entry is
    /// first written (those [`RESERVED`] keeps were). What it bought is in docs/BENCHMARKS.md
    /// ("Spend budgets").
    pub(super) fn write_into(&self, out: &mut Vec<u8>) {
        let plain = |n: &str| n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        let start = out.len();
        out.push(b'{');
        let written = RESERVED.with_borrow_mut(|cache| {
            for (i, v) in self.0.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                // A unit's `"NAME":{"reserved":FIGURE` is written once and then copied while
                // the estimate stays the same, which is the usual case: a tool's estimate.
                let bits = v.reserved.to_bits();
                match cache.get(i) {
                    Some((unit, b, bytes))
                        if *b == bits && (Arc::ptr_eq(unit, &v.unit) || **unit == *v.unit) =>
                    {
                        out.extend_from_slice(bytes)
                    }
                    _ => {
                        if !plain(&v.unit) {
                            return false;
                        }
                        let mut bytes = Vec::with_capacity(v.unit.len() + 40);
                        bytes.push(b'"');
                        bytes.extend_from_slice(v.unit.as_bytes());
                        bytes.extend_from_slice(b"\":{\"reserved\":");
                        number(&mut bytes, clean(v.reserved));
                        out.extend_from_slice(&bytes);
                        let entry = (v.unit.clone(), bits, bytes);
                        if i < cache.len() {
                            cache[i] = entry;
                        } else if i == cache.len() {
                            cache.push(entry);
                        }
                    }
                }
                match v.remaining {
                    Some((left, budget)) => {
                        out.extend_from_slice(b",\"remaining\":");
                        number(out, clean(left));
                        out.extend_from_slice(match budget {
                            SpendBudget::Run => b",\"budget\":\"run\"}",
                            SpendBudget::SubjectDaily => b",\"budget\":\"subject_daily\"}",
                            SpendBudget::TenantDaily => b",\"budget\":\"tenant_daily\"}",
                        });
                    }
                    None => out.push(b'}'),
                }
            }
            true
        });
        if !written {
            out.truncate(start);
            let _ = serde_json::to_writer(out, self);
            return;
        }
        out.push(b'}');
    }
}

thread_local! {
    /// Per unit (by position), the start of its entry in the last answer written on this thread.
    /// What it bought is in docs/BENCHMARKS.md ("Spend budgets").
    static RESERVED: RefCell<Vec<Reserved>> = const { RefCell::new(Vec::new()) };
}

/// A unit, the bits of its estimate, and its entry's bytes up to and with the estimate.
type Reserved = (Arc<str>, u64, Vec<u8>);

/// Appends a figure as serde_json writes it.
fn number(out: &mut Vec<u8>, x: f64) {
    // Whole when converting to an integer and back changes nothing (`fract` is a libm call).
    if x.abs() < 1e15 && (x as i64) as f64 == x && !(x == 0.0 && x.is_sign_negative()) {
        // A whole figure (tokens, rows; budgets) as serde_json writes it (`500.0`), by
        // integer formatting, which is cheaper than the shortest-float search.
        out.extend_from_slice(itoa::Buffer::new().format(x as i64).as_bytes());
        out.extend_from_slice(b".0");
    } else if x.is_finite() {
        out.extend_from_slice(zmij::Buffer::new().format_finite(x).as_bytes());
    } else {
        out.extend_from_slice(b"null");
    }
}

impl Serialize for SpendField<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for v in self.0 {
            m.serialize_entry(
                &*v.unit,
                &UnitField {
                    reserved: clean(v.reserved),
                    remaining: v.remaining.map(|(x, _)| clean(x)),
                    budget: v.remaining.map(|(_, b)| b.as_str()),
                },
            )?;
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The start of a unit's entry is copied from the last answer only while unit and estimate
    /// are the same.
    #[test]
    fn an_entry_is_written_anew_when_its_unit_or_estimate_changes() {
        let view = |unit: &str, reserved| SpendView {
            unit: unit.into(),
            reserved,
            remaining: Some((1.5, SpendBudget::TenantDaily)),
        };
        let answers = [
            [view("usd", 0.01), view("tokens", 500.0)],
            [view("usd", 0.01), view("tokens", 500.0)],
            [view("usd", 0.02), view("tokens", 500.0)],
            [view("tokens", 500.0), view("usd", 0.02)],
            [view("rows", 0.02), view("usd", 0.03)],
            // A name that needs escaping, after one already written: serde writes it all.
            [view("usd", 0.03), view("a\"b", 1.0)],
        ];
        for views in &answers {
            let mut out = Vec::new();
            SpendField(views).write_into(&mut out);
            let serde = serde_json::to_vec(&SpendField(views)).unwrap();
            assert_eq!(String::from_utf8(out), String::from_utf8(serde));
        }
    }

    #[test]
    fn clean_is_rounding_to_nine_places() {
        let slow = |x: f64| {
            let r = (x * 1e9).round() / 1e9;
            if r == 0.0 {
                0.0
            } else {
                r
            }
        };
        let mut xs = vec![
            0.0, -0.0, 0.5e-9, -0.5e-9, 1.5e-9, -2.5e-9, 0.93, 1e15, -1e15, 4.5e6,
        ];
        xs.extend([
            f64::INFINITY,
            f64::NEG_INFINITY,
            4_503_599.627_370_496,
            9e6 + 0.25,
        ]);
        let mut x = 0.000_123_456_789_f64;
        while x < 1e16 {
            xs.extend([x, -x, x + 0.5e-9, 1.0 - x.fract()]);
            x *= 1.37;
        }
        for x in xs {
            assert_eq!(clean(x).to_bits(), slow(x).to_bits(), "{x}");
        }
        assert!(clean(f64::NAN).is_nan());
    }

    fn cfg() -> Config {
        Config::parse("c.toml", "[spend.usd]\nestimate = 0.01\nrun = 1\n").unwrap()
    }

    #[test]
    fn estimates_and_settlements_are_checked_against_the_units() {
        let c = cfg();
        let mut m = BTreeMap::new();
        m.insert("usd".to_string(), 0.05);
        let s = call_spend(&c, Some("r-1"), Some(&m)).unwrap().unwrap();
        assert_eq!(s.run.as_deref(), Some("r-1"));
        assert_eq!(s.estimates[0].1, 0.05);
        assert!(call_spend(&c, None, None).unwrap().is_none());
        m.insert("eur".to_string(), 1.0);
        let e = call_spend(&c, None, Some(&m)).unwrap_err();
        assert!(e.message.contains("\"eur\""), "{}", e.message);
        let mut bad = BTreeMap::new();
        bad.insert("usd".to_string(), -1.0);
        assert!(call_spend(&c, None, Some(&bad)).is_err());
        assert!(settlement(&c, Some(&bad), None).is_err());
        assert!(settlement(&c, None, Some(-0.5)).is_err());
        assert_eq!(settlement(&c, None, Some(0.0)).unwrap().cost, Some(0.0));
        assert!(call_spend(&c, Some("bad\nrun"), None).is_err());
        // No units: a run alone is accepted and ignored, an estimate is unknown.
        let none = Config::default();
        assert!(call_spend(&none, Some("r"), None).unwrap().is_none());
        let mut usd = BTreeMap::new();
        usd.insert("usd".to_string(), 1.0);
        assert!(call_spend(&none, None, Some(&usd)).is_err());
    }

    #[test]
    fn the_spend_field_written_by_hand_is_what_serde_writes() {
        use crate::engine::spend::SpendBudget;
        let figures = [
            0.0,
            -0.0,
            1.0,
            500.0,
            -3.0,
            0.05,
            0.93,
            -0.6,
            1e-7,
            123.456,
            999_999_999_999.99,
            99_999_999_999_500.0,
            999_999_999_999_999.0,
            1e15,
            -1e15,
            1e16,
            1e300,
            f64::MAX,
            f64::NAN,
            f64::INFINITY,
        ];
        for &x in &figures {
            let v = [
                SpendView {
                    unit: "usd".into(),
                    reserved: x,
                    remaining: Some((x, SpendBudget::TenantDaily)),
                },
                SpendView {
                    unit: "rows_2".into(),
                    reserved: x,
                    remaining: None,
                },
            ];
            let mut by_hand = Vec::new();
            SpendField(&v).write_into(&mut by_hand);
            assert_eq!(
                String::from_utf8(by_hand).unwrap(),
                serde_json::to_string(&SpendField(&v)).unwrap(),
                "{x}"
            );
        }
    }

    #[test]
    fn the_spend_field_rounds_away_float_noise() {
        use crate::engine::spend::SpendBudget;
        let v = [SpendView {
            unit: "usd".into(),
            reserved: 0.05,
            remaining: Some((1.0 - 0.05 - 0.02, SpendBudget::Run)),
        }];
        assert_eq!(
            serde_json::to_string(&SpendField(&v)).unwrap(),
            r#"{"usd":{"reserved":0.05,"remaining":0.93,"budget":"run"}}"#
        );
    }
}
