//! The metrics recorded on every decision, kept and rendered by admitd itself: fixed-bucket histograms
//! and the admissions counter, written in the Prometheus text format next to the exporter's output.
//!
//! The Prometheus exporter keeps every histogram sample in a buffer until its periodic upkeep folds
//! the samples into buckets; at tens of thousands of admissions a second that buffering and folding
//! cost more CPU than the admission decision itself (docs/BENCHMARKS.md). The layouts here are fixed
//! when a series is created, so recording a sample is a bucket search over a dozen bounds and two
//! relaxed atomic adds, in one allocation (a zero wait, the usual sample, touches one cache line), and
//! memory per series is constant. The admissions counter is one atomic per series for the same
//! reason: the exporter's counter handle reaches its value through two further allocations, each a
//! likely cache miss when tens of thousands of series are live. Only the metrics actor records;
//! `GET /metrics` reads the same atomics from the HTTP threads.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Buckets a histogram holds inline: the longest layout in [`super::names`] plus `+Inf`.
const MAX_BUCKETS: usize = 13;

/// One histogram series: a count per bucket (not cumulative; the last used one is `+Inf`), and the
/// sum. The sum and the first buckets share the first cache line.
#[derive(Debug)]
#[repr(C)]
pub struct Histogram {
    /// The sum of the samples, as `f64` bits.
    sum: AtomicU64,
    bounds: &'static [f64],
    buckets: [AtomicU64; MAX_BUCKETS],
}

impl Histogram {
    /// A histogram with the given bucket bounds; bounds past the 12th are ignored (no layout has
    /// more, which a test checks).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            sum: AtomicU64::new(0f64.to_bits()),
            bounds: &bounds[..bounds.len().min(MAX_BUCKETS - 1)],
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// Records one sample. Negative and NaN samples count in the first bucket and add nothing to
    /// the sum (they do not occur: every sample is a duration).
    pub fn record(&self, v: f64) {
        // `le` semantics: a sample equal to a bound belongs to that bound's bucket.
        let i = self.bounds.partition_point(|b| *b < v);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        if v > 0.0 {
            // Uncontended in practice (one recording thread); the loop keeps concurrent use correct.
            let _ = self
                .sum
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((f64::from_bits(bits) + v).to_bits())
                });
        }
    }

    /// Cumulative bucket counts (one per bound, then `+Inf`), and the sum.
    pub fn snapshot(&self) -> (Vec<u64>, f64) {
        let mut total = 0;
        let cumulative = self.buckets[..=self.bounds.len()]
            .iter()
            .map(|b| {
                total += b.load(Ordering::Relaxed);
                total
            })
            .collect();
        (cumulative, f64::from_bits(self.sum.load(Ordering::Relaxed)))
    }
}

/// A histogram metric: its name, label names, bucket layout and series by label values.
#[derive(Debug)]
pub struct Family {
    name: &'static str,
    labels: &'static [&'static str],
    bounds: &'static [f64],
    series: Mutex<BTreeMap<Box<str>, Arc<Histogram>>>,
}

impl Family {
    pub fn new(
        name: &'static str,
        labels: &'static [&'static str],
        bounds: &'static [f64],
    ) -> Self {
        Family {
            name,
            labels,
            bounds,
            series: Mutex::new(BTreeMap::new()),
        }
    }

    /// The series with these label values (one per label name, in order), created on first use.
    /// Callers keep the handle: this takes a lock and allocates the key.
    pub fn series(&self, values: &[&str]) -> Arc<Histogram> {
        debug_assert_eq!(values.len(), self.labels.len());
        let key = join(values);
        self.series
            .lock()
            .entry(key)
            .or_insert_with(|| Arc::new(Histogram::new(self.bounds)))
            .clone()
    }

    /// Appends the family in the Prometheus text format (nothing when it has no series yet).
    pub fn render(&self, out: &mut String) {
        let series: Vec<(Box<str>, Arc<Histogram>)> = self
            .series
            .lock()
            .iter()
            .map(|(k, h)| (k.clone(), h.clone()))
            .collect();
        if series.is_empty() {
            return;
        }
        write_help(out, self.name);
        let _ = writeln!(out, "# TYPE {} histogram", self.name);
        for (values, h) in series {
            let mut labels = String::new();
            for (name, value) in self.labels.iter().zip(split(&values)) {
                let _ = write!(labels, "{name}=\"");
                escape_label_value(value, &mut labels);
                labels.push_str("\",");
            }
            let (cumulative, sum) = h.snapshot();
            for (i, count) in cumulative.iter().enumerate() {
                let le = match self.bounds.get(i) {
                    Some(b) => format!("{b}"),
                    None => "+Inf".to_string(),
                };
                let _ = writeln!(out, "{}_bucket{{{labels}le=\"{le}\"}} {count}", self.name);
            }
            let labels = labels.trim_end_matches(',');
            let braces = if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            };
            let count = cumulative.last().copied().unwrap_or(0);
            let _ = writeln!(out, "{}_sum{braces} {sum}", self.name);
            let _ = writeln!(out, "{}_count{braces} {count}", self.name);
        }
        out.push('\n');
    }
}

