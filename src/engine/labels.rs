//! Which subjects keep their own name in metric labels, decided by the tenant engines as calls arrive.
//!
//! Subjects are caller-supplied strings, so a label per subject would let one misbehaving client grow
//! the metric registry without bound: each tenant may name at most `max_subjects_per_tenant` subjects,
//! all tenants together at most `max_subjects_total`; later ones are `__other__`. The decision is the
//! engine's because it must follow the order a tenant's calls arrive in, which only the tenant's engine
//! sees (telemetry gets its events in batches from several threads). Telemetry reads the labels the
//! engine decided; the engine knows nothing of telemetry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// The label value for a subject past the cardinality caps (and for any other capped label).
pub const OTHER: &str = "__other__";

/// At most this many tenants name their subjects (and get a tenant label of their own).
pub const MAX_TENANTS: usize = 10_000;

/// The subject label of every tenant's calls, decided by the tenant actors as calls arrive. A tenant
/// actor asks once per subject it holds state for (it keeps the answer in the subject's state), so
/// the lock is taken when a subject is new to the actor, not on every call.
#[derive(Debug)]
pub struct SubjectLabels {
    sets: Mutex<SubjectSets>,
    /// Bumped when the caps change: a subject folded under the old caps asks again.
    generation: AtomicU64,
    other: Arc<str>,
}

#[derive(Debug)]
struct SubjectSets {
    max_per_tenant: usize,
    max_total: usize,
    total: usize,
    tenants: HashMap<Arc<str>, HashSet<Arc<str>>>,
}

impl SubjectLabels {
    pub fn new(max_per_tenant: usize, max_total: usize) -> Self {
        SubjectLabels {
            sets: Mutex::new(SubjectSets {
                max_per_tenant,
                max_total,
                total: 0,
                tenants: HashMap::default(),
            }),
            generation: AtomicU64::new(0),
            other: Arc::from(OTHER),
        }
    }

    /// New caps (a reload). Subjects already named keep their names.
    pub fn set_caps(&self, max_per_tenant: usize, max_total: usize) {
        let mut s = self.sets.lock();
        if (s.max_per_tenant, s.max_total) != (max_per_tenant, max_total) {
            s.max_per_tenant = max_per_tenant;
            s.max_total = max_total;
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Changes whenever the caps do.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// The folded label, `__other__`.
    pub fn other(&self) -> &Arc<str> {
        &self.other
    }

    /// Whether `label` is the folded one (`__other__`).
    pub fn is_other(&self, label: &Arc<str>) -> bool {
        Arc::ptr_eq(label, &self.other)
    }

    /// The label of `subject`'s calls in `tenant`: its own name while there is room, else
    /// `__other__`. Past [`MAX_TENANTS`] tenants with named subjects, a new tenant's are all folded.
    pub fn label(&self, tenant: &Arc<str>, subject: &Arc<str>) -> Arc<str> {
        let mut guard = self.sets.lock();
        let s = &mut *guard;
        if let Some(set) = s.tenants.get(tenant) {
            if set.contains(subject) {
                return subject.clone();
            }
        }
        let known_tenant = s.tenants.contains_key(tenant);
        let per_tenant = s
            .tenants
            .get(tenant)
            .map_or(0, std::collections::HashSet::len);
        if s.total >= s.max_total
            || per_tenant >= s.max_per_tenant
            || (!known_tenant && s.tenants.len() >= MAX_TENANTS)
        {
            return self.other.clone();
        }
        s.tenants
            .entry(tenant.clone())
            .or_default()
            .insert(subject.clone());
        s.total += 1;
        subject.clone()
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
        let c = SubjectLabels::new(3, 1_000);
        let t = a("acme");
        for i in 0..3 {
            assert_eq!(&*c.label(&t, &a(&format!("s{i}"))), format!("s{i}"));
        }
        let folded = c.label(&t, &a("s3"));
        assert_eq!(&*folded, OTHER);
        assert!(c.is_other(&folded));
        assert_eq!(&*c.label(&t, &a("s999")), OTHER);
        assert_eq!(&*c.label(&t, &a("s1")), "s1");
        assert!(!c.is_other(&c.label(&t, &a("s1"))));
        // the cap is per tenant
        assert_eq!(&*c.label(&a("globex"), &a("s3")), "s3");
    }

    #[test]
    fn all_tenants_together_introduce_at_most_max_subjects_total() {
        let c = SubjectLabels::new(100, 5);
        let mut named = 0;
        for t in 0..4 {
            for s in 0..3 {
                if &*c.label(&a(&format!("t{t}")), &a(&format!("s{s}"))) != OTHER {
                    named += 1;
                }
            }
        }
        assert_eq!(named, 5);
        // a subject that got its name keeps it
        assert_eq!(&*c.label(&a("t0"), &a("s0")), "s0");
    }

    #[test]
    fn raising_the_caps_makes_room_and_says_so_by_a_new_generation() {
        let c = SubjectLabels::new(1, 1_000);
        let t = a("acme");
        assert_eq!(&*c.label(&t, &a("alice")), "alice");
        assert_eq!(&*c.label(&t, &a("bob")), OTHER);
        let g = c.generation();
        c.set_caps(1, 1_000);
        assert_eq!(c.generation(), g, "the same caps are no change");
        c.set_caps(2, 1_000);
        assert_ne!(c.generation(), g);
        assert_eq!(&*c.label(&t, &a("bob")), "bob");
        assert_eq!(&*c.label(&t, &a("carol")), OTHER);
        // lowering the caps takes no name away
        c.set_caps(0, 1_000);
        assert_eq!(&*c.label(&t, &a("alice")), "alice");
    }

    #[test]
    fn a_zero_cap_reports_every_subject_as_other() {
        let c = SubjectLabels::new(0, 1_000);
        assert_eq!(&*c.label(&a("t"), &a("s")), OTHER);
    }
}
