//! A soak against the real binary: admissions, releases, upstream feedback and reloads mixed, tenants
//! appearing and going idle, callers hanging up mid-hold. Memory must stay flat once warm, every lease
//! and in-flight call must be back to 0 afterwards, and the log must hold no error.
//!
//! Runs 60 s by default; `ADMITD_SOAK_SECS=1800` makes it a 30-minute soak (docs/operations.md).

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;

fn config(rate: &str, state: &std::path::Path) -> String {
    format!(
        "[server]\nmax_wait = \"300ms\"\nidle_ttl = \"2s\"\nlease_ttl = \"3s\"\n\
         [limits.subject]\nrate = \"{rate}\"\nburst = 20\nconcurrency = 2\n\
         [limits.tenant]\nrate = \"2000/s\"\nburst = 500\nconcurrency = 64\n\
         [upstreams.api]\nrate = \"200/s\"\nburst = 50\n\
         [upstreams.shared]\nrate = \"300/s\"\nburst = 50\nshared = true\n\
         [state]\npath = {:?}\ninterval = \"1s\"\n",
        state.display().to_string()
    )
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(target_os = "linux")]
#[test]
fn a_mixed_soak_keeps_memory_flat_and_returns_every_lease() {
    let secs: u64 = std::env::var("ADMITD_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let d = Arc::new(Daemon::start_logging(&config("50/s", &state), "info"));
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    // Tenants come and go: the load moves to another set of 12 tenants every 10 s, so the last set
    // goes idle and is unloaded while the next appears. Three sets in turn: a name comes back after
    // its actor was unloaded, and the set of names (and of metric series) stops growing once each
    // set has been used, so memory can be read for growth.
    let tenant_of = move |worker: u64, i: u64| {
        let era = started.elapsed().as_secs() / 10 % 3;
        format!("t{}-{}", era, (worker * 7 + i) % 12)
    };

    let mut workers = Vec::new();
    for w in 0..3u64 {
        let (d, stop, calls) = (d.clone(), stop.clone(), calls.clone());
        workers.push(std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let tenant = tenant_of(w, i);
                let upstream = ["api", "shared", "none"][(i % 3) as usize];
                let mut body = json!({"tenant": tenant, "subject": format!("s{}", i % 5),
                                      "tool": "t", "max_wait_ms": 200});
                if upstream != "none" {
                    body["upstream"] = json!(upstream);
                }
                let a = d.admit(body);
                calls.fetch_add(1, Ordering::Relaxed);
                assert!(
                    matches!(a.status, 200 | 429),
                    "{} {:?}",
                    a.status,
                    a.body
                );
                if a.status == 200 {
                    let lease = a.body["lease_id"].clone();
                    let release = match i % 10 {
                        0 if upstream != "none" => json!({"lease_id": lease, "outcome": "upstream_rate_limited",
                                                          "upstream_status": 429, "retry_after": "1"}),
                        1 => json!({"lease_id": lease, "outcome": "error", "duration_ms": 12}),
                        _ => json!({"lease_id": lease, "outcome": "ok", "upstream_status": 200}),
                    };
                    let r = d.post("/v1/release", release);
                    assert_eq!(r.status, 200, "{:?}", r.body);
                }
                if i % 25 == 0 {
                    let f = d.post(
                        "/v1/feedback",
                        json!({"tenant": tenant_of(w, i), "upstream": "api", "status": 200}),
                    );
                    assert_eq!(f.status, 202);
                }
                std::thread::sleep(Duration::from_millis(3));
            }
        }));
    }
    // Callers that hang up while held: a subject with both slots taken, a call that queues for one,
    // and the connection closed mid-wait.
    {
        let (d, stop) = (d.clone(), stop.clone());
        workers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let tenant = format!("hangup{}", n % 3);
                let hold = |_: u8| {
                    let a = d.admit(json!({"tenant": tenant, "subject": "busy", "tool": "t"}));
                    a.body["lease_id"].as_str().map(str::to_string)
                };
                let leases: Vec<String> = (0..2).filter_map(hold).collect();
                let body = json!({"tenant": tenant, "subject": "busy", "tool": "t",
                                  "max_wait_ms": 300})
                .to_string();
                if let Ok(mut s) = std::net::TcpStream::connect(&d.addr) {
                    let _ = write!(
                        s,
                        "POST /v1/admit HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
                for l in leases {
                    d.release(&l);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    // A reload (SIGHUP) every 5 s, alternating two subject rates.
    {
        let (d, stop) = (d.clone(), stop.clone());
        let state = state.clone();
        workers.push(std::thread::spawn(move || {
            let mut k = 0;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(5));
                k += 1;
                d.rewrite_config(&config(if k % 2 == 0 { "50/s" } else { "40/s" }, &state));
                d.signal("HUP");
            }
        }));
    }

    // RSS every 5 s.
    let mut samples = Vec::new();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(5));
        samples.push(rss_kib(d.pid()));
        assert!(
            workers.iter().all(|w| !w.is_finished()),
            "a load thread failed"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("a load thread failed");
    }
    let total = calls.load(Ordering::Relaxed);
    eprintln!("soak: {secs} s, {total} admissions, RSS every 5 s (KiB): {samples:?}");

    // Warm once every tenant set has been used (30 s; the first half of a shorter soak): from then
    // on no growth beyond allocator noise.
    let warm_at = (samples.len() / 2).clamp(1, 6);
    let warm = samples[warm_at - 1];
    let peak_after = samples[warm_at..].iter().copied().max().unwrap_or(warm);
    assert!(
        peak_after <= warm + warm / 10 + 4096,
        "RSS grew after warm-up: {samples:?} (KiB)"
    );

    // Every lease and in-flight call is back to 0 once the load stops: held calls end within
    // max_wait, and a call granted to a caller that hung up unnoticed (the connection's close is
    // seen only when the answer is written) holds its lease until lease_ttl (3 s).
    let mut tenants: Vec<String> = (0..3)
        .flat_map(|era| (0..12).map(move |t| format!("t{era}-{t}")))
        .collect();
    tenants.extend((0..3).map(|n| format!("hangup{n}")));
    let settled = |t: &String| {
        let s = d.get(&format!("/v1/tenants/{t}"));
        s.status == 404 || (s.body["inflight"] == 0 && s.body["leases"] == 0)
    };
    assert!(
        common::eventually(Duration::from_secs(6), || tenants.iter().all(settled)),
        "leases left: {:?}",
        tenants
            .iter()
            .filter(|t| !settled(t))
            .map(|t| d.get(&format!("/v1/tenants/{t}")).body)
            .collect::<Vec<_>>()
    );
    let metrics = d.get("/metrics").body;
    let text = metrics.as_str().unwrap_or_default();
    let inflight: f64 = text
        .lines()
        .filter(|l| l.starts_with("admitd_inflight{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    // The gauges are sampled every 0.5 s.
    assert!(
        common::eventually(Duration::from_secs(3), || {
            let m = d.get("/metrics").body;
            m.as_str()
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with("admitd_inflight{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
                == 0.0
        }),
        "admitd_inflight does not return to 0 (was {inflight})"
    );
    let reloads = d
        .log_lines()
        .iter()
        .filter(|l| l.contains("config reloaded"))
        .count();
    assert!(reloads as u64 >= secs / 5 - 1, "{reloads} reloads");
    let errors: Vec<String> = d
        .log_lines()
        .into_iter()
        .filter(|l| l.contains("\"level\":\"ERROR\"") || l.contains("panicked"))
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
}
