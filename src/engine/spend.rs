//! Spend budgets: what calls cost in units other than calls (money, model tokens, rows), for one
//! tenant, as plain data driven by `now` and the UTC day.
//!
//! A call reserves an estimate per unit at admission, in every budget that applies (the tenant's
//! day, its subject's day, its run); its release settles the actual figure, giving the difference
//! back or charging it on top. A budget may therefore go below zero (a call cost more than it was
//! estimated at): it then refuses every call until it is back above the next call's estimate, which
//! for a daily budget is the next UTC day and for a run is never. Reserving before the call is what
//! keeps parallel calls of one run from overshooting together: each sees what the others reserved.
//!
//! The ledger keeps the figures only; which budgets apply and how large they are comes in with
//! every call ([`Budgets`]), so a reload changes them without touching what was spent. Memory is
//! bounded: subjects' daily figures are dropped at the day's end, a run is forgotten `run_idle`
//! after its last call, and at most [`MAX_RUNS`] runs are kept per tenant (past it, the run idle
//! longest is forgotten first).

use std::sync::Arc;

use compact_str::CompactString;
use smallvec::SmallVec;

use crate::clock::Nanos;
use crate::config::{SpendBudgets, SpendUnit};

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// hashbrown's, for `entry_ref`: a run is found by the call's `&str`, and its name copied only when
/// it is new.
type RunMap = hashbrown::HashMap<Arc<str>, Run, foldhash::fast::RandomState>;

/// One figure per unit, by the unit's index in the config (two inline: most configs have one or two).
pub type Figures = SmallVec<[f64; 2]>;

/// Runs kept per tenant at most.
pub const MAX_RUNS: usize = 100_000;

/// Float sums of estimates and settlements drift by a few ulps: a call that fits to within this is
/// taken to fit.
const EPSILON: f64 = 1e-9;

/// Which budget of a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpendBudget {
    Run,
    SubjectDaily,
    TenantDaily,
}

impl SpendBudget {
    pub fn as_str(self) -> &'static str {
        match self {
            SpendBudget::Run => "run",
            SpendBudget::SubjectDaily => "subject_daily",
            SpendBudget::TenantDaily => "tenant_daily",
        }
    }
}

/// Every unit's [`SpendView`] of one admission.
pub type SpendViews = SmallVec<[SpendView; 2]>;

/// What an admitted call reserved in one unit, and the least any budget of the unit has left after
/// it (`None` when no budget of the unit applies).
#[derive(Debug, Clone, PartialEq)]
pub struct SpendView {
    pub unit: Arc<str>,
    pub reserved: f64,
    pub remaining: Option<(f64, SpendBudget)>,
}

/// A call's estimate that does not fit a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpendShort {
    pub unit: usize,
    pub budget: SpendBudget,
    /// What the budget has left (below zero when it is in debt).
    pub remaining: f64,
    pub estimate: f64,
    pub size: f64,
}

/// The spend side of the config for one tenant: units and their budgets after its plan.
#[derive(Debug, Clone, Copy)]
pub struct Budgets<'a> {
    pub units: &'a [SpendUnit],
    pub budgets: &'a [SpendBudgets],
    /// The units' names, shared by the answers that name them.
    pub names: &'a [Arc<str>],
}

/// A run's spend per unit since it started (or since it was last forgotten).
#[derive(Debug, Clone, Default)]
struct Run {
    spent: Figures,
    last: Nanos,
}

/// What a live lease reserved, until its release settles it.
#[derive(Debug, Clone)]
pub struct Hold {
    subject: Arc<str>,
    /// Inline up to 24 bytes (the usual run id): no allocation per call.
    run: Option<CompactString>,
    day: i64,
    reserved: Figures,
}

#[inline]
fn get(f: &[f64], i: usize) -> f64 {
    f.get(i).copied().unwrap_or(0.0)
}

#[inline]
fn add(f: &mut Figures, i: usize, x: f64) {
    if f.len() <= i {
        f.resize(i + 1, 0.0);
    }
    f[i] += x;
}

