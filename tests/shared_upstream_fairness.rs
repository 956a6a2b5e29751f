//! A looping tenant on a shared upstream whose budget is sized above what the upstream really takes:
//! the light tenants keep their calls, and the upstream is neither flooded with 429s nor left idle.
//!
//! The test plays the MCP servers of three tenants (admit → call a fake upstream → release with what
//! it answered). The upstream accepts 20 requests/s (a token bucket) and answers 429 with
//! `Retry-After: 1` above that; admitd is told 60/s, so it has to learn the real limit from the 429s.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fake_upstream::{tool_call, Ended, FakeUpstream};
use common::Daemon;
use serde_json::json;

/// What the upstream really allows: 20 requests/s, up to 10 at once after a quiet spell.
const REAL_RATE: f64 = 20.0;
const REAL_BURST: f64 = 10.0;
/// How long the run lasts, and when the steady state judged starts.
const RUN: Duration = Duration::from_secs(20);
const STEADY_FROM: Duration = Duration::from_secs(10);
/// Each light tenant calls this often (3 calls/s), far below its fair share.
const LIGHT_EVERY: Duration = Duration::from_millis(333);
const LOOP_THREADS: usize = 4;

#[test]
fn a_looping_tenant_does_not_pause_light_tenants_on_a_shared_upstream() {
    // The budget is three times what the upstream takes: only its 429s can teach admitd the truth.
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 64\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 64\n\
         [upstreams.api]\nrate = \"60/s\"\nburst = 10\nshared = true\n\
         [tools.query]\nupstream = \"api\"\n",
    ));
    let start = Instant::now();
    let upstream = FakeUpstream::start(start, REAL_RATE, REAL_BURST);
    let stop = Arc::new(AtomicBool::new(false));

    // The loop: several threads on one credential, each calling again the moment it has an answer
    // (a runaway agent ignores retry hints).
    let loops: Vec<_> = (0..LOOP_THREADS)
        .map(|_| {
            let (d, stop, up) = (d.clone(), stop.clone(), upstream.addr.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::new();
                while !stop.load(Ordering::Relaxed) {
                    tool_call(&d, &d, &http, &up, "initech", &json!({}));
                }
            })
        })
        .collect();
    // Two light tenants, 3 calls/s each, on a fixed schedule (globex half a period behind acme).
    let light: Vec<_> = ["acme", "globex"]
        .into_iter()
        .enumerate()
        .map(|(k, tenant)| {
            let (d, up) = (d.clone(), upstream.addr.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::new();
                let mut results = Vec::new();
                let offset = LIGHT_EVERY / 2 * k as u32;
                for i in 0.. {
                    let due = start + offset + LIGHT_EVERY * i;
                    if due >= start + RUN {
                        break;
                    }
                    if let Some(w) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(w);
                    }
                    results.push((
                        due - start,
                        tool_call(&d, &d, &http, &up, tenant, &json!({})),
                    ));
                }
                results
            })
        })
        .collect();
    let light: Vec<Vec<(Duration, Ended)>> = light.into_iter().map(|l| l.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.join().unwrap();
    }

    // The steady state: the last ten seconds.
    let steady = |r: &&(Duration, Ended)| r.0 >= STEADY_FROM;
    let mut light_calls = 0;
    let mut light_served = 0;
    for (tenant, results) in ["acme", "globex"].iter().zip(&light) {
        let judged: Vec<&(Duration, Ended)> = results.iter().filter(steady).collect();
        let served = judged.iter().filter(|r| r.1 == Ended::Served).count();
        let lost: Vec<_> = judged.iter().filter(|r| r.1 != Ended::Served).collect();
        println!(
            "{tenant}: {served} of {} calls served in the steady state; lost: {lost:?}",
            judged.len()
        );
        light_calls += judged.len();
        light_served += served;
    }
    let secs = (RUN - STEADY_FROM).as_secs_f64();
    let (ok, bounced) = upstream.seen(STEADY_FROM, RUN);
    let light_share = light_served as f64 / light_calls as f64;
    let bounced_share = bounced as f64 / secs / REAL_RATE;
    let served_share = ok as f64 / secs / REAL_RATE;
    let (ok_all, bounced_all) = upstream.seen(Duration::ZERO, RUN);
    println!("whole run: the upstream served {ok_all} calls and answered {bounced_all} with 429");
    let snap = d.get("/v1/tenants/initech").body;
    println!(
        "steady state over {secs} s: light tenants kept {:.1}% of their calls; the upstream answered \
         {:.1}/s (429s: {:.1}% of its limit) and served {:.1}/s ({:.1}% of its capacity); loop view {}",
        light_share * 100.0,
        (ok + bounced) as f64 / secs,
        bounced_share * 100.0,
        ok as f64 / secs,
        served_share * 100.0,
        snap["upstreams"]
    );

    assert!(
        light_share >= 0.90,
        "the light tenants kept only {:.1}% of their calls",
        light_share * 100.0
    );
    assert!(
        bounced_share <= 0.10,
        "the upstream answered 429 to {:.1}% of its limit",
        bounced_share * 100.0
    );
    assert!(
        served_share >= 0.75,
        "the upstream served only {:.1}% of its capacity",
        served_share * 100.0
    );
}
