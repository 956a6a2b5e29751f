//! HTTP load generator for admitd, and the *floor* it is compared against.
//!
//! Run it through cargo so it is built with the bench profile:
//! `cargo bench --bench loadgen -- --url http://127.0.0.1:9470 --connections 64 --duration 10`.
//! With no arguments it prints its usage and exits, so a plain `cargo bench` does not hang on it.
//!
//! Why a hand-written client: the numbers must describe the server, so the client has to cost as little
//! per request as possible and be fully predictable. Each connection is one task with one keep-alive
//! TCP stream; requests are precomputed byte strings written with a single `write_all`, and the answer
//! is read by parsing the status line, `Content-Length` (or chunked framing) and nothing else.
//!
//! Two ways to offer load:
//! - closed loop (default): each connection sends its next request as soon as the previous answer
//!   arrives. This finds the throughput ceiling; latency here is a function of the concurrency.
//! - open loop (`--rate R`): request `n` is due at `start + n/R`, handed round-robin to the
//!   connections. Latency is measured from the *due* time, not from when the request was actually
//!   written, so a server that stalls is charged for every request that queued behind the stall
//!   (no coordinated omission).
//!
//! The floor (`--floor`, or `--floor-only PORT` in a process of its own) is a bare warp server that
//! parses the same JSON body with serde and answers a JSON body of about the same size as an admission,
//! without any admission logic. Running the same load against it on the same machine gives the cost of
//! HTTP + JSON alone; admitd's throughput is reported as a fraction of it.
//!
//! Safety: only `http://127.0.0.1` targets are accepted; every run stops sending after `--warmup +
//! --duration` seconds (an open loop whose server fell behind gives up 5 s later), each request has a
//! timeout, and the floor serves loopback only and stops after `--lifetime` seconds even if nobody
//! stops it.

// The same allocator as the daemon (src/main.rs), so that the floor differs from admitd only in what
// admitd does, not in how it allocates.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
// ... with the daemon's options (see src/main.rs).
#[cfg(not(target_env = "msvc"))]
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: &[u8; 27] = b"tcache_nslots_small_min:64\0";

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warp::Filter;

const USAGE: &str = "\
loadgen: HTTP load generator for admitd, and a bare warp server (the floor) to compare it with.

usage: cargo bench --bench loadgen -- [options]

target
  --url URL            server to load; http://127.0.0.1 only (default http://127.0.0.1:9470)
  --floor              start the floor in this process and load it instead of --url
  --floor-only [PORT]  only serve the floor on 127.0.0.1:PORT (default 9471) until killed
                       or --lifetime seconds pass. The floor also takes OTLP/HTTP span exports
                       at POST /v1/traces (and counts them at GET /v1/traces/received), to
                       measure span export against a collector that answers
  --floor-threads N    floor worker threads (default: the CPUs this process may run on)
  --lifetime SECS      the floor stops by itself after this long (default 3600)

load
  --mode MODE          admit          POST /v1/admit (default)
                       admit-release  POST /v1/admit, then POST /v1/release with the lease
                       floor-path     POST the admit body to /floor (a route only the floor has)
                       populate       admit and release once per distinct subject p<i>,
                                      i in [--offset, --offset + --count), tenant t<i % --tenants>
  --connections N      keep-alive connections (default 8)
  --duration SECS      measured time (default 10; for populate: the longest it may take)
  --warmup SECS        load offered before measuring starts (default 2; 0 for populate)
  --rate R             open loop: R requests/s in total on a fixed timetable (default: closed loop)
  --tenants N          tenants t0..t<N-1> (default 1000)
  --tenant-prefix P    name the tenants P0..P<N-1> instead (two loads on distinct tenants)
  --subjects N         subjects s0..s<N-1> per tenant (default 100)
  --tools N            tools tool0..tool<N-1> (default 8)
  --runs N             give each admission an agent run r0..r<N-1> of its subject (default 0:
                       no run), for spend budgets per run
  --pool N             distinct precomputed request bodies (default 65536)
  --count N            populate: subjects to create (default 10000)
  --offset N           populate: first subject number (default 0)
  --seed N             seed of the body pool (default 1)
  --threads N          client runtime threads (default: the CPUs this process may run on)
  --timeout-ms N       per-request timeout (default 5000)
  --spin-us N          open loop: stop sleeping N us before a due time and yield until it comes
                       (default 1500; the tokio timer ticks every millisecond)

report
  --server-pid PID     read the server's CPU time from /proc/PID/stat around the measured window
                       and print CPU microseconds per request
  --clk-tck N          clock ticks per second of /proc/PID/stat (default 100; see `getconf CLK_TCK`)
  --label TEXT         a name for this run, echoed in the output
  --json               print one JSON line with the results on stdout (the text report goes to stderr)
";