/// Adds `xs` to `f`, figure by figure: [`add`] for a whole call's figures, with one length check
/// instead of one per unit.
#[inline]
fn add_all(f: &mut Figures, xs: &[f64]) {
    if f.len() < xs.len() {
        f.resize(xs.len(), 0.0);
    }
    for (a, x) in f.iter_mut().zip(xs) {
        *a += x;
    }
}

/// One tenant's spend.
#[derive(Debug, Default)]
pub struct SpendLedger {
    /// The UTC day the daily figures are for.
    day: i64,
    tenant: Figures,
    subjects: HashMap<Arc<str>, Figures>,
    runs: RunMap,
    holds: HashMap<u64, Hold>,
    /// Settled spend per unit not yet reported to metrics.
    settled: Figures,
}

impl SpendLedger {
    /// Starts a new UTC day: daily figures go back to zero (what live leases of the old day settle
    /// later no longer counts against the new one).
    fn roll(&mut self, day: i64) {
        if day != self.day {
            self.day = day;
            self.tenant.clear();
            self.subjects.clear();
        }
    }

    /// What each budget of unit `i` has left now, in the order a refusal names them (a run first:
    /// waiting does not help there, so that is what the model must hear). `run` is the call's run
    /// (`None`: it names none) as the ledger knows it (`Some(None)`: a new run), `subject` the
    /// subject's figures today: each looked up once per call, not once per unit.
    fn left(
        &self,
        b: Budgets<'_>,
        subject: Option<&Figures>,
        run: Option<Option<&Run>>,
        i: usize,
        now: Nanos,
    ) -> SmallVec<[(SpendBudget, f64, f64); 3]> {
        let mut out = SmallVec::new();
        let Some(budgets) = b.budgets.get(i) else {
            return out;
        };
        if let (Some(size), Some(run)) = (budgets.run, run) {
            let idle = b
                .units
                .get(i)
                .map_or(u64::MAX, |u| u.run_idle.as_nanos() as u64);
            // A run idle past the unit's `run_idle` starts over.
            let spent = run
                .filter(|r| now.saturating_sub(r.last) <= idle)
                .map_or(0.0, |r| get(&r.spent, i));
            out.push((SpendBudget::Run, size, size - spent));
        }
        if let Some(size) = budgets.subject_daily {
            let used = subject.map_or(0.0, |f| get(f, i));
            out.push((SpendBudget::SubjectDaily, size, size - used));
        }
        if let Some(size) = budgets.tenant_daily {
            out.push((SpendBudget::TenantDaily, size, size - get(&self.tenant, i)));
        }
        out
    }

    /// Whether the estimates fit every budget that applies; nothing changes either way. `Ok` holds
    /// what the admitted answer reports per unit (after the reservation).
    pub fn check(
        &mut self,
        b: Budgets<'_>,
        subject: &str,
        run: Option<&str>,
        estimates: &[f64],
        day: i64,
        now: Nanos,
    ) -> Result<SpendViews, SpendShort> {
        self.roll(day);
        // Each map is looked up once, and only when some unit has a budget that reads it.
        let run = run
            .filter(|_| b.budgets.iter().any(|x| x.run.is_some()))
            .map(|r| self.runs.get(r));
        let subject = b
            .budgets
            .iter()
            .any(|x| x.subject_daily.is_some())
            .then(|| self.subjects.get(subject))
            .flatten();
        let mut views = SmallVec::new();
        for (i, unit) in b.names.iter().enumerate() {
            let est = get(estimates, i);
            let mut least: Option<(f64, SpendBudget)> = None;
            for (budget, size, left) in self.left(b, subject, run, i, now) {
                if left + EPSILON < est {
                    return Err(SpendShort {
                        unit: i,
                        budget,
                        remaining: left,
                        estimate: est,
                        size,
                    });
                }
                let after = left - est;
                // Within float noise a tie, which goes to the budget named first.
                if least.is_none_or(|(l, _)| after < l - EPSILON) {
                    least = Some((after, budget));
                }
            }
            views.push(SpendView {
                unit: unit.clone(),
                reserved: est,
                remaining: least,
            });
        }
        Ok(views)
    }

