//! Black-box harness: runs the real `admitd` binary on a free port and talks to it over HTTP, the way a
//! stranger's client would.
#![allow(dead_code)]

pub mod fake_upstream;
pub mod redis;
pub mod script;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use serde_json::Value;

pub struct Daemon {
    pub child: Child,
    pub addr: String,
    pub client: Client,
    pub log: Arc<Mutex<Vec<String>>>,
    pub config: Option<tempfile::NamedTempFile>,
}

pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
}

/// A config file holding `text`, removed when dropped.
fn config_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp config");
    f.write_all(text.as_bytes()).expect("write config");
    f
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_admitd")
}

impl Daemon {
    /// Starts the daemon on built-in defaults.
    pub fn start_default() -> Daemon {
        Self::spawn(None)
    }

    /// Starts the daemon with this config text.
    pub fn start(config: &str) -> Daemon {
        Self::spawn_with(Some(config_file(config)), None, "info")
    }

    /// Starts the daemon with this config text and log filter (`ADMITD_LOG`).
    pub fn start_logging(config: &str, filter: &str) -> Daemon {
        Self::spawn_with(Some(config_file(config)), None, filter)
    }

    /// Starts the daemon with this config text and at most `max_fds` open file descriptors
    /// (`ulimit -n`).
    pub fn start_with_fd_limit(config: &str, max_fds: u32) -> Daemon {
        Self::spawn_with(Some(config_file(config)), Some(max_fds), "info")
    }

    /// Starts the daemon with this config text and these environment variables.
    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> Daemon {
        Self::spawn_env(Some(config_file(config)), None, "info", env)
    }

    fn spawn(config: Option<tempfile::NamedTempFile>) -> Daemon {
        Self::spawn_with(config, None, "info")
    }

    fn spawn_with(
        config: Option<tempfile::NamedTempFile>,
        max_fds: Option<u32>,
        log_filter: &str,
    ) -> Daemon {
        Self::spawn_env(config, max_fds, log_filter, &[])
    }

