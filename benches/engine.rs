//! Cost of one admission decision in the pure engine, without HTTP, actors or a real clock.
//!
//! Each benchmark drives a [`TenantEngine`] with a fake monotonic clock that moves 1 µs per call, so
//! buckets refill as they would under a steady load of one million calls per second on one tenant. The
//! limits are set so that only the layer a benchmark is about can refuse. The last two,
//! `admit_across_1000_tenants` and `admit_release_across_1000_tenants`, spread their calls over
//! 1 000 tenants instead, to time decisions whose state is out of cache, as it is in the daemon
//! under the HTTP benchmark's load.
//!
//! Admissions hold leases until they are released. Where a benchmark times admissions alone, it admits
//! a batch, stops the clock, and releases the batch (and runs the periodic lease expiry the tenant actor
//! would run) before the next batch, so the lease table stays small and the measurement stays the
//! decision itself.
//!
//! Run: `cargo bench --bench engine` (add `-- --quick` for a short run).

// The daemon's allocator (src/main.rs): a decision allocates (its layer list, a refusal's text), and
// with glibc's malloc a fifth of a refusal's time went to the allocator the daemon does not use.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use admitd::config::Config;
use admitd::engine::{
    AdmitRequest, AdmitResult, Outcome, ReleaseInfo, SharedBudgets, TenantEngine, Verdict,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// Simulated time between two calls.
const STEP_NS: u64 = 1_000;
/// A fixed wall clock (2026-09-01T00:00:00Z); only daily quotas look at it.
const WALL_MS: i64 = 1_788_220_800_000;
/// Admissions per timed batch before their leases are released off the clock.
const BATCH: u64 = 1_000;
/// The server's default `max_wait`, as the HTTP layer would pass it.
const MAX_WAIT_NS: u64 = 2_000_000_000;

/// Tenant and global limits high enough that they never refuse.
const ROOMY_TENANT_AND_GLOBAL: &str = r#"
[limits.tenant]
rate = "10000000/s"
burst = 10000000
concurrency = 1000000

[limits.global]
rate = "10000000/s"
burst = 10000000
"#;

/// A subject bucket that never refuses either: with [`ROOMY_TENANT_AND_GLOBAL`], nothing is refused.
const ROOMY_SUBJECT: &str = r#"
[limits.subject]
rate = "10000000/s"
burst = 10000000
concurrency = 1000000
"#;

/// The subject bucket holds one token and refills once an hour: after the first call, every call is shed
/// with scope `subject`.
const EMPTY_SUBJECT: &str = r#"
[limits.subject]
rate = "1/h"
burst = 1
concurrency = 1000000
"#;

/// A tool with its own per-subject bucket and a per-tenant upstream budget, so an admitted call passes
/// all five bucket layers.
const TOOL_AND_UPSTREAM: &str = r#"
[tools.get_sales]
cost = 2
upstream = "warehouse"
rate = "10000000/s"
burst = 10000000

[upstreams.warehouse]
rate = "10000000/s"
burst = 10000000
"#;

/// A config made of the given sections plus the roomy tenant and global limits.
fn config(sections: &[&str]) -> String {
    let mut text = ROOMY_TENANT_AND_GLOBAL.to_string();
    for s in sections {
        text.push_str(s);
    }
    text
}

fn engine(toml: &str) -> TenantEngine {
    let cfg = match Config::parse("bench", toml) {
        Ok(c) => Arc::new(c),
        Err(e) => panic!("bench config does not parse: {e}"),
    };
    let shared = Arc::new(SharedBudgets::new(&cfg));
    TenantEngine::new(Arc::from("acme"), cfg, shared, 7)
}

fn request(subject: &str, tool: &str) -> AdmitRequest {
    AdmitRequest {
        subject: subject.into(),
        tool: tool.into(),
        upstream: None,
        cost: None,
        max_wait_ns: MAX_WAIT_NS,
        returning: false,
        spend: None,
    }
}

/// Calls of `n` subjects `agent-<i>`, spread over eight tools.
fn subjects_and_tools(n: usize) -> Vec<AdmitRequest> {
    (0..n)
        .map(|i| request(&format!("agent-{i}"), &format!("tool{}", i % 8)))
        .collect()
}

fn release_ok() -> ReleaseInfo {
    ReleaseInfo {
        outcome: Outcome::Ok,
        upstream_status: None,
        retry_after: None,
        duration_ms: None,
    }
}

/// The lease of an admission; panics on anything else, because a benchmark that sheds by mistake would
/// measure the wrong path.
fn lease_of(result: AdmitResult) -> u64 {
    match result {
        AdmitResult::Decided(d) => match d.verdict {
            Verdict::Admitted(a) => a.lease,
            Verdict::Shed(s) => panic!("expected an admission, got a shed ({})", s.scope.as_str()),
        },
        AdmitResult::Queued { .. } => panic!("expected an admission, got a queued call"),
    }
}

/// Times `iters` admissions of `reqs` (cycled), in batches whose leases are released off the clock.
fn time_admissions(
    engine: &mut TenantEngine,
    reqs: &[AdmitRequest],
    now: &mut u64,
    iters: u64,
) -> Duration {
    let info = release_ok();
    let mut leases = Vec::with_capacity(BATCH as usize);
    let mut total = Duration::ZERO;
    let mut next = 0usize;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BATCH);
        let start = Instant::now();
        for _ in 0..n {
            *now += STEP_NS;
            let result = engine.admit(&reqs[next], *now, WALL_MS);
            next = (next + 1) % reqs.len();
            leases.push(lease_of(black_box(result)));
        }
        total += start.elapsed();
        for lease in leases.drain(..) {
            let _ = engine.release(lease, &info, *now, WALL_MS);
        }
        engine.expire_leases(*now, WALL_MS);
        left -= n;
    }
    total
}