    /// Reserves a call's estimates for lease `lease` in its day, subject and run (after a
    /// successful [`SpendLedger::check`] on the same state). One lookup per map.
    #[allow(clippy::too_many_arguments)] // each is one fact of the call; a struct would only rename them
    pub fn reserve(
        &mut self,
        lease: u64,
        subject: &Arc<str>,
        run: Option<&str>,
        estimates: &Figures,
        day: i64,
        now: Nanos,
        units: &[SpendUnit],
    ) {
        self.roll(day);
        add_all(&mut self.tenant, estimates);
        // Found by the name alone: the key is cloned only for a subject new today.
        match self.subjects.get_mut(&**subject) {
            Some(s) => add_all(s, estimates),
            None => {
                self.subjects.insert(subject.clone(), estimates.clone());
            }
        }
        if let Some(run) = run {
            let r = self.touch_run(run, now, units);
            add_all(&mut r.spent, estimates);
        }
        self.holds.insert(
            lease,
            Hold {
                subject: subject.clone(),
                run: run.map(CompactString::from),
                day,
                reserved: estimates.clone(),
            },
        );
    }

    /// Marks a run used now, forgetting first what it spent in each unit whose `run_idle` has
    /// passed since its last call; a new run is added within [`MAX_RUNS`].
    fn touch_run(&mut self, run: &str, now: Nanos, units: &[SpendUnit]) -> &mut Run {
        if self.runs.len() >= MAX_RUNS && !self.runs.contains_key(run) {
            self.forget_idle_runs(now, units);
            if self.runs.len() >= MAX_RUNS {
                let oldest = self
                    .runs
                    .iter()
                    .min_by_key(|(_, r)| r.last)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.runs.remove(&k);
                }
            }
        }
        // The name is copied only for a new run.
        let r = self.runs.entry_ref(run).or_default();
        for (i, u) in units.iter().enumerate() {
            if now.saturating_sub(r.last) > u.run_idle.as_nanos() as u64 && i < r.spent.len() {
                r.spent[i] = 0.0;
            }
        }
        r.last = now;
        r
    }

    /// Forgets every run idle past the longest `run_idle` of any unit.
    pub fn forget_idle_runs(&mut self, now: Nanos, units: &[SpendUnit]) {
        let idle = units
            .iter()
            .map(|u| u.run_idle.as_nanos() as u64)
            .max()
            .unwrap_or(0);
        self.runs.retain(|_, r| now.saturating_sub(r.last) <= idle);
    }

    /// Settles lease `lease`: what it actually spent per unit (`actual`, by unit index; a unit it does
    /// not name keeps its estimate), or nothing at all when `cancelled`. The difference to the
    /// reservation is given back or charged on top, in every budget that still counts it (a daily
    /// one only on the day of the reservation; a run only while it is remembered). Returns false
    /// when the lease reserved nothing.
    pub fn settle(
        &mut self,
        lease: u64,
        actual: &[(usize, f64)],
        cancelled: bool,
        day: i64,
        now: Nanos,
        units: &[SpendUnit],
    ) -> bool {
        let Some(h) = self.holds.remove(&lease) else {
            return false;
        };
        self.roll(day);
        if !cancelled && actual.is_empty() {
            // The estimate stands (an expiry, or a release without `spent`): no budget changes, so
            // no subject or run is looked up; only the metrics counter learns what was spent.
            // (Estimates are never negative: the config and the API hold them to 0..1e15.)
            add_all(&mut self.settled, &h.reserved);
            return true;
        }
        let n = h
            .reserved
            .len()
            .max(actual.iter().map(|(i, _)| i + 1).max().unwrap_or(0));
        let n = n.min(units.len().max(h.reserved.len()));
        let mut diff = Figures::new();
        for i in 0..n {
            let reserved = get(&h.reserved, i);
            let spent = if cancelled {
                0.0
            } else {
                actual
                    .iter()
                    .rev()
                    .find(|(j, _)| *j == i)
                    .map_or(reserved, |(_, x)| *x)
            };
            add(&mut diff, i, spent - reserved);
            if spent > 0.0 {
                add(&mut self.settled, i, spent);
            }
        }
        if h.day == self.day {
            add_all(&mut self.tenant, &diff);
            if let Some(s) = self.subjects.get_mut(&*h.subject) {
                add_all(s, &diff);
            } else {
                self.subjects.insert(h.subject.clone(), diff.clone());
            }
        }
        if let Some(run) = &h.run {
            if let Some(r) = self.runs.get_mut(run.as_str()) {
                for (i, &d) in diff.iter().enumerate() {
                    let idle = units.get(i).map_or(0, |u| u.run_idle.as_nanos() as u64);
                    if now.saturating_sub(r.last) <= idle {
                        add(&mut r.spent, i, d);
                    }
                }
            }
        }
        true
    }

    /// Settled spend per unit since the last call (for the metrics counter).
    pub fn take_settled(&mut self) -> Figures {
        std::mem::take(&mut self.settled)
    }

    /// Whether nothing is held or remembered that must outlive the tenant's state being dropped.
    pub fn is_resting(&self, day: i64) -> bool {
        self.holds.is_empty()
            && self.runs.is_empty()
            && (self.day != day || self.tenant.iter().all(|&x| x == 0.0))
    }

    /// What the tenant spent today per unit (reserved and settled).
    pub fn tenant_spent(&self, day: i64) -> Figures {
        if self.day == day {
            self.tenant.clone()
        } else {
            Figures::new()
        }
    }

    pub fn live_runs(&self) -> usize {
        self.runs.len()
    }

    pub fn holds(&self) -> usize {
        self.holds.len()
    }

    /// The durable part: the day's figures of the tenant and its subjects, and every run, by unit
    /// name (so a restart with units added, removed or reordered keeps each figure in its unit).
    pub fn export(&self, units: &[SpendUnit], now: Nanos, day: i64) -> DurableSpend {
        // Figures of a day that is over are not worth keeping.
        let today = self.day == day;
        let named = |f: &Figures| -> Vec<(String, f64)> {
            f.iter()
                .enumerate()
                .filter(|(_, x)| **x != 0.0)
                .filter_map(|(i, x)| Some((units.get(i)?.name.clone(), *x)))
                .collect()
        };
        DurableSpend {
            day: self.day,
            tenant: if today {
                named(&self.tenant)
            } else {
                Vec::new()
            },
            subjects: self
                .subjects
                .iter()
                .filter(|_| today)
                .map(|(s, f)| (s.to_string(), named(f)))
                .filter(|(_, f)| !f.is_empty())
                .collect(),
            runs: self
                .runs
                .iter()
                .map(|(k, r)| (k.to_string(), named(&r.spent), now.saturating_sub(r.last)))
                .collect(),
        }
    }

    /// Takes back what [`SpendLedger::export`] wrote (figures of units no longer configured are
    /// dropped; `now` dates each run's idle time again).
    pub fn restore(&mut self, d: &DurableSpend, units: &[SpendUnit], now: Nanos, day: i64) {
        let unnamed = |f: &[(String, f64)]| -> Figures {
            let mut out = Figures::new();
            for (name, x) in f {
                if let Some(i) = units.iter().position(|u| u.name == *name) {
                    if x.is_finite() {
                        add(&mut out, i, *x);
                    }
                }
            }
            out
        };
        // A day that is over comes back as nothing (its runs still do: a run spans days).
        if d.day == day {
            self.day = d.day;
            self.tenant = unnamed(&d.tenant);
            for (s, f) in &d.subjects {
                self.subjects.insert(Arc::from(s.as_str()), unnamed(f));
            }
        }
        for (k, f, idle) in &d.runs {
            if self.runs.len() >= MAX_RUNS {
                break;
            }
            self.runs.insert(
                Arc::from(k.as_str()),
                Run {
                    spent: unnamed(f),
                    last: now.saturating_sub(*idle),
                },
            );
        }
    }
}