/// A counter metric: its name, label names and series by label values.
#[derive(Debug)]
pub struct CounterFamily {
    name: &'static str,
    labels: &'static [&'static str],
    series: Mutex<BTreeMap<Box<str>, Arc<AtomicU64>>>,
}

impl CounterFamily {
    pub fn new(name: &'static str, labels: &'static [&'static str]) -> Self {
        CounterFamily {
            name,
            labels,
            series: Mutex::new(BTreeMap::new()),
        }
    }

    /// The series with these label values (in the order of the family's label names), created at
    /// zero on first use.
    pub fn series(&self, values: &[&str]) -> Arc<AtomicU64> {
        debug_assert_eq!(values.len(), self.labels.len());
        let key = join(values);
        self.series.lock().entry(key).or_default().clone()
    }

    /// Appends the family in the Prometheus text format (nothing when it has no series yet).
    pub fn render(&self, out: &mut String) {
        let series: Vec<(Box<str>, u64)> = self
            .series
            .lock()
            .iter()
            .map(|(k, c)| (k.clone(), c.load(Ordering::Relaxed)))
            .collect();
        if series.is_empty() {
            return;
        }
        render_counter(out, self.name, self.labels, series);
    }
}

/// One counter family in the Prometheus text format: its help, its type, and a line per series
/// (label values joined as the families keep them).
fn render_counter<V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    labels: &[&str],
    series: Vec<(Box<str>, V)>,
) {
    write_help(out, name);
    let _ = writeln!(out, "# TYPE {name} counter");
    for (values, value) in series {
        out.push_str(name);
        for (i, (label, v)) in labels.iter().zip(split(&values)).enumerate() {
            out.push(if i == 0 { '{' } else { ',' });
            let _ = write!(out, "{label}=\"");
            escape_label_value(v, out);
            out.push('"');
        }
        if !labels.is_empty() {
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }
    out.push('\n');
}

/// A counter whose increments are fractions (spend in dollars, say): the exporter's counters count
/// whole numbers only. Recorded by the metrics actor alone, once per tenant report: a series is
/// looked up once and then added to through its [`Sum`], since building its key and finding it
/// among thousands of tenants' cost every report of a tenant with spend about 500 instructions
/// (docs/BENCHMARKS.md, "Spend budgets").
#[derive(Debug)]
pub struct SumFamily {
    name: &'static str,
    labels: &'static [&'static str],
    series: Mutex<BTreeMap<Box<str>, Sum>>,
}

/// One series of a [`SumFamily`]: its sum, as the bits of an `f64`.
#[derive(Debug, Clone, Default)]
pub struct Sum(Arc<AtomicU64>);

impl Sum {
    /// Adds `x` (ignored unless positive and finite: a counter never goes down).
    pub fn add(&self, x: f64) {
        if x.is_finite() && x > 0.0 {
            let _ = self
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                    Some((f64::from_bits(b) + x).to_bits())
                });
        }
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

impl SumFamily {
    pub fn new(name: &'static str, labels: &'static [&'static str]) -> Self {
        SumFamily {
            name,
            labels,
            series: Mutex::new(BTreeMap::new()),
        }
    }

    /// Adds `x` (ignored unless positive and finite: a counter never goes down).
    pub fn add(&self, values: &[&str], x: f64) {
        if x.is_finite() && x > 0.0 {
            self.series(values).add(x);
        }
    }

    /// The series of these label values (made at zero when new), to add to later.
    pub fn series(&self, values: &[&str]) -> Sum {
        debug_assert_eq!(values.len(), self.labels.len());
        self.series.lock().entry(join(values)).or_default().clone()
    }

    /// Appends the family in the Prometheus text format (nothing when it has no series yet).
    pub fn render(&self, out: &mut String) {
        let series: Vec<(Box<str>, f64)> = self
            .series
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.get()))
            .filter(|(_, v)| *v > 0.0)
            .collect();
        if series.is_empty() {
            return;
        }
        render_counter(out, self.name, self.labels, series);
    }
}

