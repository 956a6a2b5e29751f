//! Black-box tests of who may call: the Unix socket listener, caller/admin/metrics tokens, the
//! start-up warnings, keyed identity hashes in the log, and refusal texts that name nothing internal.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bin, eventually, sha256_hex, Daemon};
use serde_json::{json, Value};

/// A daemon started with exactly these arguments (after `serve`), and its log.
struct Raw {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    listening: String,
    _config: Option<tempfile::NamedTempFile>,
}

impl Raw {
    fn start(config: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Raw {
        let file = config.map(|text| {
            let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
            f.write_all(text.as_bytes()).unwrap();
            f
        });
        let mut cmd = Command::new(bin());
        cmd.arg("serve").args(args);
        if let Some(f) = &file {
            cmd.arg("--config").arg(f.path());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .env("ADMITD_LOG", "info,admitd::admission=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
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
        let listening = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("admitd did not start: {:?}", log.lock().unwrap());
            }
        };
        Raw {
            child,
            log,
            listening,
            _config: file,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn terminate(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request over a Unix socket: (status, body).
fn unix_request(
    path: &std::path::Path,
    method: &str,
    route: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut s = UnixStream::connect(path).expect("connect to the socket");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {route} HTTP/1.1\r\nhost: admitd\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {out:?}"));
    let text = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (
        status,
        serde_json::from_str(text).unwrap_or(Value::String(text.into())),
    )
}

#[test]
fn the_daemon_serves_on_a_unix_socket_with_its_mode_and_removes_it_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("admitd.sock");
    let listen = format!("unix:{}", sock.display());
    let mut d = Raw::start(
        Some("[server]\nsocket_mode = \"0600\"\n"),
        &["--listen", &listen],
        &[],
    );
    assert_eq!(d.listening, listen);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(unix_request(&sock, "GET", "/healthz", None).0, 200);
    let call = json!({"tenant": "acme", "subject": "bot", "tool": "search"});
    let (status, body) = unix_request(&sock, "POST", "/v1/admit", Some(&call));
    assert_eq!(status, 200, "{body:?}");
    let lease = body["lease_id"].as_str().unwrap().to_string();
    let (status, _) = unix_request(
        &sock,
        "POST",
        "/v1/release",
        Some(&json!({"lease_id": lease, "outcome": "ok"})),
    );
    assert_eq!(status, 200);
    // On a Unix socket only, the socket's permissions guard the admin routes: no token needed.
    let (status, body) = unix_request(&sock, "POST", "/v1/admin/reload", Some(&json!({})));
    assert_eq!(status, 200, "{body:?}");
    // Nothing listens on TCP: the daemon warned about no exposure.
    assert!(!d.log().contains("other machines can reach"), "{}", d.log());
    d.terminate();
    assert!(!sock.exists(), "the socket file is removed at shutdown");
}

#[test]
fn on_a_unix_socket_without_a_config_file_there_is_nothing_to_reload() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let _d = Raw::start(
        None,
        &["--listen", &format!("unix:{}", sock.display())],
        &[],
    );
    let (status, body) = unix_request(&sock, "POST", "/v1/admin/reload", Some(&json!({})));
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("no_config_file"))
    );
}

#[test]
fn a_second_daemon_on_a_live_socket_is_refused_and_a_stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let listen = format!("unix:{}", sock.display());
    let mut first = Raw::start(None, &["--listen", &listen], &[]);
    let out = Command::new(bin())
        .args(["serve", "--listen", &listen])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another process is listening on it"), "{err}");
    // A daemon killed without a chance to clean up leaves its socket file behind.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert!(sock.exists());
    let _second = Raw::start(None, &["--listen", &listen], &[]);
    assert_eq!(unix_request(&sock, "GET", "/readyz", None).0, 200);
}

const CALLER: &str = "caller-secret-one";
const ADMIN: &str = "admin-secret-two";
const SCRAPER: &str = "scraper-secret-three";

fn tokens_config() -> String {
    format!(
        "[server]\napi_tokens_sha256 = [\"{}\", \"{}\"]\nadmin_token_sha256 = \"{}\"\n",
        sha256_hex("another-caller"),
        sha256_hex(CALLER),
        sha256_hex(ADMIN)
    )
}

fn get_with(
    d: &Daemon,
    path: &str,
    token: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut r = d.client.get(d.url(path));
    if let Some(t) = token {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().unwrap())
}

