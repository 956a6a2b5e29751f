//! `[spend.NAME]`, `[tools.NAME.spend]` and `[plans.NAME.spend.UNIT]`: budgets in what calls really
//! cost (money, model tokens, rows scanned), estimated at admission and settled at release.
//!
//! Spend is a section of its own rather than more keys on `[limits.*]`: a unit is named by the
//! operator, carries its own estimate and display, and its budgets are per UTC day (tenant,
//! subject) or per agent run, never a rate. Everything spend-related in the model lives in
//! [`SpendConfig`] so that tools and plans keep their own shapes; the engine reads a unit by its
//! index in [`SpendConfig::units`] (sorted by name), which is what a call's estimates and a lease's
//! reservation are keyed by.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::model::HashMap;
use super::raw::S;
use super::validate::{FirstProblem, Validator};
use super::ConfigError;

/// At most this many units: a call's estimates and a lease's reservation hold one figure per unit.
pub const MAX_SPEND_UNITS: usize = 16;

/// How long a run's spend is remembered after its last call when `run_idle` is not set.
pub const DEFAULT_RUN_IDLE: Duration = Duration::from_secs(3600);

/// The largest figure a budget or estimate may be (as every other limit in the file).
const MAX_FIGURE: f64 = 1e15;

/// The budgets of one unit; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpendBudgets {
    /// Per tenant per UTC day.
    pub tenant_daily: Option<f64>,
    /// Per subject per UTC day.
    pub subject_daily: Option<f64>,
    /// Per agent run (all calls carrying the same `run`).
    pub run: Option<f64>,
}

impl SpendBudgets {
    /// These budgets with every one that `over` sets replaced.
    pub fn overridden(self, over: &SpendBudgets) -> SpendBudgets {
        SpendBudgets {
            tenant_daily: over.tenant_daily.or(self.tenant_daily),
            subject_daily: over.subject_daily.or(self.subject_daily),
            run: over.run.or(self.run),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tenant_daily.is_none() && self.subject_daily.is_none() && self.run.is_none()
    }
}

/// `[spend.NAME]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SpendUnit {
    pub name: String,
    /// Reserved at admission when neither the call nor its tool names an estimate.
    pub estimate: f64,
    pub budgets: SpendBudgets,
    /// Written before figures in the text the model reads (`$0.93`); without it the unit's name
    /// follows the figure (`930 tokens`).
    pub currency: Option<String>,
    /// A run's spend in this unit is forgotten this long after the run's last call.
    pub run_idle: Duration,
}

impl SpendUnit {
    /// A figure as the model reads it: `$0.93`, or `930 tokens`.
    pub fn amount(&self, x: f64) -> String {
        let n = figure(x);
        match &self.currency {
            Some(c) if x < 0.0 => format!("-{c}{}", figure(-x)),
            Some(c) => format!("{c}{n}"),
            None => format!("{n} {}", self.name),
        }
    }
}

