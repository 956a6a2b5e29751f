//! Label cardinality caps.
//!
//! Tenants, subjects, tools and upstreams are caller-supplied strings, so a label per value would let one
//! misbehaving client grow the metric registry without bound. Each tenant may introduce at most
//! `max_subjects_per_tenant` subject values, and all tenants together at most `max_subjects_total`
//! (later ones are reported as `__other__`); tenants, tools and upstreams have fixed caps of their own.
//! The number of series is therefore bounded however many distinct names appear. A value keeps its
//! label once admitted, so series never flip between a name and `__other__`.

use std::sync::Arc;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

use super::names::OTHER;

/// Fixed caps for the other caller-supplied labels.
pub const MAX_TENANTS: usize = 10_000;
pub const MAX_TOOLS_PER_TENANT: usize = 256;
pub const MAX_UPSTREAMS: usize = 256;

#[derive(Debug, Default)]
struct TenantLabels {
    subjects: HashSet<Arc<str>>,
    tools: HashSet<Arc<str>>,
}

/// Decides which label value each name gets.
#[derive(Debug)]
pub struct LabelCap {
    max_subjects: usize,
    max_subjects_total: usize,
    subjects_total: usize,
    tenants: HashMap<Arc<str>, TenantLabels>,
    upstreams: HashSet<Arc<str>>,
    other: Arc<str>,
}

fn admit(set: &mut HashSet<Arc<str>>, value: &Arc<str>, cap: usize, other: &Arc<str>) -> Arc<str> {
    if set.contains(value) {
        value.clone()
    } else if set.len() < cap {
        set.insert(value.clone());
        value.clone()
    } else {
        other.clone()
    }
}

impl LabelCap {
    pub fn new(max_subjects: usize, max_subjects_total: usize) -> Self {
        LabelCap {
            max_subjects,
            max_subjects_total,
            subjects_total: 0,
            tenants: HashMap::default(),
            upstreams: HashSet::default(),
            other: Arc::from(OTHER),
        }
    }

    pub fn set_max_subjects(&mut self, max_subjects: usize, max_subjects_total: usize) {
        self.max_subjects = max_subjects;
        self.max_subjects_total = max_subjects_total;
    }

    /// The tenant label.
    pub fn tenant(&mut self, tenant: &Arc<str>) -> Arc<str> {
        if self.tenants.contains_key(tenant) {
            return tenant.clone();
        }
        if self.tenants.len() < MAX_TENANTS {
            self.tenants.insert(tenant.clone(), TenantLabels::default());
            tenant.clone()
        } else {
            self.other.clone()
        }
    }

    /// The (tenant, subject, tool) labels of a call.
    pub fn call(
        &mut self,
        tenant: &Arc<str>,
        subject: &Arc<str>,
        tool: &Arc<str>,
    ) -> (Arc<str>, Arc<str>, Arc<str>) {
        let t = self.tenant(tenant);
        let other = self.other.clone();
        let room = self.subjects_total < self.max_subjects_total;
        let max_subjects = if room { self.max_subjects } else { 0 };
        let labels = self.tenants.entry(t.clone()).or_default();
        let before = labels.subjects.len();
        let s = if labels.subjects.contains(subject) {
            subject.clone()
        } else {
            admit(&mut labels.subjects, subject, max_subjects, &other)
        };
        self.subjects_total += labels.subjects.len() - before;
        let tl = admit(&mut labels.tools, tool, MAX_TOOLS_PER_TENANT, &other);
        (t, s, tl)
    }

    /// The upstream label (`none` is passed through by the caller).
    pub fn upstream(&mut self, upstream: &Arc<str>) -> Arc<str> {
        let other = self.other.clone();
        admit(&mut self.upstreams, upstream, MAX_UPSTREAMS, &other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn subjects_past_the_cap_fold_into_other_and_known_ones_keep_their_name() {
        let mut c = LabelCap::new(3, 1_000);
        let t = a("acme");
        let tool = a("search");
        for i in 0..3 {
            assert_eq!(&*c.call(&t, &a(&format!("s{i}")), &tool).1, format!("s{i}"));
        }
        assert_eq!(&*c.call(&t, &a("s3"), &tool).1, OTHER);
        assert_eq!(&*c.call(&t, &a("s999"), &tool).1, OTHER);
        assert_eq!(&*c.call(&t, &a("s1"), &tool).1, "s1");
        // the cap is per tenant
        assert_eq!(&*c.call(&a("globex"), &a("s3"), &tool).1, "s3");
    }

    #[test]
    fn all_tenants_together_introduce_at_most_max_subjects_total() {
        let mut c = LabelCap::new(100, 5);
        let tool = a("search");
        let mut named = 0;
        for t in 0..4 {
            for s in 0..3 {
                if &*c.call(&a(&format!("t{t}")), &a(&format!("s{s}")), &tool).1 != OTHER {
                    named += 1;
                }
            }
        }
        assert_eq!(named, 5);
        // a subject that got its name keeps it
        assert_eq!(&*c.call(&a("t0"), &a("s0"), &tool).1, "s0");
    }

    #[test]
    fn tools_and_upstreams_are_capped_too() {
        let mut c = LabelCap::new(10, 1_000);
        let t = a("acme");
        let s = a("s");
        for i in 0..MAX_TOOLS_PER_TENANT {
            assert_ne!(&*c.call(&t, &s, &a(&format!("tool{i}"))).2, OTHER);
        }
        assert_eq!(&*c.call(&t, &s, &a("one-more")).2, OTHER);
        for i in 0..MAX_UPSTREAMS {
            assert_ne!(&*c.upstream(&a(&format!("u{i}"))), OTHER);
        }
        assert_eq!(&*c.upstream(&a("late")), OTHER);
    }

    #[test]
    fn a_zero_cap_reports_every_subject_as_other() {
        let mut c = LabelCap::new(0, 1_000);
        assert_eq!(&*c.call(&a("t"), &a("s"), &a("x")).1, OTHER);
    }
}