    fn spawn_env(
        config: Option<tempfile::NamedTempFile>,
        max_fds: Option<u32>,
        log_filter: &str,
        env: &[(&str, &str)],
    ) -> Daemon {
        let mut cmd = match max_fds {
            // The shell lowers the limit and then becomes admitd (`exec`), so the child is admitd.
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(bin());
                c
            }
            None => Command::new(bin()),
        };
        cmd.arg("serve").arg("--listen").arg("127.0.0.1:0");
        if let Some(f) = &config {
            cmd.arg("--config").arg(f.path());
        }
        cmd.stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env("ADMITD_LOG", log_filter)
            .envs(env.iter().copied());
        let mut child = cmd.spawn().expect("spawn admitd");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("admitd listening on ") {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(rest.trim().to_string());
                    }
                }
                log2.lock().unwrap().push(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("admitd did not start; log: {:?}", log.lock().unwrap());
            }
        };
        let client = Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client");
        Daemon {
            child,
            addr,
            client,
            log,
            config,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn post(&self, path: &str, body: Value) -> Answer {
        self.post_raw(path, "application/json", body.to_string().into_bytes())
    }

    pub fn post_raw(&self, path: &str, content_type: &str, body: Vec<u8>) -> Answer {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", content_type)
            .body(body)
            .send()
            .expect("request");
        Self::answer(r)
    }

    /// POSTs with `Authorization: Bearer TOKEN`.
    pub fn post_with_token(&self, path: &str, token: &str, body: Value) -> Answer {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {token}"))
            .body(body.to_string())
            .send()
            .expect("request");
        Self::answer(r)
    }

    /// POSTs to an admin route with [`ADMIN_TOKEN`].
    pub fn post_admin(&self, path: &str, body: Value) -> Answer {
        self.post_with_token(path, ADMIN_TOKEN, body)
    }

    pub fn get(&self, path: &str) -> Answer {
        Self::answer(self.client.get(self.url(path)).send().expect("request"))
    }

    fn answer(r: reqwest::blocking::Response) -> Answer {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Answer {
            status,
            headers,
            body,
        }
    }

    pub fn admit(&self, body: Value) -> Answer {
        self.post("/v1/admit", body)
    }

    pub fn release(&self, lease: &str) -> Answer {
        self.post(
            "/v1/release",
            serde_json::json!({"lease_id": lease, "outcome": "ok"}),
        )
    }

    /// Rewrites the config file in place (for reload tests).
    pub fn rewrite_config(&self, text: &str) {
        let path = self.config.as_ref().expect("started with a config").path();
        std::fs::write(path, text).expect("rewrite config");
    }

    pub fn config_path(&self) -> String {
        self.config
            .as_ref()
            .expect("config")
            .path()
            .display()
            .to_string()
    }

    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Waits (at most `limit`) for a log line containing `needle`.
    pub fn logged(&self, needle: &str, limit: Duration) -> bool {
        eventually(limit, || {
            self.log_lines().iter().any(|l| l.contains(needle))
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends the daemon a signal by name (`"HUP"`, `"TERM"`).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -{name} failed");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The admin token of [`with_admin`] configs.
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// `text` with `[server] admin_token_sha256` set to the digest of [`ADMIN_TOKEN`], so that the
/// admin routes answer over TCP.
pub fn with_admin(text: &str) -> String {
    let line = format!("admin_token_sha256 = \"{}\"\n", sha256_hex(ADMIN_TOKEN));
    match text.find("[server]\n") {
        Some(at) => {
            let end = at + "[server]\n".len();
            format!("{}{line}{}", &text[..end], &text[end..])
        }
        None => format!("[server]\n{line}{text}"),
    }
}

/// SHA-256 of `s` as 64 hex digits.
pub fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Waits until `f` is true, polling, for at most `limit`.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

/// A tiny HTTP/1.1 server that records every request (path and body) and answers 200: stands in for an
/// OTLP collector or an Alertmanager.
/// Requests a [`Recorder`] received: (path, body).
pub type Recorded = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

pub struct Recorder {
    pub addr: String,
    pub requests: Recorded,
}

impl Recorder {
    pub fn start() -> Recorder {
        Self::start_at("127.0.0.1:0")
    }

    /// A recorder on a given address (for a collector that starts late).
    pub fn start_at(addr: &str) -> Recorder {
        let listener = std::net::TcpListener::bind(addr).expect("bind recorder");
        let addr = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let reqs = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let reqs = reqs.clone();
                std::thread::spawn(move || serve_one(stream, reqs));
            }
        });
        Recorder { addr, requests }
    }

    pub fn bodies(&self, path: &str) -> Vec<Vec<u8>> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

fn serve_one(stream: std::net::TcpStream, reqs: Recorded) {
    use std::io::Read;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut len = 0usize;
        let mut close = false;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
            if lower.starts_with("connection:") && lower.contains("close") {
                close = true;
            }
        }
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        reqs.lock().unwrap().push((path, body));
        let out = reader.get_mut();
        let _ = out.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        );
        let _ = out.flush();
        if close {
            return;
        }
    }
}

/// A minimal OTLP/gRPC collector: an HTTP/2 server that records each request (path and message,
/// without gRPC's five-byte frame header) and answers an empty `ExportTraceServiceResponse` with
/// `grpc-status: 0`.
pub struct GrpcRecorder {
    pub addr: String,
    pub requests: Recorded,
}

impl GrpcRecorder {
    pub fn start() -> GrpcRecorder {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind gRPC recorder");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests: Recorded = Arc::new(Mutex::new(Vec::new()));
        let reqs = requests.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                while let Ok((stream, _)) = listener.accept().await {
                    let reqs = reqs.clone();
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let reqs = reqs.clone();
                            async move {
                                use http_body_util::BodyExt;
                                let path = req.uri().path().to_string();
                                let body = req
                                    .into_body()
                                    .collect()
                                    .await
                                    .map(|b| b.to_bytes())
                                    .unwrap_or_default();
                                if body.len() >= 5 {
                                    reqs.lock().unwrap().push((path, body[5..].to_vec()));
                                }
                                let mut trailers = hyper::HeaderMap::new();
                                trailers.insert(
                                    "grpc-status",
                                    hyper::header::HeaderValue::from_static("0"),
                                );
                                let frames = futures_util::stream::iter([
                                    Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(
                                        bytes::Bytes::from_static(&[0, 0, 0, 0, 0]),
                                    )),
                                    Ok(hyper::body::Frame::trailers(trailers)),
                                ]);
                                hyper::Response::builder()
                                    .header("content-type", "application/grpc")
                                    .body(http_body_util::StreamBody::new(frames))
                            }
                        },
                    );
                    tokio::spawn(async move {
                        let _ = hyper::server::conn::http2::Builder::new(
                            hyper_util::rt::TokioExecutor::new(),
                        )
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                    });
                }
            });
        });
        GrpcRecorder { addr, requests }
    }
}

/// The value of a sample in Prometheus text, by exact series (name and labels as rendered).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}