/// Figures by unit name.
pub type NamedFigures = Vec<(String, f64)>;

/// A run as the state file keeps it: its name, its figures, and how long it had been idle (ns).
pub type DurableRun = (String, NamedFigures, u64);

/// A tenant's spend as the state file keeps it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DurableSpend {
    pub day: i64,
    #[serde(default)]
    pub tenant: Vec<(String, f64)>,
    #[serde(default)]
    pub subjects: Vec<(String, Vec<(String, f64)>)>,
    /// Each run: its figures and how long it had been idle when written (ns).
    #[serde(default)]
    pub runs: Vec<DurableRun>,
}

impl DurableSpend {
    pub fn is_empty(&self) -> bool {
        self.tenant.is_empty() && self.subjects.is_empty() && self.runs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::NS_PER_SEC;
    use crate::config::Config;

    fn cfg() -> Config {
        Config::parse(
            "t.toml",
            "[spend.usd]\nestimate = 0.05\ntenant_daily = 10\nsubject_daily = 2\nrun = 1\nrun_idle = \"60s\"\n[spend.tokens]\nestimate = 100\n",
        )
        .unwrap()
    }

    fn est(usd: f64) -> Figures {
        // Units are sorted by name: tokens, usd.
        SmallVec::from_slice(&[100.0, usd])
    }

    /// `b`: the [`Budgets`] of [`cfg`] without a plan, with what it borrows kept alive in the
    /// caller's scope.
    macro_rules! budgets {
        ($b:ident) => {
            let c = cfg();
            let budgets = c.spend.budgets(None);
            let names = names(&c);
            let $b = Budgets {
                units: &c.spend.units,
                budgets: &budgets,
                names: &names,
            };
        };
    }

    fn names(c: &Config) -> Vec<Arc<str>> {
        c.spend
            .units
            .iter()
            .map(|u| Arc::from(u.name.as_str()))
            .collect()
    }

    fn run() -> &'static str {
        "r-1"
    }