// ---- command line -----------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Admit,
    AdmitRelease,
    FloorPath,
    Populate,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Admit => "admit",
            Mode::AdmitRelease => "admit-release",
            Mode::FloorPath => "floor-path",
            Mode::Populate => "populate",
        }
    }
}

#[derive(Debug, Clone)]
struct Args {
    url: String,
    floor: bool,
    floor_only: Option<u16>,
    floor_threads: Option<usize>,
    lifetime: f64,
    mode: Mode,
    connections: usize,
    duration: f64,
    warmup: Option<f64>,
    rate: Option<f64>,
    tenants: u64,
    subjects: u64,
    tools: u64,
    runs: u64,
    pool: usize,
    count: u64,
    offset: u64,
    seed: u64,
    threads: usize,
    timeout_ms: u64,
    spin_us: u64,
    server_pid: Option<u32>,
    clk_tck: f64,
    label: Option<String>,
    json: bool,
}

impl Default for Args {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Args {
            url: "http://127.0.0.1:9470".into(),
            floor: false,
            floor_only: None,
            floor_threads: None,
            lifetime: 3600.0,
            mode: Mode::Admit,
            connections: 8,
            duration: 10.0,
            warmup: None,
            rate: None,
            tenants: 1000,
            subjects: 100,
            tools: 8,
            runs: 0,
            pool: 65_536,
            count: 10_000,
            offset: 0,
            seed: 1,
            threads: cpus,
            timeout_ms: 5_000,
            spin_us: 1_500,
            server_pid: None,
            clk_tck: 100.0,
            label: None,
            json: false,
        }
    }
}

fn number<T>(flag: &str, value: Option<String>, min: T, max: T) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let text = value.ok_or_else(|| format!("{flag} needs a value"))?;
    let v: T = text
        .parse()
        .map_err(|_| format!("{flag}: {text:?} is not a number"))?;
    if v < min || v > max {
        return Err(format!("{flag} must be from {min} to {max}, not {v}"));
    }
    Ok(v)
}

/// Parses the command line. `Ok(None)` means: nothing asked, print the usage.
fn parse_args(raw: Vec<String>) -> Result<Option<Args>, String> {
    // cargo adds `--bench` when it runs a bench target.
    let raw: Vec<String> = raw.into_iter().filter(|a| a != "--bench").collect();
    if raw.is_empty() || raw.iter().any(|a| a == "--help" || a == "-h") {
        return Ok(None);
    }
    let mut a = Args::default();
    let mut it = raw.into_iter().peekable();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--url" => a.url = it.next().ok_or("--url needs a value")?,
            "--floor" => a.floor = true,
            "--floor-only" => {
                let port = match it.peek() {
                    Some(v) if !v.starts_with("--") => {
                        number("--floor-only", it.next(), 1u16, u16::MAX)?
                    }
                    _ => 9471,
                };
                a.floor_only = Some(port);
            }
            "--floor-threads" => a.floor_threads = Some(number(&flag, it.next(), 1, 256)?),
            "--lifetime" => a.lifetime = number(&flag, it.next(), 1.0, 86_400.0)?,
            "--mode" => {
                a.mode = match it.next().as_deref() {
                    Some("admit") => Mode::Admit,
                    Some("admit-release") => Mode::AdmitRelease,
                    Some("floor-path") => Mode::FloorPath,
                    Some("populate") => Mode::Populate,
                    other => {
                        return Err(format!(
                    "--mode must be admit, admit-release, floor-path or populate, not {other:?}"
                ))
                    }
                }
            }
            "--connections" => a.connections = number(&flag, it.next(), 1, 4096)?,
            "--duration" => a.duration = number(&flag, it.next(), 0.1, 3600.0)?,
            "--warmup" => a.warmup = Some(number(&flag, it.next(), 0.0, 600.0)?),
            "--rate" => a.rate = Some(number(&flag, it.next(), 1.0, 10_000_000.0)?),
            "--tenants" => a.tenants = number(&flag, it.next(), 1, 10_000_000)?,
            "--subjects" => a.subjects = number(&flag, it.next(), 1, 100_000_000)?,
            "--tools" => a.tools = number(&flag, it.next(), 1, 10_000)?,
            "--runs" => a.runs = number(&flag, it.next(), 0, 100_000_000)?,
            "--tenant-prefix" => {
                let p = it.next().ok_or("--tenant-prefix needs a value")?;
                if p.is_empty() || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                    return Err(format!(
                        "--tenant-prefix {p:?}: letters, digits and '-' only"
                    ));
                }
                let _ = TENANT_PREFIX.set(p.to_string());
            }
            "--pool" => a.pool = number(&flag, it.next(), 1, 10_000_000)?,
            "--count" => a.count = number(&flag, it.next(), 1, 100_000_000)?,
            "--offset" => a.offset = number(&flag, it.next(), 0, u64::MAX / 2)?,
            "--seed" => a.seed = number(&flag, it.next(), 0, u64::MAX)?,
            "--threads" => a.threads = number(&flag, it.next(), 1, 256)?,
            "--timeout-ms" => a.timeout_ms = number(&flag, it.next(), 1, 600_000)?,
            "--spin-us" => a.spin_us = number(&flag, it.next(), 0, 100_000)?,
            "--server-pid" => a.server_pid = Some(number(&flag, it.next(), 1, u32::MAX)?),
            "--clk-tck" => a.clk_tck = number(&flag, it.next(), 1.0, 1_000_000.0)?,
            "--label" => a.label = Some(it.next().ok_or("--label needs a value")?),
            "--json" => a.json = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(a))
}