/// The metrics admitd keeps itself (names, labels and layouts in [`super::names`]).
#[derive(Debug)]
pub struct Histograms {
    /// `admitd_admissions_total`, the one counter recorded on every decision.
    pub admissions: CounterFamily,
    pub decision: Family,
    pub wait: Family,
    pub retry: Family,
    pub tool: Family,
    /// `admitd_store_request_seconds`: round trips to the shared store.
    pub store: Family,
    /// `admitd_spend_total`: settled spend per tenant and unit.
    pub spend: SumFamily,
}

impl Default for Histograms {
    fn default() -> Self {
        use super::names::*;
        let h = Histograms {
            admissions: CounterFamily::new(
                ADMISSIONS,
                &["tenant", "subject", "tool", "upstream", "decision", "scope"],
            ),
            decision: Family::new(DECISION_DURATION, &[], DECISION_BUCKETS),
            wait: Family::new(ADMISSION_WAIT, &["tenant", "tool"], WAIT_BUCKETS),
            retry: Family::new(RETRY_AFTER, &["tenant", "scope"], RETRY_AFTER_BUCKETS),
            tool: Family::new(
                TOOL_DURATION,
                &["tenant", "tool", "upstream"],
                TOOL_DURATION_BUCKETS,
            ),
            store: Family::new(STORE_REQUEST, &[], STORE_BUCKETS),
            spend: SumFamily::new(SPEND_TOTAL, &["tenant", "unit"]),
        };
        // Present (at zero) from the start, like the daemon-wide counters.
        h.decision.series(&[]);
        h.store.series(&[]);
        h
    }
}

impl Histograms {
    /// Appends every family in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        self.admissions.render(out);
        self.spend.render(out);
        for f in [
            &self.decision,
            &self.wait,
            &self.retry,
            &self.tool,
            &self.store,
        ] {
            f.render(out);
        }
    }
}

/// A series' label values as one string, separated by NUL (names cannot contain control characters,
/// see `config::check_name`, and the other values are admitd's own words): one allocation per series
/// instead of one per label, which is most of what a series costs with tens of thousands of them.
fn join(values: &[&str]) -> Box<str> {
    values.join("\0").into_boxed_str()
}

/// The label values [`join`] put together (zipped with the label names, so a family without labels
/// renders none).
fn split(joined: &str) -> impl Iterator<Item = &str> {
    joined.split('\0')
}

/// Appends the metric's `# HELP` line, from [`super::names::METRIC_HELP`] (help text in the text
/// format escapes `\` and newlines).
fn write_help(out: &mut String, name: &str) {
    let Some(help) = super::names::help_of(name) else {
        return;
    };
    let _ = write!(out, "# HELP {name} ");
    for c in help.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('\n');
}