    #[test]
    fn a_run_stops_at_its_budget_and_reservations_keep_parallel_calls_inside_it() {
        budgets!(b);
        let s: Arc<str> = Arc::from("s");
        let mut l = SpendLedger::default();
        // 20 calls of 0.05 fit a budget of 1, none of them released yet: the 21st does not.
        for lease in 0..20 {
            let v = l.check(b, &s, Some("r-1"), &est(0.05), 1, 0).unwrap();
            assert_eq!(v[1].reserved, 0.05);
            l.reserve(lease, &s, Some(run()), &est(0.05), 1, 0, b.units);
        }
        let short = l.check(b, &s, Some("r-1"), &est(0.05), 1, 0).unwrap_err();
        assert_eq!(short.budget, SpendBudget::Run);
        assert!(short.remaining.abs() < 1e-9);
        // Another run of the same subject is held by the subject's day (2) only.
        let v = l.check(b, &s, Some("r-2"), &est(0.05), 1, 0).unwrap();
        let (left, budget) = v[1].remaining.unwrap();
        assert_eq!(budget, SpendBudget::Run);
        assert!((left - 0.95).abs() < 1e-9);
        assert_eq!(v[0].remaining, None);
    }

    #[test]
    fn settling_gives_back_or_charges_on_top_and_debt_refuses() {
        budgets!(b);
        let s: Arc<str> = Arc::from("s");
        let mut l = SpendLedger::default();
        l.reserve(1, &s, Some(run()), &est(0.5), 1, 0, b.units);
        // Cheaper than estimated: 0.4 comes back.
        assert!(l.settle(1, &[(1, 0.1)], false, 1, 0, b.units));
        assert!((get(&l.tenant, 1) - 0.1).abs() < 1e-9);
        assert!(!l.settle(1, &[], false, 1, 0, b.units), "settled once");
        // Dearer: the run goes into debt and refuses even a free call.
        l.reserve(2, &s, Some(run()), &est(0.5), 1, 0, b.units);
        l.settle(2, &[(1, 1.5)], false, 1, 0, b.units);
        let short = l.check(b, &s, Some("r-1"), &est(0.0), 1, 0).unwrap_err();
        assert_eq!(short.budget, SpendBudget::Run);
        assert!((short.remaining + 0.6).abs() < 1e-9);
        // No figure: the estimate stands; cancelled: all of it comes back.
        l.reserve(3, &s, None, &est(0.25), 1, 0, b.units);
        l.settle(3, &[], false, 1, 0, b.units);
        l.reserve(4, &s, None, &est(0.25), 1, 0, b.units);
        l.settle(4, &[], true, 1, 0, b.units);
        assert!((get(&l.tenant, 1) - 1.85).abs() < 1e-9);
        assert!((get(&l.tenant, 0) - 300.0).abs() < 1e-9);
        let settled = l.take_settled();
        assert!((settled[1] - 1.85).abs() < 1e-9);
        assert!((settled[0] - 300.0).abs() < 1e-9);
    }

