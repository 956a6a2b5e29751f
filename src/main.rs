// jemalloc instead of the system allocator: with the many short-lived allocations of a request
// (HTTP parsing, the actor message, the answer) it costs 8-16% less CPU per admission than
// glibc's malloc, and unlike mimalloc (as fast) it keeps idle memory within the per-subject budget.
// docs/BENCHMARKS.md has the measurements.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

// jemalloc's options, read when it starts (`_RJEM_MALLOC_CONF` in the environment still overrides
// them). Each thread keeps at least 64 freed blocks of every small size for reuse, instead of 20 for
// the larger small sizes: every request gets a fresh 8 KiB read buffer from hyper while up to a
// connection's worth of older ones are still alive, and with 20 the thread's cache of that size
// emptied and overflowed in turn, each time a trip to the shared arena (3% fewer instructions per
// admission, `scripts/count.sh`; docs/BENCHMARKS.md). It holds at most 64 blocks of
// each size per thread, freed over time when unused.
#[cfg(not(target_env = "msvc"))]
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8; 27] = b"tcache_nslots_small_min:64\0";

fn main() -> std::process::ExitCode {
    admitd::cli::main()
}