/// Label values in the text format escape `\`, `"` and newlines.
fn escape_label_value(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.001, 0.01, 1.0];

    #[test]
    fn every_layout_fits_inline() {
        use crate::telemetry::names::*;
        for layout in [
            WAIT_BUCKETS,
            RETRY_AFTER_BUCKETS,
            DECISION_BUCKETS,
            TOOL_DURATION_BUCKETS,
        ] {
            assert!(layout.len() < MAX_BUCKETS, "{layout:?}");
            let h = Histogram::new(layout);
            h.record(f64::MAX);
            let (cumulative, _) = h.snapshot();
            assert_eq!(cumulative.len(), layout.len() + 1);
            assert_eq!(
                cumulative.last(),
                Some(&1),
                "the largest sample lands in +Inf"
            );
        }
    }

    #[test]
    fn counters_render_one_line_per_series_with_escaped_labels() {
        let f = CounterFamily::new("x_total", &["tenant", "scope"]);
        let mut out = String::new();
        f.render(&mut out);
        assert_eq!(out, "", "no series, nothing rendered");
        let a = f.series(&["acme", "none"]);
        a.fetch_add(2, Ordering::Relaxed);
        f.series(&["acme", "none"]).fetch_add(1, Ordering::Relaxed);
        f.series(&["we\"ird\\", "subject"])
            .fetch_add(5, Ordering::Relaxed);
        f.render(&mut out);
        assert_eq!(
            out,
            "# TYPE x_total counter\n\
             x_total{tenant=\"acme\",scope=\"none\"} 3\n\
             x_total{tenant=\"we\\\"ird\\\\\",scope=\"subject\"} 5\n\n"
        );
        let bare = CounterFamily::new("y_total", &[]);
        bare.series(&[]).fetch_add(1, Ordering::Relaxed);
        let mut out = String::new();
        bare.render(&mut out);
        assert_eq!(out, "# TYPE y_total counter\ny_total 1\n\n");
    }

    #[test]
    fn samples_land_in_the_first_bucket_whose_bound_they_do_not_exceed() {
        let h = Histogram::new(BOUNDS);
        for v in [0.0, 0.001, 0.0011, 0.5, 1.0, 7.0, 7.0] {
            h.record(v);
        }
        let (cumulative, sum) = h.snapshot();
        // le=0.001: 0 and 0.001; le=0.01: +0.0011; le=1: +0.5, 1.0; +Inf: +7, 7
        assert_eq!(cumulative, vec![2, 3, 5, 7]);
        assert!((sum - 15.5021).abs() < 1e-9, "sum {sum}");
    }

    #[test]
    fn the_text_format_is_cumulative_with_sum_count_and_escaped_labels() {
        let f = Family::new("x_seconds", &["tenant", "tool"], BOUNDS);
        assert_eq!(
            Arc::as_ptr(&f.series(&["a", "t"])),
            Arc::as_ptr(&f.series(&["a", "t"])),
            "one series per label set"
        );
        f.series(&["a", "t"]).record(0.005);
        f.series(&["a", "t"]).record(2.0);
        f.series(&["q\"\\\n", "t"]).record(0.0);
        let mut out = String::new();
        f.render(&mut out);
        let expected = "# TYPE x_seconds histogram\n\
            x_seconds_bucket{tenant=\"a\",tool=\"t\",le=\"0.001\"} 0\n\
            x_seconds_bucket{tenant=\"a\",tool=\"t\",le=\"0.01\"} 1\n\
            x_seconds_bucket{tenant=\"a\",tool=\"t\",le=\"1\"} 1\n\
            x_seconds_bucket{tenant=\"a\",tool=\"t\",le=\"+Inf\"} 2\n\
            x_seconds_sum{tenant=\"a\",tool=\"t\"} 2.005\n\
            x_seconds_count{tenant=\"a\",tool=\"t\"} 2\n\
            x_seconds_bucket{tenant=\"q\\\"\\\\\\n\",tool=\"t\",le=\"0.001\"} 1\n\
            x_seconds_bucket{tenant=\"q\\\"\\\\\\n\",tool=\"t\",le=\"0.01\"} 1\n\
            x_seconds_bucket{tenant=\"q\\\"\\\\\\n\",tool=\"t\",le=\"1\"} 1\n\
            x_seconds_bucket{tenant=\"q\\\"\\\\\\n\",tool=\"t\",le=\"+Inf\"} 1\n\
            x_seconds_sum{tenant=\"q\\\"\\\\\\n\",tool=\"t\"} 0\n\
            x_seconds_count{tenant=\"q\\\"\\\\\\n\",tool=\"t\"} 1\n\n";
        assert_eq!(out, expected);
    }

    #[test]
    fn a_family_without_labels_renders_bare_sum_and_count_and_an_empty_one_renders_nothing() {
        let f = Family::new("d_seconds", &[], BOUNDS);
        let mut out = String::new();
        f.render(&mut out);
        assert_eq!(out, "");
        f.series(&[]).record(0.01);
        f.render(&mut out);
        assert!(out.contains("d_seconds_bucket{le=\"0.01\"} 1\n"), "{out}");
        assert!(out.contains("d_seconds_sum 0.01\n"), "{out}");
        assert!(out.contains("d_seconds_count 1\n"), "{out}");
    }

    #[test]
    fn a_sum_adds_through_its_series_handle_and_a_series_still_at_zero_is_not_shown() {
        let f = SumFamily::new("s_total", &["tenant", "unit"]);
        let usd = f.series(&["a", "usd"]);
        let _tokens = f.series(&["a", "tokens"]);
        let mut out = String::new();
        f.render(&mut out);
        assert_eq!(out, "", "a series nothing was added to");
        usd.add(0.25);
        usd.add(f64::NAN);
        usd.add(-1.0);
        f.add(&["a", "usd"], 0.5);
        f.render(&mut out);
        assert!(
            out.contains("s_total{tenant=\"a\",unit=\"usd\"} 0.75\n"),
            "{out}"
        );
        assert!(!out.contains("tokens"), "{out}");
    }
}
