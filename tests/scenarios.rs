//! Real-time scenarios against the real binary: a runaway agent beside well-behaved tenants, and a
//! thundering herd of refused callers that retry when told.
//!
//! Tolerances are chosen for a busy 2-core machine: the assertions are about counts that only the
//! limiter's arithmetic decides (burst + rate × duration), not about latencies.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;

const SUBJECT_LIMITS: &str = "[limits.subject]\nrate = \"120/min\"\nburst = 20\n";

#[test]
fn a_runaway_loop_cannot_starve_other_tenants() {
    let d = Arc::new(Daemon::start(SUBJECT_LIMITS));
    let run_for = Duration::from_secs(10);
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let runaway_admitted = Arc::new(AtomicU64::new(0));
    let runaway_calls = Arc::new(AtomicU64::new(0));

    // The runaway: one agent credential, four loops, as fast as the daemon answers.
    let loops: Vec<_> = (0..4)
        .map(|_| {
            let (d, stop, admitted, calls) = (d.clone(), stop.clone(), runaway_admitted.clone(), runaway_calls.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let a = d.admit(json!({"tenant": "initech", "subject": "loop-bot", "tool": "search", "max_wait_ms": 0}));
                    if stop.load(Ordering::Relaxed) && start.elapsed() > run_for {
                        break;
                    }
                    calls.fetch_add(1, Ordering::Relaxed);
                    if a.status == 200 {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        d.release(a.body["lease_id"].as_str().unwrap());
                    } else {
                        assert_eq!(a.status, 429, "{:?}", a.body);
                    }
                }
            })
        })
        .collect();

    // Two well-behaved tenants: one call a second each.
    let polite: Vec<_> = ["acme", "globex"]
        .into_iter()
        .map(|tenant| {
            let d = d.clone();
            std::thread::spawn(move || {
                let mut admitted = 0;
                for i in 0..10u32 {
                    let due = start + Duration::from_secs(i as u64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let a = d.admit(json!({"tenant": tenant, "subject": "assistant", "tool": "search", "max_wait_ms": 0}));
                    if a.status == 200 {
                        admitted += 1;
                        d.release(a.body["lease_id"].as_str().unwrap());
                    }
                }
                admitted
            })
        })
        .collect();

    std::thread::sleep(run_for.saturating_sub(start.elapsed()));
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed();
    for l in loops {
        l.join().unwrap();
    }
    let polite: Vec<u32> = polite.into_iter().map(|p| p.join().unwrap()).collect();
    let admitted = runaway_admitted.load(Ordering::Relaxed);
    let calls = runaway_calls.load(Ordering::Relaxed);
    println!("polite tenants admitted {polite:?} of 10; runaway admitted {admitted} of {calls} calls in {elapsed:?}");
    assert_eq!(polite, vec![10, 10]);
    // burst 20 + 2/s × 10 s
    let expected = 20.0 + 2.0 * elapsed.as_secs_f64();
    assert!(
        (admitted as f64 - expected).abs() <= 2.5,
        "runaway admitted {admitted}, expected {expected:.1} ± 2"
    );
    assert!(
        calls > 200,
        "the loops made only {calls} calls; not a runaway"
    );
}

#[test]
fn refused_callers_that_wait_as_told_succeed_on_their_first_retry() {
    // 2/s, burst 20; concurrency out of the way.
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"2/s\"\nburst = 20\nconcurrency = 1000\n[limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    ));
    let barrier = Arc::new(std::sync::Barrier::new(60));
    let callers: Vec<_> = (0..60)
        .map(|i| {
            let (d, barrier) = (d.clone(), barrier.clone());
            std::thread::spawn(move || {
                let body = json!({"tenant": "t", "subject": "fan-out", "tool": "search", "max_wait_ms": 0, "call_id": format!("c{i}")});
                barrier.wait();
                let first = d.admit(body.clone());
                if first.status == 200 {
                    return (true, None);
                }
                assert_eq!(first.status, 429);
                let hint = first.body["retry_after_ms"].as_u64().unwrap();
                std::thread::sleep(Duration::from_millis(hint));
                let retry = d.admit(body);
                (false, Some((hint, retry.status == 200)))
            })
        })
        .collect();
    let results: Vec<_> = callers.into_iter().map(|c| c.join().unwrap()).collect();
    let first_ok = results.iter().filter(|r| r.0).count();
    let retries: Vec<_> = results.iter().filter_map(|r| r.1).collect();
    let ok = retries.iter().filter(|r| r.1).count();
    let mut hints: Vec<u64> = retries.iter().map(|r| r.0).collect();
    hints.sort_unstable();
    hints.dedup_by(|a, b| a.abs_diff(*b) < 250);
    let share = ok as f64 / retries.len() as f64;
    println!("admitted at once: {first_ok}; refused: {}; first retries admitted: {ok} ({:.0}%); distinct hints: {}", retries.len(), share * 100.0, hints.len());
    assert_eq!(first_ok + retries.len(), 60);
    assert!((19..=21).contains(&first_ok), "{first_ok}");
    assert!(
        share >= 0.9,
        "only {:.0}% of first retries succeeded",
        share * 100.0
    );
    assert!(
        hints.len() >= retries.len() * 9 / 10,
        "hints were not staggered: {hints:?}"
    );
}
