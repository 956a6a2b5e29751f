//! The live leases of one tenant: a slab addressed by the lease number itself.
//!
//! A lease number is `(sequence << 32) | slot`. Finding a lease is an index into a vector plus a check
//! that the slot still holds that very number (a stale or forged number finds nothing), so admission
//! and release never hash or probe. Freed slots are reused last-in first-out: under the usual pattern
//! (admit, run the tool, release) the next admission writes into memory that is still in cache.
//!
//! Why not a hash map: lease numbers churn like a queue (new ones in, old ones out), which leaves a
//! hash table full of tombstones that every insertion probes through; on a loaded worker with leases
//! held until their TTL that probing cost 5% of all CPU time. A B-tree was measured too and was worse
//! (one cold node per level, per tenant).
//!
//! Memory follows the most leases that were live at once; once none are, a large slab is given back.

use crate::prefetch::prefetch_all;

/// Slots a slab may keep after its last lease ends; larger slabs are freed then.
const KEEP_SLOTS: usize = 1024;

struct Slot<T> {
    id: u64,
    value: Option<T>,
}

pub struct Leases<T> {
    slots: Vec<Slot<T>>,
    /// Free slot indexes, most recently freed last.
    free: Vec<u32>,
    live: usize,
    /// The high half of the next lease number.
    seq: u32,
}

impl<T> Leases<T> {
    /// An empty slab whose numbers start from `seed` (so numbers differ between tenants and runs).
    pub fn new(seed: u64) -> Self {
        Leases {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            seq: (seed >> 32) as u32,
        }
    }

    /// Stores a lease; returns its number. (2^32 live leases, the most a slot index can name, would
    /// take hundreds of gigabytes: memory runs out long before the index does.)
    pub fn insert(&mut self, value: T) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.slots.push(Slot { id: 0, value: None });
                self.slots.len() - 1
            }
        };
        self.seq = self.seq.wrapping_add(1);
        let id = (u64::from(self.seq) << 32) | index as u64;
        // A free slot holds no value, so there is nothing to drop: `forget` lets the old contents go
        // unread. When leases end by expiry the slot was last touched a second or more ago, and
        // reading it (to drop it) stalled the admission on a cache miss; a store does not.
        std::mem::forget(std::mem::replace(
            &mut self.slots[index],
            Slot {
                id,
                value: Some(value),
            },
        ));
        self.live += 1;
        id
    }

    /// Starts loading the slot the next [`Leases::insert`] will write (a hint, see
    /// [`crate::prefetch`]).
    pub fn prefetch_next(&self) {
        let index = self.free.last().map_or(self.slots.len(), |&i| i as usize);
        prefetch_all(self.slots.as_ptr().wrapping_add(index));
    }

    fn slot(&self, id: u64) -> Option<&Slot<T>> {
        self.slots
            .get((id & u64::from(u32::MAX)) as usize)
            .filter(|s| s.id == id && s.value.is_some())
    }

    pub fn get(&self, id: u64) -> Option<&T> {
        self.slot(id).and_then(|s| s.value.as_ref())
    }

    pub fn remove(&mut self, id: u64) -> Option<T> {
        let index = (id & u64::from(u32::MAX)) as usize;
        let slot = self.slots.get_mut(index).filter(|s| s.id == id)?;
        let value = slot.value.take()?;
        self.live -= 1;
        if self.live == 0 && self.slots.len() > KEEP_SLOTS {
            self.slots = Vec::new();
            self.free = Vec::new();
        } else {
            self.free.push(index as u32);
        }
        Some(value)
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        self.slots
            .iter()
            .filter_map(|s| s.value.as_ref().map(|v| (s.id, v)))
    }

    /// Slots held, live or free (what the slab costs in memory, in units of one lease).
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_find_their_lease_and_only_theirs() {
        let mut l = Leases::new(7 << 32);
        let a = l.insert("a");
        let b = l.insert("b");
        assert_ne!(a, b);
        assert_eq!(l.get(a), Some(&"a"));
        assert_eq!(l.get(b), Some(&"b"));
        assert_eq!(l.len(), 2);
        assert_eq!(l.remove(a), Some("a"));
        assert_eq!(l.remove(a), None, "a lease ends once");
        assert_eq!(l.get(a), None);
        // The freed slot is reused, under a new number: the old number must not reach the new lease.
        let c = l.insert("c");
        assert_eq!(c & 0xffff_ffff, a & 0xffff_ffff, "slot reused");
        assert_ne!(c, a);
        assert_eq!(l.get(a), None);
        assert_eq!(l.remove(a), None);
        assert_eq!(l.get(c), Some(&"c"));
        assert_eq!(l.len(), 2);
        let mut all: Vec<_> = l.iter().map(|(id, v)| (id, *v)).collect();
        all.sort();
        let mut want = vec![(b, "b"), (c, "c")];
        want.sort();
        assert_eq!(all, want);
    }

    #[test]
    fn forged_and_out_of_range_numbers_find_nothing() {
        let mut l = Leases::new(0);
        let a = l.insert(1);
        for forged in [0, a + 1, a ^ (1 << 40), u64::MAX, a | 0xffff] {
            assert_eq!(l.get(forged), None, "{forged:x}");
            assert_eq!(l.remove(forged), None, "{forged:x}");
        }
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn a_large_slab_is_given_back_when_its_last_lease_ends() {
        let mut l = Leases::new(0);
        let ids: Vec<u64> = (0..5000).map(|i| l.insert(i)).collect();
        assert_eq!(l.capacity(), 5000);
        for id in &ids[1..] {
            l.remove(*id);
        }
        assert_eq!(l.capacity(), 5000, "kept while a lease is live");
        assert_eq!(l.remove(ids[0]), Some(0));
        assert!(l.is_empty());
        assert_eq!(l.capacity(), 0);
        // Old numbers stay dead after the reset, even where a new lease takes the same slot.
        let n = l.insert(9);
        assert_eq!(l.get(ids[0]), None);
        assert_eq!(l.get(n), Some(&9));
    }

    #[test]
    fn slots_are_reused_so_memory_follows_the_live_count() {
        let mut l = Leases::new(0);
        for round in 0..100 {
            let ids: Vec<u64> = (0..10).map(|i| l.insert(round * 10 + i)).collect();
            for id in ids {
                assert!(l.remove(id).is_some());
            }
        }
        assert_eq!(l.capacity(), 10);
    }
}
