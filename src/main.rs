// jemalloc instead of the system allocator: with the many short-lived allocations of a request
// (HTTP parsing, the actor message, the answer) it costs 8-16% less CPU per admission than
// glibc's malloc, and unlike mimalloc (as fast) it keeps idle memory within the per-subject budget.
// docs/BENCHMARKS.md has the measurements.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    admitd::cli::main()
}
