//! Shared copies of the tool and upstream names calls use, one set per thread for every tenant
//! engine on it.
//!
//! A deployment has few such names, and a set per tenant put two or three cache misses on every
//! admission (the tenant's table, then the name's count) where one small set that every call uses
//! stays in cache. A call then does not allocate its names either (nor free them on the telemetry
//! thread, the last to drop them). What it bought, with 1 000 tenants: last-level read misses per
//! admission 64.3 → 60.4 under callgrind's cache model (`scripts/profile.sh`; docs/BENCHMARKS.md,
//! "Choices we made and why").
//!
//! What it assumes: few distinct names (past [`NameSet::CAP`] a set starts over, which costs copies,
//! never correctness: names still in use stay alive where they are used), and that a tenant engine
//! runs on one thread (an engine elsewhere gets copies of its own, equal but not shared).

use std::cell::RefCell;
use std::sync::Arc;

use compact_str::CompactString;

/// A bounded set of shared name copies.
#[derive(Default)]
pub(super) struct NameSet {
    names: hashbrown::HashMap<CompactString, Arc<str>, foldhash::fast::RandomState>,
}

thread_local! {
    static NAME_SET: RefCell<NameSet> = RefCell::new(NameSet::default());
}

/// This thread's shared copy of a tool or upstream name.
pub(super) fn intern(name: &str) -> Arc<str> {
    NAME_SET.with(|set| set.borrow_mut().intern(name))
}

impl NameSet {
    /// Names one set keeps, at most.
    pub(super) const CAP: usize = 4096;

    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(a) = self.names.get(name) {
            return a.clone();
        }
        if self.names.len() >= Self::CAP {
            self.names.clear();
        }
        let a: Arc<str> = Arc::from(name);
        self.names.insert(CompactString::from(name), a.clone());
        a
    }
}

#[cfg(test)]
mod tests {
    use super::super::TenantEngine;
    use super::*;
    use crate::engine::test_support::{call, harness};

    #[test]
    fn tenants_on_one_thread_share_the_names_of_tools_and_upstreams() {
        let (_clock, cfg, shared) = harness("", 0);
        let mut a = TenantEngine::new(Arc::from("a"), cfg.clone(), shared.clone(), 1);
        let mut b = TenantEngine::new(Arc::from("b"), cfg, shared, 2);
        let mut req = call("s", "search");
        req.upstream = Some("warehouse".into());
        let (ra, rb) = (a.resolve(&req), b.resolve(&req));
        assert!(Arc::ptr_eq(&ra.tool, &rb.tool));
        assert!(Arc::ptr_eq(&ra.upstreams[0].0, &rb.upstreams[0].0));
        assert_eq!((&*ra.tool, &*ra.upstreams[0].0), ("search", "warehouse"));
        // Another thread keeps a set of its own.
        let there = std::thread::spawn(|| intern("search")).join().unwrap();
        assert!(!Arc::ptr_eq(&there, &ra.tool));
        assert_eq!(&*there, "search");
    }

    #[test]
    fn the_set_is_bounded_and_names_in_use_outlive_it() {
        let mut set = NameSet::default();
        let kept = set.intern("kept-name");
        assert!(Arc::ptr_eq(&kept, &set.intern("kept-name")));
        for i in 0..NameSet::CAP {
            set.intern(&format!("name-{i}"));
            assert!(set.names.len() <= NameSet::CAP);
        }
        // The set started over on the way: the name in use is still whole, and a new copy is made.
        assert_eq!(&*kept, "kept-name");
        assert!(!Arc::ptr_eq(&kept, &set.intern("kept-name")));
        assert!(set.names.len() <= NameSet::CAP);
    }
}