#[test]
fn caller_routes_need_a_caller_token_and_admin_routes_the_admin_token() {
    let d = Daemon::start(&tokens_config());
    let call = json!({"tenant": "acme", "subject": "bot", "tool": "search"});
    for path in ["/v1/admit", "/v1/release", "/v1/feedback"] {
        let a = d.post(path, call.clone());
        assert_eq!(
            (a.status, a.body["error"].as_str()),
            (401, Some("unauthorized")),
            "{path}"
        );
        assert_eq!(a.header("www-authenticate").as_deref(), Some("Bearer"));
    }
    let wrong = d.post_with_token("/v1/admit", "caller-secret-on", call.clone());
    assert_eq!(wrong.status, 401);
    let text = wrong.body.to_string();
    assert!(!text.contains("caller-secret"), "{text}");
    // The admin token is not a caller token.
    assert_eq!(
        d.post_with_token("/v1/admit", ADMIN, call.clone()).status,
        401
    );
    let ok = d.post_with_token("/v1/admit", CALLER, call.clone());
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    let lease = ok.body["lease_id"].as_str().unwrap();
    assert_eq!(
        d.post_with_token(
            "/v1/release",
            CALLER,
            json!({"lease_id": lease, "outcome": "ok"})
        )
        .status,
        200
    );
    assert_eq!(get_with(&d, "/v1/tenants/acme", None).0, 401);
    assert_eq!(get_with(&d, "/v1/tenants/acme", Some(CALLER)).0, 200);
    // Probes and metrics stay open.
    for path in ["/healthz", "/readyz", "/metrics", "/v1/alerts"] {
        assert_eq!(get_with(&d, path, None).0, 200, "{path}");
    }
    // Admin: the admin token only.
    assert_eq!(d.post("/v1/admin/reload", json!({})).status, 401);
    assert_eq!(
        d.post_with_token("/v1/admin/reload", CALLER, json!({}))
            .status,
        401
    );
    let r = d.post_with_token("/v1/admin/reload", ADMIN, json!({}));
    assert_eq!(r.status, 200, "{:?}", r.body);
    // A wrong method is told only to a caller who may use the route.
    assert_eq!(get_with(&d, "/v1/admit", None).0, 401);
    assert_eq!(get_with(&d, "/v1/admit", Some(CALLER)).0, 405);
}

#[test]
fn admin_routes_are_closed_over_tcp_without_an_admin_token_and_metrics_can_need_one() {
    let d = Daemon::start(&format!(
        "[server]\nmetrics_token_sha256 = \"{}\"\n",
        sha256_hex(SCRAPER)
    ));
    let r = d.post_with_token("/v1/admin/reload", "anything", json!({}));
    assert_eq!(
        (r.status, r.body["error"].as_str()),
        (403, Some("forbidden"))
    );
    let (status, _, _) = get_with(&d, "/metrics", None);
    assert_eq!(status, 401);
    let (status, headers, text) = get_with(&d, "/metrics", Some(SCRAPER));
    assert_eq!(status, 200);
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    assert!(text.contains("admitd_"), "{text}");
    assert_eq!(get_with(&d, "/v1/alerts", None).0, 401);
    // No caller tokens configured: the caller routes are open.
    let a = d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "search"}));
    assert_eq!(a.status, 200);
    assert_eq!(get_with(&d, "/healthz", None).0, 200);
}

#[test]
fn listening_beyond_loopback_without_a_caller_token_is_warned_about_at_start() {
    let exposed = Raw::start(None, &["--listen", "0.0.0.0:0"], &[]);
    assert!(
        eventually(Duration::from_secs(5), || exposed
            .log()
            .contains("no caller token is configured")),
        "{}",
        exposed.log()
    );
    let guarded = Raw::start(Some(&tokens_config()), &["--listen", "0.0.0.0:0"], &[]);
    let local = Raw::start(None, &["--listen", "127.0.0.1:0"], &[]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !guarded.log().contains("no caller token"),
        "{}",
        guarded.log()
    );
    assert!(!local.log().contains("no caller token"), "{}", local.log());
}

