// mimalloc: admitd allocates small objects on one thread (a worker) and frees many of them on another
// (the telemetry thread); glibc's allocator pays for that cross-thread traffic, mimalloc does not
// (docs/BENCHMARKS.md has the numbers).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    admitd::cli::main()
}