    #[test]
    fn the_utc_day_rolls_over_and_a_subjects_day_debt_ends_with_it() {
        budgets!(b);
        let s: Arc<str> = Arc::from("s");
        let mut l = SpendLedger::default();
        l.reserve(1, &s, None, &est(0.5), 1, 0, b.units);
        l.settle(1, &[(1, 3.0)], false, 1, 0, b.units);
        let short = l.check(b, &s, None, &est(0.05), 1, 0).unwrap_err();
        assert_eq!(short.budget, SpendBudget::SubjectDaily);
        assert!((short.remaining + 1.0).abs() < 1e-9);
        // Next day: everything daily is back, and a lease of yesterday settles without touching today.
        l.reserve(2, &s, None, &est(0.5), 1, 0, b.units);
        let v = l.check(b, &s, None, &est(0.05), 2, 0).unwrap();
        assert!((v[1].remaining.unwrap().0 - 1.95).abs() < 1e-9);
        l.settle(2, &[(1, 2.0)], false, 2, 0, b.units);
        assert!(l.check(b, &s, None, &est(2.0), 2, 0).is_ok());
        assert!(l.subjects.is_empty());
    }

    #[test]
    fn an_idle_run_is_forgotten_and_memory_stays_bounded() {
        budgets!(b);
        let s: Arc<str> = Arc::from("s");
        let mut l = SpendLedger::default();
        l.reserve(1, &s, Some(run()), &est(1.0), 1, 0, b.units);
        l.settle(1, &[], false, 1, 0, b.units);
        assert!(l
            .check(b, &s, Some("r-1"), &est(0.05), 1, 60 * NS_PER_SEC)
            .is_err());
        // A minute without a call (run_idle = 60s): the run starts over.
        let t = 60 * NS_PER_SEC + 1;
        assert!(l.check(b, &s, Some("r-1"), &est(0.05), 1, t).is_ok());
        // The run is dropped once idle past the longest run_idle of any unit (tokens: 1h).
        l.forget_idle_runs(3600 * NS_PER_SEC, b.units);
        assert_eq!(l.live_runs(), 1);
        l.forget_idle_runs(3600 * NS_PER_SEC + 1, b.units);
        assert_eq!(l.live_runs(), 0);
        for i in 0..(MAX_RUNS + 10) {
            let r: Arc<str> = Arc::from(format!("r{i}"));
            l.reserve(i as u64, &s, Some(&*r), &est(0.0), 1, i as u64, b.units);
        }
        assert_eq!(l.live_runs(), MAX_RUNS);
        // The oldest went first.
        assert!(!l.runs.contains_key("r0") && l.runs.contains_key("r100009"));
    }

    #[test]
    fn export_and_restore_keep_figures_by_unit_name() {
        let c = cfg();
        let s: Arc<str> = Arc::from("s");
        let mut l = SpendLedger::default();
        l.reserve(
            1,
            &s,
            Some(run()),
            &est(0.5),
            7,
            10 * NS_PER_SEC,
            &c.spend.units,
        );
        let d = l.export(&c.spend.units, 12 * NS_PER_SEC, 7);
        let text = serde_json::to_string(&d).unwrap();
        let d: DurableSpend = serde_json::from_str(&text).unwrap();
        // A config with only usd: the tokens figures are dropped, usd lands at index 0.
        let only = Config::parse("t.toml", "[spend.usd]\nestimate = 1\nrun = 1\n").unwrap();
        let mut back = SpendLedger::default();
        back.restore(&d, &only.spend.units, 100 * NS_PER_SEC, 7);
        assert_eq!(back.tenant_spent(7).as_slice(), &[0.5]);
        assert_eq!(back.runs["r-1"].last, 98 * NS_PER_SEC);
        assert_eq!(back.subjects["s"].as_slice(), &[0.5]);
        // On the next day the day's figures are gone, the run is not.
        let mut later = SpendLedger::default();
        later.restore(&d, &only.spend.units, 100 * NS_PER_SEC, 8);
        assert!(later.tenant_spent(8).is_empty() && later.subjects.is_empty());
        assert_eq!(later.live_runs(), 1);
    }
}