#[test]
fn listen_on_the_command_line_wins_over_the_file_and_says_so() {
    let d = Raw::start(
        Some("[server]\nlisten = \"127.0.0.1:1\"\n"),
        &["--listen", "127.0.0.1:0"],
        &[],
    );
    assert!(d.listening.starts_with("127.0.0.1:"), "{}", d.listening);
    assert_ne!(d.listening, "127.0.0.1:1");
    assert!(
        eventually(Duration::from_secs(5), || d
            .log()
            .contains("--listen overrides server.listen of the config file")),
        "{}",
        d.log()
    );
    // A file without its own listen: nothing is overridden, nothing is said.
    let quiet = Raw::start(
        Some("[server]\nmode = \"enforce\"\n"),
        &["--listen", "127.0.0.1:0"],
        &[],
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(!quiet.log().contains("overrides"), "{}", quiet.log());
}

/// HMAC-SHA-256(key, s), its first 8 bytes as hex: what a keyed identity hash must be.
fn keyed(key: &[u8], s: &str) -> String {
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    m.update(s.as_bytes());
    m.finalize().into_bytes()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn with_hash_identities_the_log_shows_only_keyed_hashes_of_subjects() {
    let key = "a-key-of-at-least-sixteen-bytes";
    let subject = "alice@example.com";
    let config = "[telemetry]\nhash_identities = true\nhash_key_env = \"ADMITD_TEST_IDENTITY_KEY\"\n[limits.subject]\nburst = 1\nrate = \"1/h\"\n";
    let d = Raw::start(
        Some(config),
        &["--listen", "127.0.0.1:0"],
        &[("ADMITD_TEST_IDENTITY_KEY", key)],
    );
    let client = reqwest::blocking::Client::new();
    let url = format!("http://{}/v1/admit", d.listening);
    let call = json!({"tenant": "acme", "subject": subject, "tool": "search", "max_wait_ms": 0});
    let statuses: Vec<u16> = (0..2)
        .map(|_| {
            client
                .post(&url)
                .json(&call)
                .send()
                .unwrap()
                .status()
                .as_u16()
        })
        .collect();
    assert_eq!(statuses, [200, 429]);
    let expected = keyed(key.as_bytes(), subject);
    assert!(
        eventually(Duration::from_secs(5), || {
            let log = d.log();
            log.contains("call refused") && log.contains("call admitted")
        }),
        "{}",
        d.log()
    );
    let log = d.log();
    for line in log
        .lines()
        .filter(|l| l.contains("call refused") || l.contains("call admitted"))
    {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["fields"]["subject_hash"], expected.as_str(), "{line}");
    }
    assert!(!log.contains(subject), "{log}");
    assert!(!log.contains("alice"), "{log}");
    assert!(!log.contains(key), "{log}");
}

#[test]
fn refusal_texts_name_no_host_address_credential_or_policy() {
    let d = Daemon::start(&format!(
        r#"
[server]
api_tokens_sha256 = ["{}"]
[limits.subject]
rate = "1/h"
burst = 3
concurrency = 1
daily_quota = 100
[plans.gold-internal-tier.subject]
rate = "1/h"
burst = 3
concurrency = 1
[tenants.acme-corp]
plan = "gold-internal-tier"
[tools.query_db]
upstream = "pg-prod-01.db.internal"
[tools.big_report]
cost = 50
[upstreams."pg-prod-01.db.internal"]
rate = "1/h"
burst = 1
"#,
        sha256_hex(CALLER)
    ));
    let call = |tool: &str| {
        d.post_with_token(
            "/v1/admit",
            CALLER,
            json!({"tenant": "acme-corp", "subject": "svc-account-42", "tool": tool, "max_wait_ms": 0}),
        )
    };
    let release = |a: &common::Answer| {
        let lease = a.body["lease_id"].as_str().unwrap().to_string();
        let r = d.post_with_token(
            "/v1/release",
            CALLER,
            json!({"lease_id": lease, "outcome": "ok"}),
        );
        assert_eq!(r.status, 200);
    };
    let mut refusals = Vec::new();
    // Concurrency (one call in flight at a time).
    let held = call("search");
    assert_eq!(held.status, 200, "{:?}", held.body);
    refusals.push(call("search"));
    release(&held);
    // The upstream's budget (one call an hour).
    let first = call("query_db");
    assert_eq!(first.status, 200, "{:?}", first.body);
    release(&first);
    refusals.push(call("query_db"));
    // Larger than any bucket it passes.
    refusals.push(call("big_report"));
    // The upstream's penalty box.
    let fb = d.post_with_token(
        "/v1/feedback",
        CALLER,
        json!({"tenant": "acme-corp", "upstream": "pg-prod-01.db.internal", "status": 429, "retry_after": "60"}),
    );
    assert_eq!(fb.status, 202);
    refusals.push(call("query_db"));
    // The subject's bucket.
    loop {
        let a = call("search");
        if a.status != 200 {
            refusals.push(a);
            break;
        }
        release(&a);
    }
    let scopes: std::collections::BTreeSet<String> = refusals
        .iter()
        .map(|r| r.body["scope"].as_str().unwrap_or("").to_string())
        .collect();
    let want: std::collections::BTreeSet<String> = [
        "concurrency",
        "tenant_upstream",
        "oversized",
        "upstream_penalty",
        "subject",
    ]
    .map(String::from)
    .into();
    assert_eq!(scopes, want);
    let port = d.addr.rsplit(':').next().unwrap().to_string();
    for r in &refusals {
        assert_eq!(r.status, 429, "{:?}", r.body);
        let text = r.body.to_string();
        for secret in [
            "gold-internal-tier",
            "pg-prod-01",
            "db.internal",
            "127.0.0.1",
            CALLER,
            "svc-account-42",
            "acme-corp",
        ] {
            assert!(!text.contains(secret), "{secret:?} in {text}");
        }
        let words = format!(
            "{} {}",
            r.body["reason"], r.body["tool_result"]["content"][0]["text"]
        );
        assert!(!words.contains(&port), "{words}");
    }
}