/// The socket address and `Host` header of an `http://127.0.0.1:PORT` URL. Anything else is refused:
/// this tool only ever loads a server on the same machine.
fn parse_target(url: &str) -> Result<(SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--url {url:?}: only http:// URLs are supported"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("--url {url:?}: bad port {p:?}"))?,
        ),
        None => (authority, 80),
    };
    if host != "127.0.0.1" {
        return Err(format!(
            "--url {url:?}: refusing a target other than 127.0.0.1 (this generator loads the local machine only)"
        ));
    }
    Ok((
        SocketAddr::from(([127, 0, 0, 1], port)),
        authority.to_string(),
    ))
}

// ---- requests ---------------------------------------------------------------------------------------

/// How long an open loop keeps sending requests that were due before the deadline.
const GIVE_UP_AFTER: Duration = Duration::from_secs(5);

/// splitmix64: small, fast and good enough to spread keys.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn post(path: &str, host: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// `--tenant-prefix`, set once while the arguments are read.
static TENANT_PREFIX: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn admit_body(tenant: u64, subject: &str, tool: u64) -> String {
    let prefix = TENANT_PREFIX.get().map_or("t", String::as_str);
    format!(r#"{{"tenant":"{prefix}{tenant}","subject":"{subject}","tool":"tool{tool}","cost":1}}"#)
}

/// A pool of admission requests over random (tenant, subject, tool) keys, so that no key is hot.
fn request_pool(a: &Args, path: &str, host: &str) -> Vec<Vec<u8>> {
    let mut rng = Rng(a.seed);
    (0..a.pool)
        .map(|_| {
            let tenant = rng.below(a.tenants);
            let subject = format!("s{}", rng.below(a.subjects));
            let tool = rng.below(a.tools);
            let mut body = admit_body(tenant, &subject, tool);
            if a.runs > 0 {
                body.pop();
                body.push_str(&format!(r#","run":"{subject}-r{}"}}"#, rng.below(a.runs)));
            }
            post(path, host, &body)
        })
        .collect()
}

fn release_request(host: &str, lease_id: &str) -> Vec<u8> {
    let body = serde_json::json!({"lease_id": lease_id, "outcome": "ok"}).to_string();
    post("/v1/release", host, &body)
}

#[derive(Deserialize)]
struct AdmitAnswer {
    lease_id: Option<String>,
}

/// Where each connection takes its next request from.
enum Source {
    /// Cycle through a precomputed pool (each connection starts at a different place).
    Pool(Vec<Vec<u8>>),
    /// One request per number, each number handed out once (populate mode).
    Sequence {
        next: AtomicU64,
        end: u64,
        tenants: u64,
    },
}

// ---- HTTP/1.1 client --------------------------------------------------------------------------------

fn bad_response(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

enum Framing {
    Length(usize),
    Chunked,
    Empty,
}

/// Status, body framing and whether the server will close the connection.
fn parse_head(head: &str) -> io::Result<(u16, Framing, bool)> {
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(bad_response("not an HTTP/1.x response"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad_response("bad status line"))?;
    let mut close = version == "HTTP/1.0";
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse()
                    .map_err(|_| bad_response("bad Content-Length"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        }
    }
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked,
        (false, Some(n)) => Framing::Length(n),
        (false, None) if status == 204 || status == 304 || status < 200 => Framing::Empty,
        (false, None) => {
            return Err(bad_response(
                "response has neither Content-Length nor chunked body",
            ))
        }
    };
    Ok((status, framing, close))
}

/// One keep-alive connection.
struct Conn {
    stream: TcpStream,
    /// Bytes read but not yet consumed.
    buf: Vec<u8>,
    /// The body of the last response.
    body: Vec<u8>,
    /// The server said it will close the connection after the last response.
    close: bool,
}

impl Conn {
    async fn connect(addr: SocketAddr) -> io::Result<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(8192),
            body: Vec::with_capacity(1024),
            close: false,
        })
    }

    async fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 8192];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "server closed the connection",
            ));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// Sends one request and reads its whole response. Returns the status; the body is in `self.body`.
    async fn exchange(&mut self, request: &[u8]) -> io::Result<u16> {
        self.stream.write_all(request).await?;
        let head_end = loop {
            if let Some(p) = find(&self.buf, b"\r\n\r\n") {
                break p + 4;
            }
            if self.buf.len() > 64 * 1024 {
                return Err(bad_response("response header over 64 KiB"));
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buf[..head_end])
            .map_err(|_| bad_response("response header is not UTF-8"))?;
        let (status, framing, close) = parse_head(head)?;
        self.buf.drain(..head_end);
        self.body.clear();
        match framing {
            Framing::Length(n) => {
                while self.buf.len() < n {
                    self.fill().await?;
                }
                self.body.extend_from_slice(&self.buf[..n]);
                self.buf.drain(..n);
            }
            Framing::Chunked => self.read_chunked().await?,
            Framing::Empty => {}
        }
        self.close = close;
        Ok(status)
    }

    async fn line(&mut self) -> io::Result<usize> {
        loop {
            if let Some(p) = find(&self.buf, b"\r\n") {
                return Ok(p);
            }
            if self.buf.len() > 4096 {
                return Err(bad_response("chunk header too long"));
            }
            self.fill().await?;
        }
    }

    async fn read_chunked(&mut self) -> io::Result<()> {
        loop {
            let end = self.line().await?;
            let size = std::str::from_utf8(&self.buf[..end])
                .ok()
                .and_then(|s| {
                    usize::from_str_radix(s.split(';').next().unwrap_or_default().trim(), 16).ok()
                })
                .ok_or_else(|| bad_response("bad chunk size"))?;
            self.buf.drain(..end + 2);
            if size == 0 {
                // Trailers, then the empty line that ends the message.
                loop {
                    let end = self.line().await?;
                    self.buf.drain(..end + 2);
                    if end == 0 {
                        return Ok(());
                    }
                }
            }
            if self.body.len() + size > 16 * 1024 * 1024 {
                return Err(bad_response("response body over 16 MiB"));
            }
            while self.buf.len() < size + 2 {
                self.fill().await?;
            }
            self.body.extend_from_slice(&self.buf[..size]);
            self.buf.drain(..size + 2);
        }
    }
}