fn admit_hot_subject(c: &mut Criterion) {
    let mut engine = engine(&config(&[ROOMY_SUBJECT]));
    let reqs = [request("agent-1", "search")];
    let mut now = 0u64;
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    g.bench_function("admit_hot_subject", |b| {
        b.iter_custom(|iters| time_admissions(&mut engine, &reqs, &mut now, iters))
    });
    g.finish();
}

fn admit_release_10k_subjects(c: &mut Criterion) {
    let mut engine = engine(&config(&[ROOMY_SUBJECT]));
    let reqs = subjects_and_tools(10_000);
    let info = release_ok();
    let mut now = 0u64;
    let mut next = 0usize;
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    g.bench_function("admit_release_10k_subjects", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(BATCH);
                let start = Instant::now();
                for _ in 0..n {
                    now += STEP_NS;
                    let lease = lease_of(engine.admit(&reqs[next], now, WALL_MS));
                    next = (next + 1) % reqs.len();
                    now += STEP_NS;
                    let released = engine.release(lease, &info, now, WALL_MS);
                    black_box(released.is_ok());
                }
                total += start.elapsed();
                engine.expire_leases(now, WALL_MS);
                left -= n;
            }
            total
        })
    });
    g.finish();
}

fn shed_empty_bucket(c: &mut Criterion) {
    let mut engine = engine(&config(&[EMPTY_SUBJECT]));
    let req = request("agent-1", "search");
    let mut now = STEP_NS;
    // Spend the only token; from here on every call is refused by the subject bucket.
    let _ = lease_of(engine.admit(&req, now, WALL_MS));
    match engine.admit(&req, now + STEP_NS, WALL_MS) {
        AdmitResult::Decided(d) => match d.verdict {
            Verdict::Shed(s) => assert_eq!(s.scope.as_str(), "subject"),
            Verdict::Admitted(_) => panic!("expected a shed on the empty subject bucket"),
        },
        AdmitResult::Queued { .. } => panic!("expected a shed, got a queued call"),
    }
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    g.bench_function("shed_empty_bucket", |b| {
        b.iter(|| {
            now += STEP_NS;
            black_box(engine.admit(&req, now, WALL_MS))
        })
    });
    g.finish();
}

fn admit_tool_and_upstream(c: &mut Criterion) {
    let mut engine = engine(&config(&[ROOMY_SUBJECT, TOOL_AND_UPSTREAM]));
    let reqs: Vec<AdmitRequest> = (0..1_000)
        .map(|i| request(&format!("agent-{i}"), "get_sales"))
        .collect();
    let mut now = 0u64;
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    g.bench_function("admit_tool_and_upstream", |b| {
        b.iter_custom(|iters| time_admissions(&mut engine, &reqs, &mut now, iters))
    });
    g.finish();
}

/// Leases held until their TTL and then expired, as when an MCP server crashes mid-call or never
/// releases: the per-lease cost of the tenant actor's periodic expiry, with 1 000 leases live per
/// batch (a tenant at 100 admissions/s with a 10 s TTL). Per element: one expired lease.
fn expire_leases_at_ttl(c: &mut Criterion) {
    let mut engine = engine(&config(&[ROOMY_SUBJECT]));
    let reqs = subjects_and_tools(100);
    let ttl_ns = engine.config().server.lease_ttl.as_nanos() as u64;
    let mut now = 0u64;
    let mut next = 0usize;
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(1));
    g.bench_function("expire_leases_at_ttl", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(BATCH);
                for _ in 0..n {
                    now += STEP_NS;
                    let _ = lease_of(engine.admit(&reqs[next], now, WALL_MS));
                    next = (next + 1) % reqs.len();
                }
                now += ttl_ns;
                let start = Instant::now();
                let (expired, _) = engine.expire_leases(now, WALL_MS);
                total += start.elapsed();
                assert_eq!(expired.len() as u64, n, "every lease of the batch expires");
                left -= n;
            }
            total
        })
    });
    g.finish();
}