/// A figure without float noise: up to four decimals, trailing zeros trimmed.
fn figure(x: f64) -> String {
    let s = format!("{x:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// Everything spend in the config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpendConfig {
    /// Sorted by name; a unit's index is its number everywhere below the config.
    pub units: Vec<SpendUnit>,
    /// `[tools.NAME.spend]`: a tool's own estimates, by unit index.
    pub tools: HashMap<String, Vec<(usize, f64)>>,
    /// `[plans.NAME.spend.UNIT]`: the budgets a plan overrides, by unit index.
    pub plans: HashMap<String, Vec<(usize, SpendBudgets)>>,
}

impl SpendConfig {
    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    pub fn unit(&self, name: &str) -> Option<usize> {
        self.units.iter().position(|u| u.name == name)
    }

    /// Each unit's budgets for a tenant on `plan` (its overrides applied).
    pub fn budgets(&self, plan: Option<&str>) -> Vec<SpendBudgets> {
        let over = plan.and_then(|p| self.plans.get(p));
        self.units
            .iter()
            .enumerate()
            .map(|(i, u)| {
                let o = over.and_then(|o| o.iter().find(|(j, _)| *j == i));
                o.map_or(u.budgets, |(_, o)| u.budgets.overridden(o))
            })
            .collect()
    }

    /// A tool's estimate in unit `i`, if the tool names one.
    pub fn tool_estimate(&self, tool: &str, i: usize) -> Option<f64> {
        self.tools
            .get(tool)?
            .iter()
            .find(|(j, _)| *j == i)
            .map(|(_, x)| *x)
    }
}

/// Whether `name` may name a unit: `[a-z][a-z0-9_]{0,31}` (it becomes a metric label value and a
/// JSON key, so it stays plain).
pub fn valid_unit_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_')
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpendUnit {
    estimate: Option<S<f64>>,
    tenant_daily: Option<S<f64>>,
    subject_daily: Option<S<f64>>,
    run: Option<S<f64>>,
    currency: Option<S<String>>,
    run_idle: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpendBudgets {
    tenant_daily: Option<S<f64>>,
    subject_daily: Option<S<f64>>,
    run: Option<S<f64>>,
}

pub(super) type RawToolSpend = S<BTreeMap<String, S<f64>>>;
pub(super) type RawPlanSpend = BTreeMap<String, S<RawSpendBudgets>>;

impl Validator<'_> {
    fn figure(&self, key: &str, v: &S<f64>) -> Result<f64, ConfigError> {
        let x = *v.get_ref();
        if !x.is_finite() || !(0.0..=MAX_FIGURE).contains(&x) {
            return self.err(
                v.span(),
                format!("{key} must be a number from 0 to 1e15, not {x}"),
            );
        }
        Ok(x)
    }

    fn budgets(
        &self,
        section: &str,
        tenant_daily: Option<&S<f64>>,
        subject_daily: Option<&S<f64>>,
        run: Option<&S<f64>>,
    ) -> Result<SpendBudgets, ConfigError> {
        let mut first = FirstProblem::default();
        let mut one = |key: &str, v: Option<&S<f64>>| {
            v.and_then(|v| first.note(self.figure(&format!("{section}.{key}"), v)))
        };
        let b = SpendBudgets {
            tenant_daily: one("tenant_daily", tenant_daily),
            subject_daily: one("subject_daily", subject_daily),
            run: one("run", run),
        };
        first.or(b)
    }

    /// `[spend.NAME]`, one unit.
    fn spend_unit(&self, name: &str, raw: &S<RawSpendUnit>) -> Result<SpendUnit, ConfigError> {
        if !valid_unit_name(name) {
            return self.err(
                raw.span(),
                format!("spend unit {name:?} must be a lowercase letter followed by at most 31 lowercase letters, digits or _"),
            );
        }
        let u = raw.get_ref();
        let section = format!("spend.{name}");
        let estimate = match &u.estimate {
            Some(v) => self.figure(&format!("{section}.estimate"), v)?,
            None => {
                return self.err(
                    raw.span(),
                    format!("{section}.estimate is required: what a call reserves when neither it nor its tool names an estimate"),
                )
            }
        };
        let budgets = self.budgets(
            &section,
            u.tenant_daily.as_ref(),
            u.subject_daily.as_ref(),
            u.run.as_ref(),
        )?;
        let currency = match &u.currency {
            Some(c) => {
                let s = c.get_ref();
                if s.is_empty() || s.chars().count() > 4 || s.chars().any(char::is_control) {
                    return self.err(
                        c.span(),
                        format!("{section}.currency must be a symbol of 1 to 4 characters such as \"$\", not {s:?}"),
                    );
                }
                Some(s.clone())
            }
            None => None,
        };
        let run_idle = match &u.run_idle {
            Some(v) => {
                let d = self.duration(
                    &format!("{section}.run_idle"),
                    v,
                    Duration::from_secs(30 * 86_400),
                )?;
                if d < Duration::from_secs(1) {
                    return self.err(v.span(), format!("{section}.run_idle must be at least 1s"));
                }
                d
            }
            None => DEFAULT_RUN_IDLE,
        };
        Ok(SpendUnit {
            name: name.to_string(),
            estimate,
            budgets,
            currency,
            run_idle,
        })
    }

    /// `[spend.*]`: every unit, each one item; the units that pass, sorted by name.
    pub(super) fn spend_units(
        &self,
        raw: &BTreeMap<String, S<RawSpendUnit>>,
        first: &mut FirstProblem,
    ) -> Vec<SpendUnit> {
        let mut units: Vec<SpendUnit> = raw
            .iter()
            .filter_map(|(name, u)| first.note(self.spend_unit(name, u)))
            .collect();
        if units.len() > MAX_SPEND_UNITS {
            if let Some((_, u)) = raw.iter().nth(MAX_SPEND_UNITS) {
                first.note::<()>(self.err(
                    u.span(),
                    format!("at most {MAX_SPEND_UNITS} spend units may be configured"),
                ));
            }
            units.truncate(MAX_SPEND_UNITS);
        }
        units
    }

    fn unit_index(
        &self,
        key: &str,
        unit: &str,
        span: std::ops::Range<usize>,
        units: &[SpendUnit],
    ) -> Result<usize, ConfigError> {
        match units.iter().position(|u| u.name == unit) {
            Some(i) => Ok(i),
            None => {
                let known: Vec<&str> = units.iter().map(|u| u.name.as_str()).collect();
                // A typo of a configured unit is the likely cause: name it first, as an unknown
                // plan's error does.
                let meant = super::lint::did_you_mean(unit, known.iter().copied());
                let known = match meant {
                    Some(m) => {
                        format!("did you mean {m:?}? configured units: {}", known.join(", "))
                    }
                    None if known.is_empty() => "no [spend.NAME] unit is configured".to_string(),
                    None => format!("configured units: {}", known.join(", ")),
                };
                self.err(
                    span,
                    format!("{key}: unknown spend unit {unit:?} ({known})"),
                )
            }
        }
    }

    /// `[tools.NAME.spend]`: a tool's estimates per unit.
    pub(super) fn tool_spend(
        &self,
        tool: &str,
        raw: &RawToolSpend,
        units: &[SpendUnit],
    ) -> Result<Vec<(usize, f64)>, ConfigError> {
        let mut out = Vec::new();
        for (unit, v) in raw.get_ref() {
            let key = format!("tools.{tool}.spend.{unit}");
            let i = self.unit_index(&key, unit, v.span(), units)?;
            out.push((i, self.figure(&key, v)?));
        }
        Ok(out)
    }

    /// `[plans.NAME.spend.UNIT]`: the budgets a plan overrides.
    pub(super) fn plan_spend(
        &self,
        plan: &str,
        raw: &RawPlanSpend,
        units: &[SpendUnit],
    ) -> Result<Vec<(usize, SpendBudgets)>, ConfigError> {
        let mut out = Vec::new();
        for (unit, b) in raw {
            let section = format!("plans.{plan}.spend.{unit}");
            let i = self.unit_index(&section, unit, b.span(), units)?;
            let r = b.get_ref();
            out.push((
                i,
                self.budgets(
                    &section,
                    r.tenant_daily.as_ref(),
                    r.subject_daily.as_ref(),
                    r.run.as_ref(),
                )?,
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn err(text: &str) -> String {
        Config::parse("c.toml", text).unwrap_err().to_string()
    }

    #[test]
    fn units_tools_and_plans_are_read() {
        let cfg = Config::parse(
            "c.toml",
            r#"
[spend.usd]
estimate = 0.01
tenant_daily = 50.0
subject_daily = 5
run = 1.0
currency = "$"
[spend.tokens]
estimate = 500
run_idle = "10m"
[tools.summarize.spend]
usd = 0.02
tokens = 3000
[plans.free.spend.usd]
run = 0.25
[tenants.globex]
plan = "free"
"#,
        )
        .unwrap();
        let s = &cfg.spend;
        assert_eq!(s.units.len(), 2);
        assert_eq!(s.units[0].name, "tokens");
        assert_eq!(s.units[0].run_idle.as_secs(), 600);
        assert_eq!(s.units[1].name, "usd");
        assert_eq!(s.units[1].run_idle, super::DEFAULT_RUN_IDLE);
        assert_eq!(s.units[1].budgets.subject_daily, Some(5.0));
        assert_eq!(s.tool_estimate("summarize", 1), Some(0.02));
        assert_eq!(s.tool_estimate("summarize", 0), Some(3000.0));
        assert_eq!(s.tool_estimate("other", 0), None);
        let free = s.budgets(Some("free"));
        assert_eq!(free[1].run, Some(0.25));
        assert_eq!(free[1].tenant_daily, Some(50.0));
        assert_eq!(s.budgets(None)[1].run, Some(1.0));
        assert_eq!(s.units[1].amount(0.93), "$0.93");
        assert_eq!(s.units[1].amount(-0.05), "-$0.05");
        assert_eq!(s.units[0].amount(1500.0), "1500 tokens");
    }

    #[test]
    fn bad_values_name_their_line() {
        assert_eq!(
            err("[spend.usd]\nestimate = 0.01\nrun = -1\n"),
            "c.toml:3: spend.usd.run must be a number from 0 to 1e15, not -1"
        );
        assert_eq!(
            err("[spend.usd]\nestimate = nan\n"),
            "c.toml:2: spend.usd.estimate must be a number from 0 to 1e15, not NaN"
        );
        assert!(err("[spend.USD]\nestimate = 1\n").starts_with("c.toml:1: spend unit \"USD\""));
        assert!(err("[spend.usd]\nrun = 1\n").contains("spend.usd.estimate is required"));
        assert!(err("[spend.usd]\nestimate = 1\nbudget = 2\n").starts_with("c.toml:3:"));
        assert!(err("[spend.usd]\nestimate = 1\nrun_idle = \"5 parsecs\"\n")
            .starts_with("c.toml:3: spend.usd.run_idle"));
        assert!(err("[spend.usd]\nestimate = 1\ncurrency = \"dollars\"\n")
            .starts_with("c.toml:3: spend.usd.currency"));
        assert_eq!(
            err("[spend.usd]\nestimate = 1\n[tools.x.spend]\ntokens = 5\n"),
            "c.toml:4: tools.x.spend.tokens: unknown spend unit \"tokens\" (configured units: usd)"
        );
        assert!(err("[tools.x.spend]\nusd = -5\n").starts_with("c.toml:2:"));
        assert_eq!(
            err("[plans.free.spend.rows]\nrun = 5\n"),
            "c.toml:1: plans.free.spend.rows: unknown spend unit \"rows\" (no [spend.NAME] unit is configured)"
        );
        assert!(
            err("[spend.usd]\nestimate = 1\n[plans.free.spend.usd]\nrun = inf\n")
                .starts_with("c.toml:4: plans.free.spend.usd.run")
        );
    }
}
