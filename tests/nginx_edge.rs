//! Black-box: a real nginx with `deploy/nginx/admitd-edge.conf` (its `auth_request` asking admitd's
//! edge check, its `error_page` handing refusals to `POST /v1/edge/refusal`) in front of a small
//! upstream, driven as an MCP client would drive it. The clients' tests (clients/python/tests,
//! clients/js/test) put real SDK clients and servers on both sides of the same file.
//!
//! It needs the `nginx` binary (Debian package `nginx-light`; `scripts/test.sh` installs it). nginx
//! runs on a free loopback port with its prefix, pid file, logs and temp paths in a temp dir, never
//! the system's.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Daemon;
use sha2::{Digest, Sha256};

const KEY: &str = "acme-nginx-key-51d2";
const VERSION: &str = "2026-07-28";

/// The heads of the requests the upstream received.
type Seen = Arc<Mutex<Vec<String>>>;

/// An MCP server stand-in: answers every request 200 and records its head.
fn upstream() -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen: Seen = Arc::default();
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let seen = seen2.clone();
            std::thread::spawn(move || serve(stream, seen));
        }
    });
    (addr, seen)
}

fn serve(stream: TcpStream, seen: Seen) {
    let mut reader = BufReader::new(stream);
    loop {
        let mut head = String::new();
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
            head.push_str(&line);
        }
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        seen.lock().unwrap().push(head);
        let answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}";
        if reader.get_mut().write_all(answer).is_err() {
            return;
        }
    }
}