// ---- latency histogram ------------------------------------------------------------------------------

/// Sub-buckets per power of two: values are kept to within 1/64 (1.6%).
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = (SUB as usize) * (64 - SUB_BITS as usize + 1);

/// A log-linear histogram of nanoseconds: exact below 64 ns, then 64 linear buckets per power of two.
/// Fixed size (about 30 KiB) whatever the number of samples.
#[derive(Clone)]
struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Histogram {
    fn new() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            max: 0,
        }
    }

    fn index(v: u64) -> usize {
        if v < SUB {
            v as usize
        } else {
            let shift = 63 - v.leading_zeros() - SUB_BITS;
            (SUB as usize) * shift as usize + (v >> shift) as usize
        }
    }

    /// A representative value of bucket `i`: its midpoint.
    fn value(i: usize) -> u64 {
        if i < SUB as usize {
            return i as u64;
        }
        let shift = (i / SUB as usize - 1) as u32;
        let low = (SUB + (i as u64 % SUB)) << shift;
        low + ((1u64 << shift) >> 1)
    }

    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[Self::index(ns)] += 1;
        self.total += 1;
        self.max = self.max.max(ns);
    }

    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    /// The value at quantile `q` (0..=1), in nanoseconds.
    fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::value(i).min(self.max);
            }
        }
        self.max
    }
}

// ---- load -------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Stats {
    /// Latency of admissions (or of every request in modes without a release).
    first: Histogram,
    /// Latency of releases, from the admission answer to the release answer.
    release: Histogram,
    /// Open loop: how late the client wrote each request after its due time. If this is not small
    /// next to the latency, the client (not the server) was the bottleneck.
    lag: Histogram,
    requests: u64,
    ok: u64,
    shed: u64,
    other: u64,
    errors: u64,
    /// Open loop: requests never sent because the server fell too far behind (also in `errors`).
    unsent: u64,
}

impl Stats {
    fn new() -> Self {
        Stats {
            first: Histogram::new(),
            release: Histogram::new(),
            lag: Histogram::new(),
            requests: 0,
            ok: 0,
            shed: 0,
            other: 0,
            errors: 0,
            unsent: 0,
        }
    }

    fn status(&mut self, status: u16) {
        self.requests += 1;
        match status {
            200..=299 => self.ok += 1,
            429 => self.shed += 1,
            _ => self.other += 1,
        }
    }

    fn merge(&mut self, o: &Stats) {
        self.first.merge(&o.first);
        self.release.merge(&o.release);
        self.lag.merge(&o.lag);
        self.requests += o.requests;
        self.ok += o.ok;
        self.shed += o.shed;
        self.other += o.other;
        self.errors += o.errors;
        self.unsent += o.unsent;
    }
}

