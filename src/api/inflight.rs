//! Counts of admissions in progress and of admissions being held, for shutdown and overload.
//!
//! Shutdown waits until every admission that had started is answered, and the bound on held
//! admissions (`[overload] max_held`) compares their number with a limit. Both counts are kept per
//! thread: a request's future runs on the worker thread that accepted its connection from start to
//! end (connections are tasks of that worker's `LocalSet`), so a counter that only its own thread
//! writes needs no contended cache line on every admission. Whoever needs the total sums the
//! threads' counters, which is rare (a held call, shutdown).
//!
//! The counters are process-wide rather than per daemon instance: one process runs one daemon.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

/// One thread's counters, on a cache line of their own so that two threads never write one line.
#[repr(align(64))]
#[derive(Default)]
struct Counters {
    admitting: AtomicUsize,
    held: AtomicUsize,
}

/// Every thread's counters; a thread adds its own the first time it counts (leaked: a worker thread
/// lives as long as the process, and a counter outliving its thread reads 0).
static THREADS: Mutex<Vec<&'static Counters>> = Mutex::new(Vec::new());

thread_local! {
    static MINE: &'static Counters = {
        let c: &'static Counters = Box::leak(Box::default());
        THREADS.lock().push(c);
        c
    };
}

fn total(read: impl Fn(&Counters) -> usize) -> usize {
    THREADS.lock().iter().map(|c| read(c)).sum()
}

/// Admissions between their arrival and their answer (including held ones), over every thread.
pub fn admitting() -> usize {
    total(|c| c.admitting.load(Ordering::Acquire))
}

/// Admissions being held for capacity now, over every thread.
pub fn held() -> usize {
    total(|c| c.held.load(Ordering::Acquire))
}

/// Counts one admission while it lives. Must be dropped on the thread that made it (a request's
/// future does not move between threads).
pub struct Admitting(&'static Counters);

impl Admitting {
    pub fn enter() -> Self {
        let c = MINE.with(|c| *c);
        c.admitting.fetch_add(1, Ordering::AcqRel);
        Admitting(c)
    }
}

impl Drop for Admitting {
    fn drop(&mut self) {
        self.0.admitting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts one held admission while it lives; `None` when `limit` are held already.
pub struct Held(&'static Counters);

impl Held {
    pub fn try_enter(limit: usize) -> Option<Self> {
        if held() >= limit {
            return None;
        }
        let c = MINE.with(|c| *c);
        c.held.fetch_add(1, Ordering::AcqRel);
        Some(Held(c))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_their_guards_across_threads() {
        // Other tests of the crate may admit meanwhile: compare with what this thread adds.
        let a = Admitting::enter();
        let other = std::thread::spawn(|| {
            let _b = Admitting::enter();
            let held = Held::try_enter(usize::MAX);
            assert!(held.is_some());
            assert!(super::held() >= 1);
            assert!(admitting() >= 2);
        });
        other.join().unwrap();
        assert!(admitting() >= 1);
        drop(a);
        assert!(
            Held::try_enter(0).is_none(),
            "nothing is held past a limit of 0"
        );
    }
}
