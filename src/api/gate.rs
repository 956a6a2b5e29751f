//! Fairness between tenants on one worker under a flood: a tenant has at most `[overload]
//! tenant_in_decision` (default 8) of its admissions being decided on a worker at once; its further calls wait for one of its own to be
//! answered, parked on a gate outside the worker's run queue.
//!
//! Why: a worker thread runs every connection's task in turn. Without the gate, a tenant flooding on
//! N connections keeps N request tasks ready on the workers, and a quiet tenant's call passes the run
//! queue three times (its connection, its tenant's actor, its connection again for the answer), each
//! time behind up to N/2 flood requests. With the gate, at most a few of the flood's calls are
//! ready per worker; the rest wait on the gate, and since each flood connection sends its next
//! request only once answered, the flood stops filling the run queue. The quiet tenant's call passes
//! behind a handful of flood calls instead of hundreds, while the flood still keeps the worker busy
//! (a few calls in flight per worker are plenty to keep its actor's mailbox fed).
//!
//! What it assumes: one worker runs a request from parse to answer (the gates are per thread), and
//! a call holds its place only while it is decided, never while it is held for capacity (holds and
//! queued calls wait elsewhere, without a place). Calls waiting at a gate are bounded: past
//! `[overload] mailbox` waiting on one worker, a tenant's next call gets the fast 503, as when its
//! actor's mailbox is full.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Tenants a worker keeps gates for; past it, idle gates are dropped.
const GATES: usize = 4096;

struct Gate {
    places: Arc<Semaphore>,
    size: usize,
    /// Calls waiting for a place (only this worker touches it; atomic because the request futures
    /// that hold the gate must be `Send`).
    waiting: AtomicUsize,
}

thread_local! {
    static OPEN: RefCell<HashMap<compact_str::CompactString, Arc<Gate>, foldhash::fast::RandomState>> =
        RefCell::new(HashMap::default());
}

/// A place among a tenant's calls being decided on this worker; the permit it holds goes back
/// when it is dropped (it is never read).
pub struct Place(#[allow(dead_code)] OwnedSemaphorePermit);

/// Waits for one of the `places` among `tenant`'s calls being decided on this worker; `None` when
/// `max_waiting` of its calls wait already (the caller answers 503). A tenant's gate is made with the
/// number of places of its first call (a reload that changes it applies to gates made after).
pub async fn enter(tenant: &str, places: usize, max_waiting: usize) -> Option<Place> {
    let gate = OPEN.with(|open| {
        let mut open = open.borrow_mut();
        if let Some(g) = open.get(tenant) {
            return g.clone();
        }
        if open.len() >= GATES {
            // A gate no call holds or waits at is as good as a new one.
            open.retain(|_, g| Arc::strong_count(g) > 1 || g.places.available_permits() < g.size);
        }
        let g = Arc::new(Gate {
            places: Arc::new(Semaphore::new(places)),
            size: places,
            waiting: AtomicUsize::new(0),
        });
        open.insert(tenant.into(), g.clone());
        g
    });
    if let Ok(p) = gate.places.clone().try_acquire_owned() {
        return Some(Place(p));
    }
    if gate.waiting.load(Ordering::Relaxed) >= max_waiting {
        return None;
    }
    gate.waiting.fetch_add(1, Ordering::Relaxed);
    // Counted down however the wait ends: answered, or dropped with its request.
    let _waiting = Waiting(&gate.waiting);
    gate.places.clone().acquire_owned().await.ok().map(Place)
}

struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_waits_for_its_own_places_only_and_the_waiting_are_bounded() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let mut held = Vec::new();
            for _ in 0..8 {
                held.push(enter("flood", 8, 2).await.expect("a place"));
            }
            // Another tenant is not held up by the flood's full gate.
            assert!(enter("quiet", 8, 2).await.is_some());
            // The flood's next calls wait, at most two of them; a third is refused at once.
            let first = tokio::task::spawn_local(enter("flood", 8, 2));
            let second = tokio::task::spawn_local(enter("flood", 8, 2));
            tokio::task::yield_now().await;
            assert!(enter("flood", 8, 2).await.is_none());
            assert!(!first.is_finished() && !second.is_finished());
            // A place given back lets the first waiter in.
            held.pop();
            let place = first.await.unwrap();
            assert!(place.is_some());
            assert!(!second.is_finished());
            drop(place);
            assert!(second.await.unwrap().is_some());
        });
    }
}