struct Run {
    addr: SocketAddr,
    host: String,
    mode: Mode,
    source: Source,
    connections: usize,
    /// When load starts; open-loop due times count from here.
    t0: Instant,
    /// Requests due (open loop) or sent (closed loop) from here on are measured.
    measure_from: Instant,
    /// No request is sent from here on.
    deadline: Instant,
    /// Open loop against a server that cannot keep up: requests still unsent by now are given up.
    give_up: Instant,
    /// Open loop: nanoseconds between two due times, over all connections.
    period_ns: Option<f64>,
    /// Open loop: how long before a due time to stop sleeping and start yielding.
    spin: Duration,
    timeout: Duration,
}

/// Waits until `due` with better than timer-wheel precision: the tokio timer has a 1 ms tick, so sleep
/// until `spin` before, then yield until the moment comes. The yielding keeps the client's core busy
/// (it has a core of its own), and it keeps the client's lateness (`send lag`) in single microseconds
/// where a plain sleep would add up to a millisecond to every latency.
async fn wait_until(due: Instant, spin: Duration) {
    if let Some(early) = due.checked_sub(spin) {
        if early > Instant::now() {
            tokio::time::sleep_until(early.into()).await;
        }
    }
    while Instant::now() < due {
        tokio::task::yield_now().await;
    }
}

