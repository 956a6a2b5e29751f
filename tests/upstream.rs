//! Upstream-aware admission end to end: tenants call a fake upstream through admitd, the way an MCP
//! server would (admit → call the upstream → release with what it answered).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;

/// An upstream that accepts `limit` requests per wall-clock second (fixed windows from its start) and
/// answers 429 with `Retry-After: 1` past that. It records when each request arrived and what it said.
struct FakeUpstream {
    addr: String,
    start: Instant,
    log: Arc<Mutex<Vec<(Duration, u16)>>>,
}

impl FakeUpstream {
    fn start(limit: usize) -> FakeUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let start = Instant::now();
        let log: Arc<Mutex<Vec<(Duration, u16)>>> = Arc::default();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let log = log2.clone();
                std::thread::spawn(move || serve(stream, start, limit, log));
            }
        });
        FakeUpstream { addr, start, log }
    }

    /// Requests that arrived in [from, to) seconds after the start.
    fn seen(&self, from: f64, to: f64) -> (usize, usize) {
        let log = self.log.lock().unwrap();
        let inside: Vec<_> = log
            .iter()
            .filter(|(t, _)| (from..to).contains(&t.as_secs_f64()))
            .collect();
        (
            inside.len(),
            inside.iter().filter(|(_, s)| *s == 429).count(),
        )
    }
}

fn serve(stream: TcpStream, start: Instant, limit: usize, log: Arc<Mutex<Vec<(Duration, u16)>>>) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut len = 0;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h.trim().is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; len];
        let _ = reader.read_exact(&mut body);
        let at = start.elapsed();
        let status = {
            let mut log = log.lock().unwrap();
            let second = at.as_secs();
            let in_window = log.iter().filter(|(t, _)| t.as_secs() == second).count();
            let status = if in_window >= limit { 429 } else { 200 };
            log.push((at, status));
            status
        };
        let answer = if status == 200 {
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_string()
        } else {
            "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}"
                .to_string()
        };
        if reader.get_mut().write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// One tool call the way an MCP server makes it. Returns (admitted, upstream status).
fn tool_call(
    d: &Daemon,
    http: &reqwest::blocking::Client,
    upstream: &str,
    tenant: &str,
    subject: &str,
    max_wait_ms: Option<u64>,
) -> (bool, Option<u16>) {
    let mut body = json!({"tenant": tenant, "subject": subject, "tool": "query"});
    if let Some(w) = max_wait_ms {
        body["max_wait_ms"] = json!(w);
    }
    let a = d.admit(body);
    if a.status != 200 {
        assert_eq!(a.status, 429, "{:?}", a.body);
        return (false, None);
    }
    let t = Instant::now();
    let r = http
        .get(format!("http://{upstream}/v1/query"))
        .send()
        .expect("upstream");
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut release = json!({"lease_id": a.body["lease_id"], "outcome": if status == 429 { "upstream_rate_limited" } else { "ok" },
        "upstream_status": status, "duration_ms": t.elapsed().as_millis() as u64});
    if let Some(ra) = retry_after {
        release["retry_after"] = json!(ra);
    }
    assert_eq!(d.post("/v1/release", release).status, 200);
    (true, Some(status))
}

