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
//! engine ([`SubjectLabels`], shared by all of them, defined in the engine): the first `max_subjects_per_tenant` subjects to
//! call are the ones named. The metrics actor could not decide that itself, because events reach it in
//! batches from several worker threads, not in the order the calls came. The other caps
//! ([`LabelCap`]) are the metrics actor's.

use std::sync::Arc;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

use super::names::OTHER;
pub use crate::engine::labels::{SubjectLabels, MAX_TENANTS};

/// Fixed caps for the other caller-supplied labels.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Arc<str> {
        Arc::from(s)
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
}
