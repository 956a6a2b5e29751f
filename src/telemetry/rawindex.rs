//! The metrics actor's index of series by the labels a call arrived with: decisions, and (in an index
//! of their own, keyed by [`RawRef::call`]) lease expiries.
//!
//! A decision event names its tenant, subject, tool and upstream as the caller sent them; the metrics
//! actor needs the (capped) series they count into. Looking that up is the telemetry thread's main
//! work, and with tens of thousands of live series nearly every lookup misses the CPU caches several
//! times: the slot, the entry, then the counter and histogram it adds to. Events arrive in batches,
//! so this index is built for looking up a whole batch in stages ([`RawIndex::prefetch_slot`], then
//! [`RawIndex::prefetch_entry`], then [`RawIndex::find`]), each stage asking for the memory the next
//! one reads. The misses of a batch then overlap instead of stalling one after another.
//!
//! Layout: open addressing with linear probing over small slots (the full hash and an entry number,
//! four to a cache line), entries in a vector in insertion order. Entries are never removed one by
//! one, only all at once ([`RawIndex::clear`]), so probing needs no tombstones and an entry's number
//! stays valid until the next clear.

use std::hash::{BuildHasher, Hash};

use smallvec::SmallVec;

use super::{DecisionEvent, DecisionKind};
use crate::engine::Scope;
use crate::prefetch::prefetch;

/// Bytes of a [`RawKey`]'s names kept inline; longer keys spill to the heap.
const RAW_INLINE: usize = 46;

/// A decision's label values as the caller sent them (before capping), with its outcome.
///
/// The four names are stored together (each followed by 0xff, a byte no UTF-8 string contains), so a
/// lookup compares one run of bytes inside the entry rather than four separately allocated names.
/// Keys are made only when an entry is added; lookups use a [`RawRef`], which borrows the names.
#[derive(PartialEq, Eq)]
pub struct RawKey {
    names: SmallVec<[u8; RAW_INLINE]>,
    kind: DecisionKind,
    scope: Option<Scope>,
}

/// The labels of an event, borrowed from it, to look them up: nothing is copied until a key is
/// added ([`RawRef::to_key`]).
pub struct RawRef<'a> {
    names: [&'a str; 4],
    kind: DecisionKind,
    scope: Option<Scope>,
}

impl Hash for RawRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // Each name ends with 0xff, so "ab" + "c" and "a" + "bc" hash differently.
        for name in self.names {
            h.write(name.as_bytes());
            h.write_u8(0xff);
        }
        self.kind.hash(h);
        self.scope.hash(h);
    }
}

impl<'a> RawRef<'a> {
    pub fn of(d: &'a DecisionEvent) -> Self {
        RawRef {
            kind: d.kind,
            scope: d.scope,
            ..RawRef::call(&d.tenant, &d.subject_label, &d.tool, d.upstream.as_deref())
        }
    }

    /// The labels of a call alone, with no outcome: for indexes of something other than decisions
    /// (which must not share an index with decisions, whose keys this one could equal).
    pub fn call(
        tenant: &'a str,
        subject: &'a str,
        tool: &'a str,
        upstream: Option<&'a str>,
    ) -> Self {
        RawRef {
            names: [tenant, subject, tool, upstream.unwrap_or("")],
            kind: DecisionKind::Admitted,
            scope: None,
        }
    }

    pub fn to_key(&self) -> RawKey {
        let mut names = SmallVec::with_capacity(self.names.iter().map(|n| n.len() + 1).sum());
        for name in self.names {
            names.extend_from_slice(name.as_bytes());
            names.push(0xff);
        }
        RawKey {
            names,
            kind: self.kind,
            scope: self.scope,
        }
    }

    fn matches(&self, k: &RawKey) -> bool {
        if self.kind != k.kind || self.scope != k.scope {
            return false;
        }
        let mut rest = &k.names[..];
        for name in self.names {
            let n = name.len();
            if rest.len() <= n || rest[n] != 0xff || &rest[..n] != name.as_bytes() {
                return false;
            }
            rest = &rest[n + 1..];
        }
        rest.is_empty()
    }
}

#[derive(Clone, Copy, Default)]
struct Slot {
    hash: u64,
    /// The entry's number plus one; 0 marks an empty slot.
    entry: u32,
}

/// Values by [`RawKey`], with staged lookups (see the module documentation).
pub struct RawIndex<V> {
    slots: Vec<Slot>,
    entries: Vec<(u64, RawKey, V)>,
    hasher: foldhash::fast::RandomState,
}

impl<V> Default for RawIndex<V> {
    fn default() -> Self {
        RawIndex {
            slots: Vec::new(),
            entries: Vec::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }
}

impl<V> RawIndex<V> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Drops every entry (entry numbers handed out before are invalid afterwards).
    pub fn clear(&mut self) {
        self.slots = Vec::new();
        self.entries = Vec::new();
    }

    pub fn hash(&self, r: &RawRef<'_>) -> u64 {
        self.hasher.hash_one(r)
    }

    fn home(&self, hash: u64) -> usize {
        hash as usize & (self.slots.len() - 1)
    }

    /// Stage one: start loading the slot `hash` probes first.
    pub fn prefetch_slot(&self, hash: u64) {
        if !self.slots.is_empty() {
            prefetch(&raw const self.slots[self.home(hash)]);
        }
    }