async fn connection(run: Arc<Run>, idx: usize) -> Stats {
    let mut st = Stats::new();
    // Connect before the start, so that connection setup is not part of any measured request.
    let mut conn: Option<Conn> = tokio::time::timeout(run.timeout, Conn::connect(run.addr))
        .await
        .ok()
        .and_then(Result::ok);
    tokio::time::sleep_until(run.t0.into()).await;
    let mut next = match &run.source {
        Source::Pool(p) => idx.wrapping_mul(7919) % p.len(),
        Source::Sequence { .. } => 0,
    };
    let mut seq = 0u64;
    let mut owned;
    let due_of = |seq: u64, p: f64| {
        let slot = seq * run.connections as u64 + idx as u64;
        run.t0 + Duration::from_nanos((slot as f64 * p) as u64)
    };
    loop {
        let due = match run.period_ns {
            Some(p) => due_of(seq, p),
            None => Instant::now(),
        };
        if due >= run.deadline {
            break;
        }
        if let Some(p) = run.period_ns.filter(|_| Instant::now() >= run.give_up) {
            // The server is so far behind the timetable that finishing it would take too long; the
            // rest of this connection's requests count as unanswered.
            let mut rest = seq;
            while due_of(rest, p) < run.deadline {
                if due_of(rest, p) >= run.measure_from {
                    st.unsent += 1;
                    st.errors += 1;
                }
                rest += 1;
            }
            break;
        }
        seq += 1;
        if run.period_ns.is_some() {
            wait_until(due, run.spin).await;
        }
        let request: &[u8] = match &run.source {
            Source::Pool(pool) => {
                let r = &pool[next];
                next = (next + 1) % pool.len();
                r
            }
            Source::Sequence { next, end, tenants } => {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= *end {
                    break;
                }
                owned = post(
                    "/v1/admit",
                    &run.host,
                    &admit_body(i % tenants, &format!("p{i}"), 0),
                );
                &owned
            }
        };
        let measured = due >= run.measure_from;
        let mut c = match conn.take() {
            Some(c) => c,
            None => match tokio::time::timeout(run.timeout, Conn::connect(run.addr)).await {
                Ok(Ok(c)) => c,
                _ => {
                    if measured {
                        st.errors += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        if measured && run.period_ns.is_some() {
            st.lag.record(due.elapsed());
        }
        let status = match tokio::time::timeout(run.timeout, c.exchange(request)).await {
            Ok(Ok(s)) => s,
            _ => {
                if measured {
                    st.errors += 1;
                }
                continue;
            }
        };
        let answered = Instant::now();
        if measured {
            st.first.record(answered - due);
            st.status(status);
        }
        let releases = matches!(run.mode, Mode::AdmitRelease | Mode::Populate);
        if releases && (200..300).contains(&status) {
            let lease = serde_json::from_slice::<AdmitAnswer>(&c.body)
                .ok()
                .and_then(|a| a.lease_id);
            let Some(lease) = lease else {
                if measured {
                    st.errors += 1;
                }
                if !c.close {
                    conn = Some(c);
                }
                continue;
            };
            let rel = release_request(&run.host, &lease);
            match tokio::time::timeout(run.timeout, c.exchange(&rel)).await {
                Ok(Ok(s)) => {
                    if measured {
                        st.release.record(answered.elapsed());
                        st.status(s);
                    }
                }
                _ => {
                    if measured {
                        st.errors += 1;
                    }
                    continue;
                }
            }
        }
        if !c.close {
            conn = Some(c);
        }
    }
    st
}

// ---- CPU accounting ---------------------------------------------------------------------------------

/// utime + stime of a process, in clock ticks, from /proc/PID/stat (all its threads).
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields after it are space-separated, starting with
    // field 3 (state). utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// CPU time stolen from this virtual machine by its host, over all CPUs, in clock ticks (the `steal`
/// column of /proc/stat). Stalls of the whole VM show up here and nowhere else.
fn steal_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    line.split_whitespace().nth(8)?.parse().ok()
}

// ---- report -----------------------------------------------------------------------------------------

#[derive(Serialize)]
struct Latency {
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    samples: u64,
}

impl Latency {
    fn of(h: &Histogram) -> Latency {
        let us = |ns: u64| (ns as f64 / 100.0).round() / 10.0;
        Latency {
            p50_us: us(h.quantile(0.50)),
            p90_us: us(h.quantile(0.90)),
            p99_us: us(h.quantile(0.99)),
            p999_us: us(h.quantile(0.999)),
            max_us: us(h.max),
            samples: h.total,
        }
    }
}

#[derive(Serialize)]
struct Report {
    label: Option<String>,
    target: String,
    mode: &'static str,
    #[serde(rename = "loop")]
    loop_: &'static str,
    connections: usize,
    rate: Option<f64>,
    duration_s: f64,
    requests: u64,
    rps: f64,
    ok_2xx: u64,
    shed_429: u64,
    other_status: u64,
    errors: u64,
    unsent: u64,
    latency: Latency,
    release_latency: Option<Latency>,
    send_lag: Option<Latency>,
    server_cpu_us_per_req: Option<f64>,
    server_cpu_pct: Option<f64>,
    client_cpu_pct: Option<f64>,
    steal_ms: Option<f64>,
}

fn print_text_to(r: &Report, to_stderr: bool) {
    let l = &r.latency;
    let mut out = String::new();
    out += &format!(
        "{}{} {} {} loop, {} connections{}, {:.1} s measured\n",
        r.label
            .as_ref()
            .map(|l| format!("[{l}] "))
            .unwrap_or_default(),
        r.target,
        r.mode,
        r.loop_,
        r.connections,
        r.rate
            .map(|x| format!(", {x} req/s offered"))
            .unwrap_or_default(),
        r.duration_s,
    );
    out += &format!(
        "  requests {} ({:.0}/s)  2xx {}  429 {}  other {}  errors {}\n",
        r.requests, r.rps, r.ok_2xx, r.shed_429, r.other_status, r.errors
    );
    if r.unsent > 0 {
        out += &format!(
            "  unsent {} (the server fell more than {} s behind the timetable; counted in errors)\n",
            r.unsent,
            GIVE_UP_AFTER.as_secs()
        );
    }
    let first = if r.release_latency.is_some() {
        "admit  "
    } else {
        "latency"
    };
    out += &format!(
        "  {first} us  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}\n",
        l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
    );
    if let Some(l) = &r.release_latency {
        out += &format!(
            "  release us  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}\n",
            l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
        );
    }
    if let Some(l) = &r.send_lag {
        out += &format!(
            "  send lag us  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}  (client lateness behind the timetable)\n",
            l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
        );
    }
    if let (Some(per), Some(pct)) = (r.server_cpu_us_per_req, r.server_cpu_pct) {
        out += &format!("  server CPU {per:.2} us/request ({pct:.0}% of one core)\n");
    }
    if let Some(pct) = r.client_cpu_pct {
        out += &format!("  client CPU {pct:.0}% of one core\n");
    }
    if let Some(ms) = r.steal_ms.filter(|&ms| ms > 0.0) {
        out +=
            &format!("  steal {ms:.0} ms (CPU time the host took from this VM during the run)\n");
    }
    if to_stderr {
        eprint!("{out}");
    } else {
        print!("{out}");
    }
}

// ---- the floor --------------------------------------------------------------------------------------

/// The same fields as an admission request; parsed and checked like admitd would, then ignored.
#[derive(Deserialize)]
struct FloorAdmit {
    tenant: String,
    subject: String,
    tool: String,
    upstream: Option<String>,
    cost: Option<f64>,
}

#[derive(Deserialize)]
struct FloorRelease {
    lease_id: String,
    outcome: String,
}

/// About the size of admitd's admission answer (~110 bytes).
#[derive(Serialize)]
struct FloorAnswer {
    admitted: bool,
    lease_id: String,
    waited_ms: u64,
    mode: &'static str,
    remaining: u64,
    limit: u64,
    reset_ms: u64,
}

fn floor_routes() -> impl Filter<Extract = (impl warp::Reply,), Error = warp::Rejection> + Clone {
    let leases = Arc::new(AtomicU64::new(1));
    let admit = warp::post()
        .and(warp::path!("v1" / "admit").or(warp::path!("floor")).unify())
        .and(warp::body::content_length_limit(64 * 1024))
        .and(warp::body::json())
        .map(move |req: FloorAdmit| {
            let valid = [&req.tenant, &req.subject, &req.tool]
                .into_iter()
                .chain(req.upstream.as_ref())
                .all(|n| !n.is_empty() && n.len() <= 128)
                && req.cost.is_none_or(|c| c.is_finite() && c > 0.0);
            let n = leases.fetch_add(1, Ordering::Relaxed);
            let answer = FloorAnswer {
                admitted: valid,
                lease_id: format!("floor-{n:016x}"),
                waited_ms: 0,
                mode: "enforce",
                remaining: 19,
                limit: 20,
                reset_ms: 500,
            };
            warp::reply::json(&answer)
        });
    let release = warp::post()
        .and(warp::path!("v1" / "release"))
        .and(warp::body::content_length_limit(64 * 1024))
        .and(warp::body::json())
        .map(|req: FloorRelease| {
            let released = !req.lease_id.is_empty() && !req.outcome.is_empty();
            warp::reply::json(&serde_json::json!({ "released": released }))
        });
    // A stand-in OTLP/HTTP collector, so span export can be measured against one that answers: it
    // takes any body and answers an empty ExportTraceServiceResponse (an empty protobuf message).
    let received = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let r = received.clone();
    let traces = warp::post()
        .and(warp::path!("v1" / "traces"))
        .and(warp::body::content_length_limit(64 << 20))
        .and(warp::body::bytes())
        .map(move |body: bytes::Bytes| {
            r.0.fetch_add(1, Ordering::Relaxed);
            r.1.fetch_add(body.len() as u64, Ordering::Relaxed);
            warp::reply::with_header(Vec::<u8>::new(), "content-type", "application/x-protobuf")
        });
    let traces_received = warp::get()
        .and(warp::path!("v1" / "traces" / "received"))
        .map(move || {
            warp::reply::json(&serde_json::json!({
                "requests": received.0.load(Ordering::Relaxed),
                "bytes": received.1.load(Ordering::Relaxed),
            }))
        });
    admit.or(release).or(traces).or(traces_received)
}

fn floor_runtime(threads: usize) -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("floor")
        .enable_all()
        .build()
}

/// Serves the floor's routes on `listener` with the HTTP settings admitd serves with (see
/// `serve_http` in src/server.rs): warp's service on hyper's HTTP/1 + h2c connections, responses
/// written from one buffer (`writev(false)`). Connections are tasks of the multi-threaded runtime.
async fn serve_floor(listener: tokio::net::TcpListener) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto;
    use hyper_util::service::TowerToHyperService;

    let service = warp::service(floor_routes());
    loop {
        let Ok((io, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder.http1().writev(false);
            let _ = builder
                .serve_connection_with_upgrades(TokioIo::new(io), service)
                .await;
        });
    }
}

/// Serves the floor on 127.0.0.1:`port` until killed or `lifetime` passes.
fn floor_only(port: u16, threads: usize, lifetime: f64) -> Result<(), String> {
    let rt = floor_runtime(threads).map_err(|e| format!("cannot start a runtime: {e}"))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))
            .await
            .map_err(|e| format!("cannot listen on 127.0.0.1:{port}: {e}"))?;
        println!(
            "floor listening on http://127.0.0.1:{port} (worker threads: {threads}, pid {})",
            std::process::id()
        );
        let server = serve_floor(listener);
        let _ = tokio::time::timeout(Duration::from_secs_f64(lifetime), server).await;
        Ok(())
    })
}