/// nginx, stopped when dropped.
struct Nginx {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Nginx {
    fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn nginx_binary() -> &'static str {
    if Command::new("nginx").arg("-v").output().is_ok() {
        "nginx"
    } else {
        "/usr/sbin/nginx"
    }
}

/// Runs the shipped config with the test's addresses in place of the example ones.
fn start_nginx(admitd: &str, upstream: &str) -> Nginx {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/nginx/admitd-edge.conf"
    ))
    .unwrap();
    let port = free_port();
    let mut conf = shipped.clone();
    for (example, here) in [
        ("server 127.0.0.1:9470;", format!("server {admitd};")),
        ("server 127.0.0.1:8000;", format!("server {upstream};")),
        ("listen 8080;", format!("listen 127.0.0.1:{port};")),
    ] {
        assert_eq!(
            conf.matches(example).count(),
            1,
            "{example} in the shipped config"
        );
        conf = conf.replace(example, &here);
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().display().to_string();
    std::fs::write(dir.path().join("admitd-edge.conf"), conf).unwrap();
    let main = format!(
        "worker_processes 1;\npid {p}/nginx.pid;\nerror_log {p}/error.log info;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n  access_log {p}/access.log;\n  client_body_temp_path {p}/body;\n\
         proxy_temp_path {p}/proxy;\n  fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n\
         scgi_temp_path {p}/scgi;\n  include {p}/admitd-edge.conf;\n}}\n"
    );
    std::fs::write(dir.path().join("nginx.conf"), main).unwrap();
    let child = Command::new(nginx_binary())
        .args([
            "-p",
            &p,
            "-c",
            &format!("{p}/nginx.conf"),
            "-e",
            &format!("{p}/error.log"),
        ])
        .args(["-g", "daemon off; master_process off;"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect(
            "the `nginx` binary is needed: apt-get install nginx-light (scripts/test.sh does this)",
        );
    let nginx = Nginx { child, port, dir };
    let end = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < end,
            "nginx did not start: {}",
            nginx.error_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    nginx
}

struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn json(&self) -> serde_json::Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{}",
            self.body
        );
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

const CALL: &str =
    r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search","arguments":{}}}"#;

/// A `tools/call` of `search` through nginx, as a streamable-HTTP MCP client sends it.
fn tools_call(nginx: &Nginx, key: &str, version: &str) -> Reply {
    post(nginx, Some(key), version, "tools/call", CALL)
}

fn post(nginx: &Nginx, key: Option<&str>, version: &str, method: &str, body: &str) -> Reply {
    let mut req = reqwest::blocking::Client::new()
        .post(format!("http://127.0.0.1:{}/mcp", nginx.port))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-method", method)
        .header("mcp-name", "search")
        .header("mcp-protocol-version", version);
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let r = req
        .body(body.to_string())
        .timeout(Duration::from_secs(10))
        .send()
        .expect("request through nginx");
    Reply {
        status: r.status().as_u16(),
        headers: r.headers().clone(),
        body: r.text().unwrap_or_default(),
    }
}

#[test]
fn nginx_auth_request_admits_refuses_and_limits_failed_authentications() {
    let hash: String = Sha256::digest(KEY.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/min\"\nburst = 2\n\
         [edge]\nclient_address_header = \"x-real-ip\"\nbudget_methods = [\"tools/call\", \"prompts/get\"]\nfailed_auth_rate = \"1/min\"\nfailed_auth_burst = 3\n\
         [[edge.api_keys]]\nsha256 = \"{hash}\"\ntenant = \"acme\"\nsubject = \"acme-bot\"\n"
    ));
    let (up, seen) = upstream();
    let nginx = start_nginx(&d.addr, &up);

    // A valid key reaches the upstream, which learns the validated identity.
    for _ in 0..2 {
        let r = tools_call(&nginx, KEY, VERSION);
        assert_eq!(r.status, 200, "{}", nginx.error_log());
        assert!(r
            .header("ratelimit")
            .is_some_and(|v| v.starts_with("\"subject\";r=")));
        assert!(r.header("ratelimit-policy").is_some());
    }
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        let head = seen[0].to_ascii_lowercase();
        assert!(head.starts_with("post /mcp "), "{head}");
        assert!(head.contains("x-admitd-tenant: acme\r\n"), "{head}");
        assert!(head.contains("x-admitd-subject: acme-bot\r\n"), "{head}");
    }

    // Over the subject's burst: the client gets the JSON-RPC answer a server would give, a
    // CallToolResult with isError and the wait under the request's id, with admitd's headers;
    // the upstream sees nothing.
    let r = tools_call(&nginx, KEY, VERSION);
    assert_eq!(r.status, 200, "{} {}", r.body, nginx.error_log());
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert!(r
        .header("ratelimit")
        .is_some_and(|v| v.starts_with("\"subject\";r=0;t=")));
    assert!(r
        .header("ratelimit-policy")
        .is_some_and(|v| v.contains("\"subject\";q=2")));
    let v = r.json();
    assert_eq!(v["jsonrpc"], "2.0");
    assert_eq!(v["id"], 1);
    let result = &v["result"];
    assert_eq!(result["isError"], true, "{v}");
    // Written in the request's revision: 2026-07-28 results say they are complete.
    assert_eq!(result["resultType"], "complete", "{v}");
    assert_eq!(result["structuredContent"]["scope"], "subject");
    let ms = result["structuredContent"]["retry_after_ms"]
        .as_u64()
        .unwrap();
    assert_eq!(ms.div_ceil(1000), retry, "{v}");
    let text = result["content"][0]["text"].as_str().unwrap();
    assert!(text.contains(&format!("Wait {retry} second")), "{text}");
    // Whatever type its id: a string id comes back as the same string.
    let r = post(
        &nginx,
        Some(KEY),
        VERSION,
        "tools/call",
        &CALL.replace("\"id\":1", "\"id\":\"call-7\""),
    );
    assert_eq!(r.json()["id"], "call-7");
    // Another method over a limit: a JSON-RPC error with the wait (here with a budget of its own).
    let body = r#"{"jsonrpc":"2.0","id":9,"method":"prompts/get","params":{"name":"search"}}"#;
    let r = post(&nginx, Some(KEY), VERSION, "prompts/get", body);
    let v = r.json();
    assert_eq!((r.status, &v["id"]), (200, &serde_json::json!(9)), "{v}");
    assert_eq!(v["error"]["code"], -32010, "{v}");
    assert!(v["error"]["data"]["retry_after_ms"].as_u64().unwrap() > 0);
    // A body that is not JSON-RPC: a JSON-RPC error that says so.
    let r = post(&nginx, Some(KEY), VERSION, "tools/call", "{not json");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], -32700);
    assert_eq!(seen.lock().unwrap().len(), 2);

    // An old protocol revision is refused with 400, the specification's code, and the request's id.
    let r = tools_call(&nginx, KEY, "2025-06-18");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], -32022);
    assert_eq!(r.json()["id"], 1);

    // No credential: a JSON-RPC 401 that names the problem, not nginx's HTML page.
    let r = post(&nginx, None, VERSION, "tools/call", CALL);
    assert_eq!(r.status, 401);
    let v = r.json();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("no valid credential"));
    assert!(r.header("www-authenticate").is_some());

    // Bad keys: 401 until the address's failed-authentication limit, then a wait even for a good
    // key (one is spent above already).
    for _ in 0..2 {
        let r = tools_call(&nginx, "not-a-key", VERSION);
        assert_eq!(r.status, 401, "{}", nginx.error_log());
    }
    let r = tools_call(&nginx, "not-a-key", VERSION);
    assert_eq!(r.status, 200);
    assert!(r
        .header("retry-after")
        .is_some_and(|v| v.parse::<u64>().is_ok()));
    let v = tools_call(&nginx, KEY, VERSION).json();
    assert_eq!(v["result"]["isError"], true);
    assert_eq!(
        v["result"]["structuredContent"]["error"],
        "too_many_failed_authentications"
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}
