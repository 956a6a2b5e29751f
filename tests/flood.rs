//! Hostile load against the real binary: the bound on held admissions and its 503, and a
//! connection flood (half-sent requests plus thousands of idle keep-alive connections) that must
//! not slow the other callers, with the stalled connections closed after the header timeout.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;

#[test]
fn past_max_held_a_call_that_would_wait_gets_a_fast_503_with_a_tool_result() {
    let d = Daemon::start(
        "[server]\nmax_wait = \"3s\"\n[limits.subject]\nconcurrency = 1\n\
         [overload]\nmax_held = 1\n",
    );
    let body = |wait: u64| json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": wait});
    let first = d.admit(body(0));
    assert_eq!(first.status, 200);
    let lease = first.body["lease_id"].as_str().unwrap().to_string();
    // The one held call allowed waits for the slot ...
    let waiting = {
        let (client, url) = (d.client.clone(), d.url("/v1/admit"));
        let b = body(3000);
        std::thread::spawn(move || {
            client
                .post(url)
                .json(&b)
                .send()
                .map(|r| r.status().as_u16())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // ... the next one that would wait is refused at once.
    let sent = Instant::now();
    let refused = d.admit(body(3000));
    assert!(
        sent.elapsed() < Duration::from_millis(500),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(refused.body["error"], "overloaded");
    assert!(refused.body["message"].as_str().is_some());
    assert_eq!(refused.body["tool_result"]["isError"], true);
    assert_eq!(refused.header("retry-after").as_deref(), Some("1"));
    // A call that does not wait is decided as usual.
    assert_eq!(d.admit(body(0)).status, 429);
    assert_eq!(d.release(&lease).status, 200);
    assert_eq!(
        waiting.join().unwrap().unwrap(),
        200,
        "the held call got the slot"
    );
    let metrics = d.get("/metrics").body;
    let text = metrics.as_str().unwrap_or_default();
    assert_eq!(
        common::metric(text, "admitd_overload_total{reason=\"held\"}"),
        Some(1.0),
        "{text}"
    );
}

/// Raises this process's descriptor limit to `want` (at most its hard limit); the limit now.
#[cfg(target_os = "linux")]
#[allow(clippy::unnecessary_cast)] // rlim_t is not u64 everywhere
fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        let target = want.min(lim.rlim_max as u64);
        if (lim.rlim_cur as u64) < target {
            lim.rlim_cur = target as libc::rlim_t;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return 0;
            }
        }
        target
    }
}

/// Latencies of `n` admissions of a quiet tenant over one keep-alive connection, sorted.
fn quiet_latencies(d: &Daemon, n: usize) -> Vec<Duration> {
    let mut v: Vec<Duration> = (0..n)
        .map(|i| {
            let t = Instant::now();
            let a =
                d.admit(json!({"tenant": "quiet", "subject": format!("s{}", i % 10), "tool": "x"}));
            assert_eq!(a.status, 200, "{:?}", a.body);
            let lease = a.body["lease_id"].as_str().unwrap().to_string();
            let took = t.elapsed();
            assert_eq!(d.release(&lease).status, 200);
            took
        })
        .collect();
    v.sort();
    v
}

fn pct(v: &[Duration], p: f64) -> Duration {
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[cfg(target_os = "linux")]
#[test]
fn slowloris_and_ten_thousand_idle_connections_do_not_slow_other_callers() {
    const IDLE: usize = 10_000;
    const STALLED: usize = 1_000;
    // Both sides hold a descriptor per connection, plus the daemon's own and some slack.
    let need = (IDLE + STALLED + 500) as u64;
    let have = raise_fd_limit(need + 1000);
    if have < need {
        eprintln!(
            "SKIPPED: the descriptor limit (hard limit {have}) is below the {need} this test \
             needs; raise `ulimit -Hn`"
        );
        return;
    }
    let d = Daemon::start_with_fd_limit(
        "[overload]\nheader_timeout = \"8s\"\n[limits.tenant]\nrate = \"10000/s\"\nburst = 10000\n",
        have as u32,
    );
    let idle_before = quiet_latencies(&d, 60);

    let opened = Instant::now();
    // Idle keep-alive connections: each answered once, then left open without a word.
    let mut idle = Vec::with_capacity(IDLE);
    for chunk in 0..IDLE / 500 {
        let mut batch: Vec<TcpStream> = (0..500)
            .map(|i| {
                TcpStream::connect(&d.addr)
                    .unwrap_or_else(|e| panic!("connection {}: {e}", chunk * 500 + i))
            })
            .collect();
        for s in &mut batch {
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: admitd\r\n\r\n")
                .unwrap();
        }
        for s in &mut batch {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut buf = [0u8; 512];
            let n = s.read(&mut buf).unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        }
        idle.extend(batch);
    }
    // Slowloris: half a request head each, then nothing.
    let mut stalled: Vec<TcpStream> = (0..STALLED)
        .map(|_| {
            let mut s = TcpStream::connect(&d.addr).unwrap();
            s.write_all(b"POST /v1/admit HTTP/1.1\r\nHost: admitd\r\nContent-Le")
                .unwrap();
            s
        })
        .collect();
    let flooded = quiet_latencies(&d, 60);
    let opening = opened.elapsed();
    eprintln!(
        "quiet tenant: idle p50 {:?} p99 {:?}; with {IDLE} idle and {STALLED} stalled connections \
         p50 {:?} p99 {:?} (connections opened in {opening:?})",
        pct(&idle_before, 0.5),
        pct(&idle_before, 0.99),
        pct(&flooded, 0.5),
        pct(&flooded, 0.99),
    );
    // Within its normal latency: a busy shared machine gets a few milliseconds of slack.
    let slack = Duration::from_millis(5);
    assert!(
        pct(&flooded, 0.5) <= pct(&idle_before, 0.5) * 3 + slack,
        "median {:?} against {:?} idle",
        pct(&flooded, 0.5),
        pct(&idle_before, 0.5)
    );
    assert!(
        pct(&flooded, 0.99) <= pct(&idle_before, 0.99) * 3 + slack * 4,
        "p99 {:?} against {:?} idle",
        pct(&flooded, 0.99),
        pct(&idle_before, 0.99)
    );

    // Every stalled connection is closed by the daemon after the header timeout (8 s), not before
    // most of it has passed.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut closed = 0;
    for s in &mut stalled {
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .unwrap();
        let mut buf = [0u8; 256];
        // EOF, a reset, or an answer followed by the close all mean the daemon let go.
        match s.read(&mut buf) {
            Ok(_) => closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            Err(_) => {}
        }
    }
    assert_eq!(
        closed, STALLED,
        "stalled connections still open after the header timeout"
    );
    assert!(
        opened.elapsed() >= Duration::from_secs(7),
        "closed before the header timeout: {:?}",
        opened.elapsed()
    );
    // And the daemon still answers.
    assert_eq!(quiet_latencies(&d, 5).len(), 5);
    drop(idle);
    let errors: Vec<String> = d
        .log_lines()
        .into_iter()
        .filter(|l| l.contains("\"level\":\"ERROR\""))
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
}
