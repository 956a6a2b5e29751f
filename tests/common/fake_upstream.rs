//! A fake upstream with a true limit: a token bucket refilled on the wall clock, answering 429 with
//! `Retry-After: 1` past it. The limit can be changed while it runs. It records when each request
//! arrived (since a given start) and what it answered, and plays the MCP server's side of a tool
//! call against an admitd (admit, call the upstream, release with what it answered).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Daemon;

/// A token bucket, refilled on the wall clock.
struct TokenBucket {
    tokens: f64,
    at: Instant,
}

/// The fake upstream.
pub struct FakeUpstream {
    pub addr: String,
    /// (arrived since the start, status) of every request.
    log: Arc<Mutex<Vec<(Duration, u16)>>>,
    /// The limit in requests per second, as f64 bits.
    rate: Arc<AtomicU64>,
}

impl FakeUpstream {
    /// Starts an upstream that takes `rate` requests/s, up to `burst` at once after a quiet spell.
    pub fn start(start: Instant, rate: f64, burst: f64) -> FakeUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let log: Arc<Mutex<Vec<(Duration, u16)>>> = Arc::default();
        let rate = Arc::new(AtomicU64::new(rate.to_bits()));
        let bucket = Arc::new(Mutex::new(TokenBucket {
            tokens: burst,
            at: Instant::now(),
        }));
        let (log2, rate2) = (log.clone(), rate.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let (log, bucket, rate) = (log2.clone(), bucket.clone(), rate2.clone());
                std::thread::spawn(move || serve(stream, start, burst, &rate, &bucket, &log));
            }
        });
        FakeUpstream { addr, log, rate }
    }

    /// Changes the limit from now on.
    pub fn set_rate(&self, rate: f64) {
        self.rate.store(rate.to_bits(), Ordering::Release);
    }

    /// (answered 200, answered 429) among the requests that arrived in [from, to).
    pub fn seen(&self, from: Duration, to: Duration) -> (usize, usize) {
        let log = self.log.lock().unwrap();
        let inside = log.iter().filter(|(t, _)| (from..to).contains(t));
        inside.fold((0, 0), |(ok, bounced), (_, s)| match s {
            200 => (ok + 1, bounced),
            _ => (ok, bounced + 1),
        })
    }

    /// (served, 429) in each second from `from` to `to`, for a report.
    pub fn per_second(&self, from: Duration, to: Duration) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut t = from;
        while t < to {
            out.push(self.seen(t, t + Duration::from_secs(1)));
            t += Duration::from_secs(1);
        }
        out
    }

    /// The first instant from `from` on at which the upstream served at least `rate` per second
    /// over the `window` that follows it, looking in steps of 100 ms up to `to`.
    pub fn first_served(
        &self,
        from: Duration,
        to: Duration,
        window: Duration,
        rate: f64,
    ) -> Option<Duration> {
        let mut t = from;
        while t + window <= to {
            if self.seen(t, t + window).0 as f64 >= rate * window.as_secs_f64() {
                return Some(t);
            }
            t += Duration::from_millis(100);
        }
        None
    }
}

fn serve(
    stream: TcpStream,
    start: Instant,
    burst: f64,
    rate: &AtomicU64,
    bucket: &Mutex<TokenBucket>,
    log: &Mutex<Vec<(Duration, u16)>>,
) {
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
        let status = {
            let mut b = bucket.lock().unwrap();
            let now = Instant::now();
            let per_sec = f64::from_bits(rate.load(Ordering::Acquire));
            let refill = now.duration_since(b.at).as_secs_f64() * per_sec;
            b.tokens = (b.tokens + refill).min(burst);
            b.at = now;
            let status = if b.tokens >= 1.0 {
                b.tokens -= 1.0;
                200
            } else {
                429
            };
            log.lock().unwrap().push((start.elapsed(), status));
            status
        };
        let answer = match status {
            200 => "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            _ => "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}",
        };
        if reader.get_mut().write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// How one tool call ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// Admitted, and the upstream answered 200.
    Served,
    /// Admitted, and the upstream answered 429.
    Bounced,
    /// Refused by admitd, with this scope.
    Refused(String),
}

/// One tool call the way an MCP server makes it: admit through `admit_at`, call the upstream,
/// release through `release_at` (another replica, with a shared store) with its answer. `extra`
/// adds fields to the admission (`max_wait_ms`).
pub fn tool_call(
    admit_at: &Daemon,
    release_at: &Daemon,
    http: &reqwest::blocking::Client,
    upstream: &str,
    tenant: &str,
    extra: &Value,
) -> Ended {
    let mut body = json!({"tenant": tenant, "subject": "agent", "tool": "query"});
    if let (Some(b), Some(x)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(x.clone());
    }
    let a = admit_at.admit(body);
    if a.status != 200 {
        assert!(
            a.status == 429 || a.status == 503,
            "{} {:?}",
            a.status,
            a.body
        );
        let scope = a.body["scope"].as_str().or(a.body["error"].as_str());
        return Ended::Refused(scope.unwrap_or("?").to_string());
    }
    let t = Instant::now();
    let r = http
        .get(format!("http://{upstream}/v1/query"))
        .send()
        .expect("upstream");
    let status = r.status().as_u16();
    let mut release = json!({"lease_id": a.body["lease_id"], "outcome": "ok",
        "upstream_status": status, "duration_ms": t.elapsed().as_millis() as u64});
    if status == 429 {
        release["outcome"] = json!("upstream_rate_limited");
        if let Some(ra) = r.headers().get("retry-after").and_then(|v| v.to_str().ok()) {
            release["retry_after"] = json!(ra);
        }
    }
    assert_eq!(release_at.post("/v1/release", release).status, 200);
    match status {
        200 => Ended::Served,
        429 => Ended::Bounced,
        s => panic!("the fake upstream answered {s}"),
    }
}