#[test]
fn a_shared_upstream_sees_no_more_than_its_limit_and_light_tenants_lose_nothing() {
    let upstream = FakeUpstream::start(20);
    // Sized from the published limit (70% headroom: 14/s), shared by every tenant.
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 64\n[limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 64\n\
         [upstreams.api]\npublished_limit = \"20/s\"\nburst = 5\nshared = true\n[tools.query]\nupstream = \"api\"\n",
    ));
    let run_for = Duration::from_secs(20);
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let loop_admitted = Arc::new(AtomicU64::new(0));
    let loop_calls = Arc::new(AtomicU64::new(0));

    // The runaway: sixteen parallel loops on one credential. On default settings it accepts holds of
    // up to 2 s, so without a fair share its queued reservations would sit in front of everyone else.
    let loops: Vec<_> = (0..16)
        .map(|_| {
            let (d, stop, admitted, calls, up) = (
                d.clone(),
                stop.clone(),
                loop_admitted.clone(),
                loop_calls.clone(),
                upstream.addr.clone(),
            );
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::new();
                while !stop.load(Ordering::Relaxed) {
                    // A runaway agent on default settings: it accepts the daemon's holds.
                    let (ok, _) = tool_call(&d, &http, &up, "initech", "loop-bot", None);
                    calls.fetch_add(1, Ordering::Relaxed);
                    if ok {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let light: Vec<_> = ["acme", "globex"]
        .into_iter()
        .map(|tenant| {
            let (d, up) = (d.clone(), upstream.addr.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::new();
                let mut results = Vec::new();
                for i in 0..40u64 {
                    let due = start + Duration::from_millis(500 * i);
                    if let Some(w) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(w);
                    }
                    results.push(tool_call(&d, &http, &up, tenant, "assistant", None));
                }
                results
            })
        })
        .collect();

    std::thread::sleep(run_for.saturating_sub(start.elapsed()));
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.join().unwrap();
    }
    let light: Vec<Vec<(bool, Option<u16>)>> =
        light.into_iter().map(|l| l.join().unwrap()).collect();
    let offset = upstream.start.elapsed().as_secs_f64() - start.elapsed().as_secs_f64();
    let (seen, rejected) = upstream.seen(1.0 + offset, 20.0 + offset);
    let per_sec = seen as f64 / 19.0;
    let snap = d.get("/v1/tenants/initech").body;
    println!(
        "upstream saw {per_sec:.2}/s after the first second ({rejected} rejected); loop admitted {} of {} calls; light tenants {:?}; loop view {}",
        loop_admitted.load(Ordering::Relaxed),
        loop_calls.load(Ordering::Relaxed),
        light.iter().map(|l| l.iter().filter(|r| r.0 && r.1 == Some(200)).count()).collect::<Vec<_>>(),
        snap["upstreams"]
    );
    assert!(
        per_sec <= 20.0 * 1.05,
        "the upstream saw {per_sec:.2} requests/s"
    );
    assert_eq!(rejected, 0, "the upstream had to reject calls");
    for (tenant, results) in ["acme", "globex"].iter().zip(&light) {
        let lost: Vec<_> = results
            .iter()
            .enumerate()
            .filter(|(_, r)| !(r.0 && r.1 == Some(200)))
            .collect();
        assert!(lost.is_empty(), "{tenant} lost calls: {lost:?}");
    }
    // The loop gets what the light tenants leave of the 14/s budget, not more.
    let admitted = loop_admitted.load(Ordering::Relaxed) as f64;
    let left = (14.0 - 4.0) * 20.0;
    assert!(
        admitted <= left + 5.0 + 14.0,
        "the loop took {admitted}, more than the {left} left"
    );
    assert!(
        admitted >= left * 0.6,
        "the loop got only {admitted} of the {left} left"
    );
}

#[test]
fn an_over_sized_budget_backs_off_when_the_upstream_answers_429() {
    // The operator configured 40/s; the upstream really takes 20/s.
    let upstream = FakeUpstream::start(20);
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 64\n[limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 64\n\
         [upstreams.api]\nrate = \"40/s\"\nburst = 10\n[tools.query]\nupstream = \"api\"\n",
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let loops: Vec<_> = (0..4)
        .map(|_| {
            let (d, stop, up) = (d.clone(), stop.clone(), upstream.addr.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::new();
                while !stop.load(Ordering::Relaxed) {
                    tool_call(&d, &http, &up, "initech", "loop-bot", Some(0));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(12).saturating_sub(start.elapsed()));
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.join().unwrap();
    }
    let offset = upstream.start.elapsed().as_secs_f64() - start.elapsed().as_secs_f64();
    let (seen, rejected) = upstream.seen(2.0 + offset, 12.0 + offset);
    let snap = d.get("/v1/tenants/initech").body;
    println!("after the first two seconds the upstream saw {:.1}/s, {rejected} of {seen} rejected; view {}", seen as f64 / 10.0, snap["upstreams"]);
    // Without feedback a 40/s budget would send 40/s and half would bounce. With penalties and the AIMD
    // cut the daemon keeps close to what the upstream takes.
    assert!(
        (seen as f64 / 10.0) <= 20.0 * 1.25,
        "the upstream saw {:.1}/s",
        seen as f64 / 10.0
    );
    assert!(
        (rejected as f64) <= 0.2 * seen as f64,
        "{rejected} of {seen} calls bounced"
    );
}