/// Starts the floor on its own thread and runtime, on an ephemeral port; returns that port.
fn floor_in_process(threads: usize, lifetime: f64) -> Result<u16, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("floor".into())
        .spawn(move || {
            let rt = match floor_runtime(threads) {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(format!("cannot start the floor runtime: {e}")));
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::bind(SocketAddr::from((
                    [127, 0, 0, 1],
                    0,
                )))
                .await
                {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = tx.send(Err(format!("cannot listen for the floor: {e}")));
                        return;
                    }
                };
                let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
                let _ = tx.send(Ok(port));
                let server = serve_floor(listener);
                let _ = tokio::time::timeout(Duration::from_secs_f64(lifetime), server).await;
            })
        })
        .map_err(|e| format!("cannot start the floor thread: {e}"))?;
    rx.recv().map_err(|_| "the floor thread died".to_string())?
}

// ---- main -------------------------------------------------------------------------------------------

fn main() {
    let args = match parse_args(std::env::args().skip(1).collect()) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("loadgen: {e}\n(run with --help for usage)");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args) {
        eprintln!("loadgen: {e}");
        std::process::exit(1);
    }
}

fn run(mut a: Args) -> Result<(), String> {
    if let Some(port) = a.floor_only {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        return floor_only(port, a.floor_threads.unwrap_or(cpus), a.lifetime);
    }
    if a.floor {
        let port = floor_in_process(
            a.floor_threads.unwrap_or(1),
            a.warmup.unwrap_or(2.0) + a.duration + 60.0,
        )?;
        a.url = format!("http://127.0.0.1:{port}");
    }
    let (addr, host) = parse_target(&a.url)?;
    let warmup = match (a.warmup, a.mode) {
        (Some(w), _) => w,
        (None, Mode::Populate) => 0.0,
        (None, _) => 2.0,
    };
    let source = match a.mode {
        Mode::Populate => Source::Sequence {
            next: AtomicU64::new(a.offset),
            end: a.offset.saturating_add(a.count),
            tenants: a.tenants,
        },
        Mode::FloorPath => Source::Pool(request_pool(&a, "/floor", &host)),
        Mode::Admit | Mode::AdmitRelease => Source::Pool(request_pool(&a, "/v1/admit", &host)),
    };

    let rt = if a.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(a.threads)
            .enable_all()
            .build()
    }
    .map_err(|e| format!("cannot start a runtime: {e}"))?;

    let server_pid = a.server_pid.map(|p| p.to_string());
    if let Some(pid) = &server_pid {
        if cpu_ticks(pid).is_none() {
            return Err(format!("--server-pid {pid}: cannot read /proc/{pid}/stat"));
        }
    }

    let t0 = Instant::now() + Duration::from_millis(200);
    let measure_from = t0 + Duration::from_secs_f64(warmup);
    let deadline = measure_from + Duration::from_secs_f64(a.duration);
    let give_up = deadline + GIVE_UP_AFTER;
    let run = Arc::new(Run {
        addr,
        host,
        mode: a.mode,
        source,
        connections: a.connections,
        t0,
        measure_from,
        deadline,
        give_up,
        period_ns: a.rate.map(|r| 1e9 / r),
        spin: Duration::from_micros(a.spin_us),
        timeout: Duration::from_millis(a.timeout_ms),
    });

    let (stats, measured, server_ticks, client_ticks, steal_ticks) = rt.block_on(async {
        let tasks: Vec<_> = (0..a.connections)
            .map(|i| tokio::spawn(connection(run.clone(), i)))
            .collect();
        tokio::time::sleep_until(measure_from.into()).await;
        let began = Instant::now();
        let server_before = server_pid.as_deref().and_then(cpu_ticks);
        let client_before = cpu_ticks("self");
        let steal_before = steal_ticks();
        let mut total = Stats::new();
        for t in tasks {
            if let Ok(s) = t.await {
                total.merge(&s);
            }
        }
        let measured = began.elapsed();
        let server = server_pid
            .as_deref()
            .and_then(cpu_ticks)
            .zip(server_before)
            .map(|(b, a)| b.saturating_sub(a));
        let client = cpu_ticks("self")
            .zip(client_before)
            .map(|(b, a)| b.saturating_sub(a));
        let steal = steal_ticks()
            .zip(steal_before)
            .map(|(b, a)| b.saturating_sub(a));
        (total, measured, server, client, steal)
    });

    // Rates are over the time from the start of measurement to the last answer: a closed loop stops
    // sending at the deadline, an open loop against a server that fell behind keeps sending the
    // requests already due (for up to GIVE_UP_AFTER), and populate stops when it runs out of subjects.
    let secs = measured.as_secs_f64().max(1e-9);
    let cpu_secs = |ticks: u64| ticks as f64 / a.clk_tck;
    let report = Report {
        label: a.label.clone(),
        target: a.url.clone(),
        mode: a.mode.as_str(),
        loop_: if a.rate.is_some() { "open" } else { "closed" },
        connections: a.connections,
        rate: a.rate,
        duration_s: (secs * 1000.0).round() / 1000.0,
        requests: stats.requests,
        rps: (stats.requests as f64 / secs).round(),
        ok_2xx: stats.ok,
        shed_429: stats.shed,
        other_status: stats.other,
        errors: stats.errors,
        unsent: stats.unsent,
        latency: Latency::of(&stats.first),
        release_latency: (stats.release.total > 0).then(|| Latency::of(&stats.release)),
        send_lag: (stats.lag.total > 0).then(|| Latency::of(&stats.lag)),
        server_cpu_us_per_req: server_ticks
            .filter(|_| stats.requests > 0)
            .map(|t| (cpu_secs(t) * 1e6 / stats.requests as f64 * 100.0).round() / 100.0),
        server_cpu_pct: server_ticks
            .map(|t| (cpu_secs(t) / measured.as_secs_f64() * 100.0).round()),
        // With an in-process floor, this process's CPU time is the floor's too: not the client's.
        client_cpu_pct: client_ticks
            .filter(|_| !a.floor)
            .map(|t| (cpu_secs(t) / measured.as_secs_f64() * 100.0).round()),
        steal_ms: steal_ticks.map(|t| (cpu_secs(t) * 1000.0).round()),
    };
    if a.json {
        print_text_to(&report, true);
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        print_text_to(&report, false);
    }
    Ok(())
}
