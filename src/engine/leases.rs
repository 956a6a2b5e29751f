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
//!
//! [`Expiries`] keeps the leases' ends in time order, for expiry at their TTL.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::clock::Nanos;
use crate::prefetch::prefetch_all;

/// Slots a slab may keep after its last lease ends; larger slabs are freed then.
const KEEP_SLOTS: usize = 1024;

/// Aligned so that a slot of 96 bytes (a lease's) always lies within two cache lines.
#[repr(align(32))]
struct Slot<T> {
    id: u64,
    value: Option<T>,
}

/// The bytes a slot holding a `T` takes in the slab.
#[cfg(test)]
pub(crate) const fn slot_size<T>() -> usize {
    std::mem::size_of::<Slot<T>>()
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
        let index = if let Some(i) = self.free.pop() {
            i as usize
        } else {
            self.slots.push(Slot { id: 0, value: None });
            self.slots.len() - 1
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

    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let index = (id & u64::from(u32::MAX)) as usize;
        self.slots
            .get_mut(index)
            .filter(|s| s.id == id)
            .and_then(|s| s.value.as_mut())
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

/// When leases end: `(end, lease number)` pairs, earliest first.
///
/// Almost every lease ends one TTL after its admission, so ends arrive in time order and a FIFO
/// holds them: adding one writes at the queue's tail, expiring reads at its head, one cache line
/// each (and expiries read the head's lines one after another). A binary heap would compare with a
/// parent on every push and walk from its root to a leaf on every expiry: with hundreds of leases per
/// tenant and a thousand tenants, each step of that walk is a cache miss.
/// The few ends that come out of order (a held call's lease ends its hold later than its
/// neighbours', and a reload that shortens `lease_ttl` makes new ends earlier than old ones) go to a
/// small heap beside the queue.
///
/// Entries are not removed when a lease is released; the caller skips ends whose lease is gone and
/// rebuilds from its live leases when stale entries dominate ([`Expiries::rebuild`]).
#[derive(Default)]
pub struct Expiries {
    in_order: VecDeque<(Nanos, u64)>,
    out_of_order: BinaryHeap<Reverse<(Nanos, u64)>>,
}

impl Expiries {
    /// Records that lease `id` ends at `at`.
    pub fn push(&mut self, at: Nanos, id: u64) {
        match self.in_order.back() {
            Some(&(last, _)) if last > at => self.out_of_order.push(Reverse((at, id))),
            _ => self.in_order.push_back((at, id)),
        }
    }

    /// Records the end of a lease that is likely to end later than the leases admitted after it (a
    /// held call's): kept out of the queue, so that it does not push theirs out of order.
    pub fn push_late(&mut self, at: Nanos, id: u64) {
        self.out_of_order.push(Reverse((at, id)));
    }

    /// The earliest end.
    pub fn peek(&self) -> Option<(Nanos, u64)> {
        let queued = self.in_order.front().copied();
        let heaped = self.out_of_order.peek().map(|r| r.0);
        match (queued, heaped) {
            (Some(q), Some(h)) => Some(q.min(h)),
            (q, h) => q.or(h),
        }
    }

    /// Takes the earliest end.
    pub fn pop(&mut self) -> Option<(Nanos, u64)> {
        let first = self.peek()?;
        if self.in_order.front() == Some(&first) {
            self.in_order.pop_front();
            if self.in_order.is_empty() && self.in_order.capacity() > KEEP_SLOTS {
                self.in_order = VecDeque::new();
            }
        } else {
            self.out_of_order.pop();
        }
        Some(first)
    }

    pub fn len(&self) -> usize {
        self.in_order.len() + self.out_of_order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replaces the entries with `ends` (the live leases' ends, in any order).
    pub fn rebuild(&mut self, ends: impl Iterator<Item = (Nanos, u64)>) {
        let mut ends: Vec<(Nanos, u64)> = ends.collect();
        ends.sort_unstable();
        self.in_order = ends.into();
        self.out_of_order = BinaryHeap::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(e: &mut Expiries) -> Vec<(Nanos, u64)> {
        std::iter::from_fn(|| e.pop()).collect()
    }

    #[test]
    fn ends_come_out_earliest_first_whatever_order_they_went_in() {
        let mut e = Expiries::default();
        // In order, then a reload that shortened the TTL (earlier ends), a held call's late end, and
        // ties.
        for (at, id) in [
            (10, 1),
            (20, 2),
            (30, 3),
            (15, 4),
            (25, 5),
            (30, 6),
            (40, 7),
        ] {
            e.push(at, id);
        }
        e.push_late(35, 8);
        e.push(12, 9);
        assert_eq!(e.len(), 9);
        assert_eq!(e.peek(), Some((10, 1)));
        let got = drain(&mut e);
        let mut want = got.clone();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(got.len(), 9);
        assert!(e.is_empty());
        assert_eq!(e.peek(), None);
    }

    #[test]
    fn ends_in_order_stay_in_the_queue_and_a_held_calls_does_not_disturb_them() {
        let mut e = Expiries::default();
        e.push(100, 1);
        e.push_late(2_000, 2); // held for a while
        for i in 0..100 {
            e.push(101 + i, 10 + i);
        }
        assert_eq!(
            e.out_of_order.len(),
            1,
            "only the held call's end is out of the queue"
        );
        assert_eq!(e.in_order.len(), 101);
        assert_eq!(drain(&mut e).last(), Some(&(2_000, 2)));
    }

    #[test]
    fn a_random_mix_drains_sorted() {
        let mut rng = crate::engine::rng::Rng::new(42);
        let mut e = Expiries::default();
        let mut all = Vec::new();
        let mut now = 0;
        for id in 0..5_000u64 {
            now += rng.below_or_eq(9);
            let at = now
                + 1_000
                + if rng.below_or_eq(9) == 0 {
                    rng.below_or_eq(2_999)
                } else {
                    0
                };
            if rng.below_or_eq(1) == 0 {
                e.push(at, id);
            } else {
                e.push_late(at, id);
            }
            all.push((at, id));
            // Expire what is due now and then, as the tenant actor does.
            if id % 97 == 0 {
                while e.peek().is_some_and(|(at, _)| at <= now) {
                    let (at, id) = e.pop().unwrap();
                    let i = all.iter().position(|x| *x == (at, id)).unwrap();
                    all.remove(i);
                    assert!(
                        all.iter().all(|x| *x > (at, id) || x.0 > now),
                        "earliest first"
                    );
                }
            }
        }
        all.sort();
        assert_eq!(drain(&mut e), all);
    }

    #[test]
    fn a_rebuild_keeps_only_what_it_is_given_and_a_large_queue_is_given_back() {
        let mut e = Expiries::default();
        for i in 0..5_000 {
            e.push(i, i);
        }
        e.push_late(1, 99_999);
        e.rebuild([(30, 3), (10, 1), (20, 2)].into_iter());
        assert_eq!(e.len(), 3);
        assert_eq!(drain(&mut e), vec![(10, 1), (20, 2), (30, 3)]);
        for i in 0..5_000 {
            e.push(i, i);
        }
        assert!(e.in_order.capacity() >= 5_000);
        drain(&mut e);
        assert!(
            e.in_order.capacity() <= KEEP_SLOTS,
            "memory given back once empty"
        );
    }

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
