//! Cache-line prefetch hints.
//!
//! With a thousand tenants, the state one admission reads (the tenant actor, its engine, the subject,
//! the lease slot) is rarely still in cache, and the reads that find it come one after another, each
//! waiting for the last. Asking for those lines up front lets their loads overlap: the tenant actor
//! and its engine, and the next lease slot, are prefetched (a subject's state is one line, found by
//! the lookup itself, so there is nothing to ask for ahead of it). The metrics thread
//! does the same for the series it records into and the names it hashes (`telemetry::rawindex`,
//! `telemetry::metrics`).
//!
//! What it assumes: an x86-64 CPU (elsewhere every hint is a no-op) and 64-byte cache lines (the
//! stride of [`prefetch_all`]; another line size makes the hint coarser or finer, never wrong). A
//! hint never reads memory, so it is sound on any address, including one past a vector's end or
//! memory already freed. What it bought: admit-only at 64 connections over 1 000 tenants, prefetching
//! the tenant actor's state and its next lease slot took 10.10 → 9.60, 10.41 → 9.69 and 10.78 →
//! 10.27 µs of CPU per request in three sets of alternating rounds (`scripts/bench.sh`;
//! docs/BENCHMARKS.md, "Choices we made and why"). Its `unsafe` block is listed with the others in
//! docs/architecture.md.

/// Asks the CPU to start loading the cache line at `p` (a hint: nothing is read, any address is fine).
#[inline]
pub fn prefetch<T>(p: *const T) {
    // SAFETY: a prefetch reads nothing and cannot fault, whatever the address; it is `unsafe` only
    // because it is an SSE instruction, which every x86_64 CPU has.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks the CPU to start loading every cache line of the `T` at `p` (a hint, like [`prefetch`]).
#[inline]
pub fn prefetch_all<T>(p: *const T) {
    let bytes = p.cast::<u8>();
    let mut offset = 0;
    while offset < std::mem::size_of::<T>() {
        prefetch(bytes.wrapping_add(offset));
        offset += 64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hint must be safe on any address: the places that prefetch do so past the end of a vector
    /// (the slot a lease is about to be pushed into), and may name memory that is gone.
    #[test]
    fn prefetching_any_address_reads_nothing_and_does_not_fault() {
        let v: Vec<[u8; 200]> = Vec::with_capacity(1);
        prefetch_all(v.as_ptr().wrapping_add(5));
        prefetch_all(std::ptr::null::<[u8; 4096]>());
        prefetch(usize::MAX as *const u8);
        let boxed = Box::new([7u64; 32]);
        let p: *const [u64; 32] = &*boxed;
        drop(boxed);
        prefetch_all(p);
        // A value prefetched stays what it was.
        let x = [1u32, 2, 3];
        prefetch_all(&x as *const [u32; 3]);
        assert_eq!(x, [1, 2, 3]);
    }
}