/// Tenants in [`Fleet`], and calls per second across them all.
const TENANTS: usize = 1_000;
const CALLS_PER_SEC: u64 = 50_000;
/// The tenant actor prunes resting state every fifth tick (`PRUNE_EVERY_TICKS`).
const PRUNE_EVERY_TICKS: u64 = 5;

/// The HTTP benchmark's working set without HTTP: 1 000 tenants, each with 100 subjects over eight
/// tools, called in random order at 50 000 calls/s of simulated time, with a 10 s lease TTL. Each
/// tenant's periodic work runs once a simulated second (one tenant every 50 calls, as the arbiter's
/// ticker spreads them): its lease expiry, and every fifth time its pruning of resting state. The
/// state far exceeds the caches, so this times what the hot benchmarks above cannot: the cache
/// misses of a decision and of what follows it.
struct Fleet {
    engines: Vec<TenantEngine>,
    reqs: Vec<AdmitRequest>,
    /// Release each call at once (admit + release), or hold its lease to its TTL.
    release: bool,
    rng: u64,
    now: u64,
    calls: u64,
}

impl Fleet {
    fn new(release: bool) -> Fleet {
        // The HTTP benchmark's lease TTL (benches/throughput.toml).
        let toml = config(&["[server]\nlease_ttl = \"10s\"\n", ROOMY_SUBJECT]);
        let cfg = match Config::parse("bench", &toml) {
            Ok(c) => Arc::new(c),
            Err(e) => panic!("bench config does not parse: {e}"),
        };
        let shared = Arc::new(SharedBudgets::new(&cfg));
        let engines = (0..TENANTS)
            .map(|t| {
                let name = Arc::from(format!("t{t}").as_str());
                TenantEngine::new(name, cfg.clone(), shared.clone(), t as u64)
            })
            .collect();
        let mut fleet = Fleet {
            engines,
            reqs: subjects_and_tools(100),
            release,
            rng: 0x9E37_79B9_7F4A_7C15,
            now: 0,
            calls: 0,
        };
        // Past one TTL and two prunes, so that leases expire as fast as they are taken and resting
        // state comes and goes as it does in a long run.
        fleet.run(CALLS_PER_SEC * 12);
        fleet
    }

    fn run(&mut self, n: u64) {
        let step = 1_000_000_000 / CALLS_PER_SEC;
        let tick_every = CALLS_PER_SEC / TENANTS as u64;
        let info = release_ok();
        for _ in 0..n {
            // xorshift64*: a different tenant and call each time, no pattern the caches could learn.
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
            self.now += step;
            let e = &mut self.engines[(r >> 32) as usize % TENANTS];
            let call = &self.reqs[(r as u32 as usize) % self.reqs.len()];
            let lease = lease_of(e.admit(call, self.now, WALL_MS));
            if self.release {
                let released = e.release(lease, &info, self.now, WALL_MS);
                assert!(black_box(released).is_ok(), "a live lease is released");
            }
            self.calls += 1;
            if self.calls % tick_every == 0 {
                let tick = self.calls / tick_every;
                let e = &mut self.engines[tick as usize % TENANTS];
                black_box(e.expire_leases(self.now, WALL_MS));
                if (tick / TENANTS as u64) % PRUNE_EVERY_TICKS == 0 {
                    e.prune(self.now, WALL_MS);
                }
            }
        }
    }

    fn live_leases(&self) -> usize {
        self.engines.iter().map(|e| e.lease_count()).sum()
    }

    /// Times `name`: one element is one call of [`Fleet::run`].
    fn bench(mut self, c: &mut Criterion, name: &str) {
        let mut g = c.benchmark_group("engine");
        g.throughput(Throughput::Elements(1));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                self.run(iters);
                start.elapsed()
            })
        });
        g.finish();
    }
}

/// [`Fleet`] with every lease held to its TTL, as when calls are not released: about 500 leases live
/// per tenant. Per element: one admission and, on average, one expiry.
fn admit_across_1000_tenants(c: &mut Criterion) {
    let fleet = Fleet::new(false);
    let live = fleet.live_leases();
    assert!(
        (400 * TENANTS..=600 * TENANTS).contains(&live),
        "about 500 leases per tenant, found {live} in all"
    );
    fleet.bench(c, "admit_across_1000_tenants");
}

/// [`Fleet`] with every call released at once: each subject is called every two seconds on average
/// and is at rest between calls. Per element: one admission and its release.
fn admit_release_across_1000_tenants(c: &mut Criterion) {
    let fleet = Fleet::new(true);
    assert_eq!(fleet.live_leases(), 0, "every lease released");
    fleet.bench(c, "admit_release_across_1000_tenants");
}

criterion_group!(
    benches,
    admit_hot_subject,
    admit_release_10k_subjects,
    shed_empty_bucket,
    admit_tool_and_upstream,
    expire_leases_at_ttl,
    admit_across_1000_tenants,
    admit_release_across_1000_tenants
);
criterion_main!(benches);