    /// The first entry on `hash`'s probe sequence stored under that exact hash and accepted by
    /// `accept`.
    fn probe(&self, hash: u64, accept: impl Fn(usize) -> bool) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(hash);
        loop {
            let s = self.slots[i];
            if s.entry == 0 {
                return None;
            }
            let e = s.entry as usize - 1;
            if s.hash == hash && accept(e) {
                return Some(e);
            }
            i = (i + 1) & mask;
        }
    }

    /// Stage two: read the slot and start loading the entry it points to (reading only slots, not
    /// entries, so the first entry with the same hash; a different key with the same 64-bit hash
    /// only costs a useless prefetch).
    pub fn prefetch_entry(&self, hash: u64) {
        if let Some(e) = self.probe(hash, |_| true) {
            prefetch(&raw const self.entries[e]);
        }
    }

    /// Stage three: the entry number of `r`, whose hash is `hash`.
    pub fn find(&self, hash: u64, r: &RawRef<'_>) -> Option<usize> {
        self.probe(hash, |e| r.matches(&self.entries[e].1))
    }

    pub fn get(&self, entry: usize) -> &V {
        &self.entries[entry].2
    }

    /// Adds a key that is not in the index (callers [`RawIndex::find`] first); returns its number.
    pub fn insert(&mut self, hash: u64, key: RawKey, value: V) -> usize {
        // At most three quarters full, so probe sequences stay short.
        if (self.entries.len() + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let e = self.entries.len();
        self.entries.push((hash, key, value));
        self.place(hash, e);
        e
    }

    fn place(&mut self, hash: u64, entry: usize) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(hash);
        while self.slots[i].entry != 0 {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot {
            hash,
            entry: entry as u32 + 1,
        };
    }

    fn grow(&mut self) {
        let n = (self.slots.len() * 2).max(64);
        self.slots = vec![Slot::default(); n];
        for e in 0..self.entries.len() {
            self.place(self.entries[e].0, e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn event(tenant: &str, subject: &str, upstream: Option<&str>) -> DecisionEvent {
        DecisionEvent {
            tenant: Arc::from(tenant),
            subject: Arc::from(subject),
            subject_label: Arc::from(subject),
            tool: Arc::from("search"),
            upstream: upstream.map(Arc::from),
            cost: 1.0,
            kind: DecisionKind::Admitted,
            scope: None,
            retryable: false,
            waited_ns: 0,
            retry_after_ms: 0,
            decision_ns: 0,
            call_id: None,
            lease: 0,
            unchecked: false,
            span: None,
        }
    }

    #[test]
    fn finds_what_was_inserted_and_nothing_else_across_growth() {
        let mut idx = RawIndex::default();
        let events: Vec<DecisionEvent> = (0..5000)
            .map(|i| event(&format!("t{}", i % 7), &format!("s{i}"), None))
            .collect();
        let keys: Vec<RawRef> = events.iter().map(RawRef::of).collect();
        for (i, r) in keys.iter().enumerate() {
            let h = idx.hash(r);
            assert_eq!(idx.find(h, r), None);
            assert_eq!(idx.insert(h, r.to_key(), i), i);
        }
        assert_eq!(idx.len(), 5000);
        for (i, r) in keys.iter().enumerate() {
            let h = idx.hash(r);
            idx.prefetch_slot(h);
            idx.prefetch_entry(h);
            assert_eq!(idx.find(h, r).map(|e| *idx.get(e)), Some(i));
        }
        let other = event("t1", "s1", Some("crm"));
        let absent = RawRef::of(&other);
        assert_eq!(idx.find(idx.hash(&absent), &absent), None);
        idx.clear();
        assert_eq!(idx.len(), 0);
        assert_eq!(idx.find(idx.hash(&keys[0]), &keys[0]), None);
        idx.prefetch_slot(0);
        idx.prefetch_entry(0);
    }

    #[test]
    fn names_cannot_run_into_each_other() {
        // "ab" + "c" and "a" + "bc" are different keys, with different hashes.
        let (ab_c, a_bc) = (event("ab", "c", None), event("a", "bc", None));
        let (a, b) = (RawRef::of(&ab_c), RawRef::of(&a_bc));
        assert!(!a.matches(&b.to_key()));
        assert!(!b.matches(&a.to_key()));
        assert!(a.matches(&a.to_key()));
        let idx = RawIndex::<()>::default();
        assert_ne!(idx.hash(&a), idx.hash(&b));
        // A key is told from one with a name more or less, and from another outcome.
        let short = RawRef::call("ab", "c", "search", None);
        assert!(a.matches(&short.to_key()));
        assert!(!RawRef::call("ab", "c", "searc", None).matches(&a.to_key()));
        assert!(!RawRef::call("ab", "c", "search", Some("u")).matches(&a.to_key()));
        let mut shed = event("ab", "c", None);
        shed.kind = DecisionKind::Shed;
        assert!(!RawRef::of(&shed).matches(&a.to_key()));
        let (none, empty) = (event("a", "b", None), event("a", "b", Some("")));
        // An empty upstream name is refused at the API, so the two may share a key.
        assert!(RawRef::of(&none).matches(&RawRef::of(&empty).to_key()));
    }

    #[test]
    fn equal_hashes_are_told_apart_by_the_key() {
        let mut idx = RawIndex::default();
        let (alice, bob, carol) = (
            event("t", "alice", None),
            event("t", "bob", None),
            event("t", "carol", None),
        );
        let (a, b) = (RawRef::of(&alice), RawRef::of(&bob));
        // Force a collision: both under the same hash.
        idx.insert(42, a.to_key(), "a");
        idx.insert(42, b.to_key(), "b");
        assert_eq!(idx.find(42, &a).map(|e| *idx.get(e)), Some("a"));
        assert_eq!(idx.find(42, &b).map(|e| *idx.get(e)), Some("b"));
        let c = RawRef::of(&carol);
        assert_eq!(idx.find(42, &c), None);
    }
}
