//! Label cardinality caps.
//!
//! Tenants, subjects, tools and upstreams are caller-supplied strings, so a label per value would let one
//! misbehaving client grow the metric registry without bound. Each tenant may introduce at most
//! `max_subjects_per_tenant` subject values, and all tenants together at most `max_subjects_total`
//! (later ones are reported as `__other__`); tenants, tools and upstreams have fixed caps of their own.
//! The number of series is therefore bounded however many distinct names appear. A value keeps its
//! label once admitted, so series never flip between a name and `__other__`.
//!
//! Which subjects keep their name is decided in the order the tenant's calls arrive, by the tenant's
//! actor ([`SubjectLabels`], shared by all of them): the first `max_subjects_per_tenant` subjects to
//! call are the ones named. The metrics actor could not decide that itself, because events reach it in
//! batches from several worker threads, not in the order the calls came. The other caps
//! ([`LabelCap`]) are the metrics actor's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

use super::names::OTHER;

/// Fixed caps for the other caller-supplied labels.
pub const MAX_TENANTS: usize = 10_000;
pub const MAX_TOOLS_PER_TENANT: usize = 256;
pub const MAX_UPSTREAMS: usize = 256;

/// Decides the tenant, tool and upstream label values (the subject's comes decided with the event).
#[derive(Debug)]
pub struct LabelCap {
    tenants: HashMap<Arc<str>, HashSet<Arc<str>>>,
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

impl Default for LabelCap {
    fn default() -> Self {
        LabelCap {
            tenants: HashMap::default(),
            upstreams: HashSet::default(),
            other: Arc::from(OTHER),
        }
    }
}

impl LabelCap {
    /// The tenant label.
    pub fn tenant(&mut self, tenant: &Arc<str>) -> Arc<str> {
        if self.tenants.contains_key(tenant) {
            return tenant.clone();
        }
        if self.tenants.len() < MAX_TENANTS {
            self.tenants.insert(tenant.clone(), HashSet::default());
            tenant.clone()
        } else {
            self.other.clone()
        }
    }

    /// The (tenant, subject, tool) labels of a call whose subject label is already decided.
    pub fn call(
        &mut self,
        tenant: &Arc<str>,
        subject_label: &Arc<str>,
        tool: &Arc<str>,
    ) -> (Arc<str>, Arc<str>, Arc<str>) {
        let t = self.tenant(tenant);
        let other = self.other.clone();
        let tools = self.tenants.entry(t.clone()).or_default();
        let tl = admit(tools, tool, MAX_TOOLS_PER_TENANT, &other);
        (t, subject_label.clone(), tl)
    }

    /// The upstream label (`none` is passed through by the caller).
    pub fn upstream(&mut self, upstream: &Arc<str>) -> Arc<str> {
        let other = self.other.clone();
        admit(&mut self.upstreams, upstream, MAX_UPSTREAMS, &other)
    }
}

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
        let per_tenant = s.tenants.get(tenant).map_or(0, |set| set.len());
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
    fn tools_and_upstreams_are_capped_too() {
        let mut c = LabelCap::default();
        let t = a("acme");
        let s = a("s");
        for i in 0..MAX_TOOLS_PER_TENANT {
            assert_ne!(&*c.call(&t, &s, &a(&format!("tool{i}"))).2, OTHER);
        }
        assert_eq!(&*c.call(&t, &s, &a("one-more")).2, OTHER);
        assert_eq!(&*c.call(&t, &s, &a("tool7")).2, "tool7");
        for i in 0..MAX_UPSTREAMS {
            assert_ne!(&*c.upstream(&a(&format!("u{i}"))), OTHER);
        }
        assert_eq!(&*c.upstream(&a("late")), OTHER);
    }

    #[test]
    fn a_zero_cap_reports_every_subject_as_other() {
        let c = SubjectLabels::new(0, 1_000);
        assert_eq!(&*c.label(&a("t"), &a("s")), OTHER);
    }
}
