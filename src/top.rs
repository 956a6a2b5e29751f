//! `admitd top`: a terminal view of a running daemon, refreshed every second, in the spirit of
//! `htop` and `redis-cli --stat`: the tenants most shed first (from `GET /v1/tenants`), each with
//! the scope that sheds it, its calls in flight, its daily spend left (a column shown only when
//! some tenant has a daily spend budget) and its alerts, under a line with the store's state
//! (`GET /readyz`). `--once` prints one view and exits, for scripts and tests.
//!
//! It reaches the daemon over TCP or its Unix socket (`unix:/PATH`, as `admitd health` does) with
//! a small blocking HTTP/1.1 client of its own: the daemon's binary carries no HTTP client library,
//! and a view needs two GETs a second. A token (metrics or admin, or a tenant's own key) comes from
//! `--token-file` or `ADMITD_TOKEN`, never from the command line, where `ps` would show it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Deserialize;

/// Where the daemon is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `host:port`, as written (resolved at each connection).
    Tcp(String),
    Unix(PathBuf),
}

impl Target {
    /// `http://HOST:PORT` (a path after it is ignored), `HOST:PORT`, or `unix:/PATH`.
    pub fn parse(url: &str) -> Result<Target, String> {
        if let Some(path) = url.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err(format!(
                    "{url}: a Unix socket is named by its absolute path, unix:/PATH"
                ));
            }
            return Ok(Target::Unix(PathBuf::from(path)));
        }
        if url.starts_with("https://") {
            return Err(format!(
                "{url}: admitd serves plain HTTP; reach a daemon behind TLS through a tunnel or its Unix socket"
            ));
        }
        let rest = url.strip_prefix("http://").unwrap_or(url);
        let hostport = rest.split('/').next().unwrap_or("");
        if hostport.is_empty() || !hostport.contains(':') {
            return Err(format!("{url}: expected http://HOST:PORT or unix:/PATH"));
        }
        Ok(Target::Tcp(hostport.to_string()))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(h) => write!(f, "http://{h}"),
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// One GET: (status, body). Reads the whole answer (`connection: close`), within `timeout`.
pub fn get(
    target: &Target,
    path: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nhost: admitd\r\n{auth}connection: close\r\n\r\n");
    let deadline = Instant::now() + timeout;
    let raw = match target {
        Target::Tcp(hostport) => {
            let addr: SocketAddr = hostport
                .to_socket_addrs()
                .map_err(|e| format!("cannot resolve {hostport}: {e}"))?
                .next()
                .ok_or_else(|| format!("{hostport} resolves to no address"))?;
            let mut s = TcpStream::connect_timeout(&addr, timeout)
                .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
            s.set_read_timeout(Some(timeout))
                .map_err(|e| e.to_string())?;
            s.set_write_timeout(Some(timeout))
                .map_err(|e| e.to_string())?;
            exchange(&mut s, &request, deadline)?
        }
        #[cfg(unix)]
        Target::Unix(path) => {
            let mut s = std::os::unix::net::UnixStream::connect(path)
                .map_err(|e| format!("cannot connect to unix:{}: {e}", path.display()))?;
            s.set_read_timeout(Some(timeout))
                .map_err(|e| e.to_string())?;
            s.set_write_timeout(Some(timeout))
                .map_err(|e| e.to_string())?;
            exchange(&mut s, &request, deadline)?
        }
        #[cfg(not(unix))]
        Target::Unix(_) => return Err("Unix sockets need a Unix system".into()),
    };
    parse_answer(&raw).ok_or_else(|| "the answer is not HTTP".to_string())
}

/// The most of an answer read: a page of 1000 tenants is well under it.
const MAX_ANSWER: usize = 8 << 20;

fn exchange<S: Read + Write>(
    s: &mut S,
    request: &str,
    deadline: Instant,
) -> Result<Vec<u8>, String> {
    s.write_all(request.as_bytes())
        .map_err(|e| format!("cannot send the request: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        if Instant::now() > deadline {
            return Err("no complete answer in time".into());
        }
        match s.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) if got.len() + n <= MAX_ANSWER => got.extend_from_slice(&buf[..n]),
            Ok(_) => return Err("the answer is too large".into()),
            Err(e) => return Err(format!("cannot read the answer: {e}")),
        }
    }
}

/// An HTTP/1.1 answer read to its end: (status, body), the body un-chunked when it was sent so.
fn parse_answer(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let body = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let mut parts = status_line.split(' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let status: u16 = parts.next()?.parse().ok()?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if !chunked {
        return Some((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Some((status, out));
        }
        out.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

/// A tenant as `GET /v1/tenants` lists it (the fields the view shows).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Row {
    pub tenant: String,
    pub shed_ratio: f64,
    pub admitted: u64,
    pub shed: u64,
    pub top_scope: Option<String>,
    #[serde(default)]
    pub top_scope_shed: u64,
    pub inflight: u64,
    /// What each unit's daily budget has left (units by name); absent without such budgets.
    #[serde(default)]
    pub spend_left: Option<std::collections::BTreeMap<String, f64>>,
    #[serde(default)]
    pub alerts: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Page {
    pub tenants: Vec<Row>,
    #[serde(default)]
    pub total: usize,
    #[serde(default)]
    pub window_s: f64,
}

/// What one screen shows.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub target: String,
    /// The store as `/readyz` names it, and whether the daemon is ready.
    pub store: String,
    pub ready: bool,
    pub page: Page,
}

/// Reads one view from the daemon.
pub fn fetch(target: &Target, token: Option<&str>, limit: usize) -> Result<View, String> {
    let timeout = Duration::from_secs(2);
    let (status, body) = get(
        target,
        &format!("/v1/tenants?limit={limit}"),
        token,
        timeout,
    )?;
    let page: Page = match status {
        200 => serde_json::from_slice(&body).map_err(|e| format!("/v1/tenants: {e}"))?,
        401 => {
            return Err(format!(
                "{target}/v1/tenants needs a token: put the metrics or admin token in a file and pass --token-file FILE, or set ADMITD_TOKEN"
            ))
        }
        s => {
            let text = String::from_utf8_lossy(&body);
            return Err(format!("{target}/v1/tenants answered {s}: {}", text.trim()));
        }
    };
    let (ready_status, ready_body) = get(target, "/readyz", None, timeout)?;
    let ready: serde_json::Value = serde_json::from_slice(&ready_body).unwrap_or_default();
    Ok(View {
        target: target.to_string(),
        store: store_state(&ready["store"]),
        ready: ready_status == 200,
        page,
    })
}

/// The store as `/readyz` describes it: `memory`, or the shared store's kind and state
/// (`redis connected`, `redis unreachable`, with the mode it decides in when that is not `shared`).
pub fn store_state(v: &serde_json::Value) -> String {
    if let Some(s) = v.as_str() {
        return s.to_string();
    }
    let text = |k: &str| v[k].as_str().unwrap_or("unknown").to_string();
    let mut out = format!("{} {}", text("kind"), text("state"));
    if v["mode"].as_str().is_some_and(|m| m != "shared") {
        out.push_str(&format!(", deciding {}", text("mode")));
    }
    out
}

/// Cuts `s` to `width` characters, marking a cut with `…`.
fn fit(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// Width of the `SPEND LEFT` column: one unit and its figure (`usd 31.42`) fit; more units are cut.
const SPEND_WIDTH: usize = 18;

/// A row's spend left, `unit figure` by unit name, for the `SPEND LEFT` column.
fn spend_cell(r: &Row) -> String {
    let Some(left) = r.spend_left.as_ref().filter(|m| !m.is_empty()) else {
        return "-".into();
    };
    let short = |x: f64| {
        if x.abs() >= 1000.0 {
            format!("{x:.0}")
        } else {
            format!("{x:.2}")
        }
    };
    let text: Vec<String> = left
        .iter()
        .map(|(u, x)| format!("{u} {}", short(*x)))
        .collect();
    fit(&text.join(" "), SPEND_WIDTH)
}

/// The screen's text.
pub fn render(v: &View) -> String {
    let firing = v
        .page
        .tenants
        .iter()
        .filter(|r| !r.alerts.is_empty())
        .count();
    let mut out = format!(
        "admitd {}  store: {} ({})  tenants: {}  alerts firing: {}  window: {}s\n\n",
        v.target,
        v.store,
        if v.ready { "ready" } else { "NOT READY" },
        v.page.total,
        firing,
        v.page.window_s.round()
    );
    // The spend column only when a tenant shown has a daily spend budget: a daemon without spend
    // budgets keeps the screen it always had.
    let spend = v.page.tenants.iter().any(|r| r.spend_left.is_some());
    let spend_head = if spend {
        format!("{:<SPEND_WIDTH$}  ", "SPEND LEFT")
    } else {
        String::new()
    };
    out.push_str(&format!(
        "{:<24} {:>6} {:>9} {:>9}  {:<24} {:>8}  {spend_head}{}\n",
        "TENANT", "SHED%", "ADMITTED", "SHED", "TOP SHED SCOPE", "INFLIGHT", "ALERTS"
    ));
    for r in &v.page.tenants {
        let scope = match &r.top_scope {
            Some(s) => format!("{s} ({})", r.top_scope_shed),
            None => "-".into(),
        };
        let spend_cell = if spend {
            format!("{:<SPEND_WIDTH$}  ", spend_cell(r))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{:<24} {:>6.1} {:>9} {:>9}  {:<24} {:>8}  {spend_cell}{}\n",
            fit(&r.tenant, 24),
            r.shed_ratio * 100.0,
            r.admitted,
            r.shed,
            fit(&scope, 24),
            r.inflight,
            if r.alerts.is_empty() {
                "-".to_string()
            } else {
                r.alerts.join(",")
            }
        ));
    }
    if v.page.tenants.is_empty() {
        out.push_str("(no tenant made calls in the window)\n");
    } else if v.page.total > v.page.tenants.len() {
        out.push_str(&format!(
            "... and {} more\n",
            v.page.total - v.page.tenants.len()
        ));
    }
    out
}

/// `admitd top`: prints the view once (`once`), or every second until interrupted. A failed read
/// ends `--once` with an error; the refreshing view shows it and tries again.
pub fn run(url: &str, token_file: Option<PathBuf>, once: bool, limit: usize) -> Result<(), String> {
    let target = Target::parse(url)?;
    let token = match token_file {
        Some(path) => Some(
            std::fs::read_to_string(&path)
                .map_err(|e| format!("{}: cannot read the token: {e}", path.display()))?
                .trim()
                .to_string(),
        ),
        None => std::env::var("ADMITD_TOKEN")
            .ok()
            .filter(|t| !t.trim().is_empty()),
    };
    if once {
        print!("{}", render(&fetch(&target, token.as_deref(), limit)?));
        return Ok(());
    }
    let mut stdout = std::io::stdout();
    loop {
        let text = match fetch(&target, token.as_deref(), limit) {
            Ok(v) => render(&v),
            Err(e) => format!("admitd {target}: {e}\n"),
        };
        // Home, then clear the screen: one write, so the terminal never shows half a view.
        let _ = write!(stdout, "\x1b[H\x1b[2J{text}");
        let _ = stdout.flush();
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_urls_or_unix_sockets() {
        assert_eq!(
            Target::parse("http://127.0.0.1:9470").unwrap(),
            Target::Tcp("127.0.0.1:9470".into())
        );
        assert_eq!(
            Target::parse("http://localhost:1/").unwrap(),
            Target::Tcp("localhost:1".into())
        );
        assert_eq!(
            Target::parse("[::1]:9470").unwrap(),
            Target::Tcp("[::1]:9470".into())
        );
        assert_eq!(
            Target::parse("unix:/run/admitd/admitd.sock").unwrap(),
            Target::Unix("/run/admitd/admitd.sock".into())
        );
        for bad in ["unix:admitd.sock", "https://x:1", "http://", "localhost"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_store_is_named_from_readyz() {
        assert_eq!(store_state(&serde_json::json!("memory")), "memory");
        let up = serde_json::json!({"kind": "redis", "state": "connected", "mode": "shared"});
        assert_eq!(store_state(&up), "redis connected");
        let down =
            serde_json::json!({"kind": "redis", "state": "unreachable", "mode": "fail_open"});
        assert_eq!(store_state(&down), "redis unreachable, deciding fail_open");
    }

    #[test]
    fn answers_are_read_plain_or_chunked() {
        assert_eq!(
            parse_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"),
            Some((200, b"{}".to_vec()))
        );
        assert_eq!(
            parse_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n"),
            Some((200, b"abcde".to_vec()))
        );
        assert_eq!(
            parse_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            None
        );
        assert_eq!(parse_answer(b"SSH-2.0\r\n\r\n"), None);
    }

    #[test]
    fn the_view_lists_tenants_as_given_with_their_scope_and_alerts() {
        let row = |tenant: &str, ratio, shed, scope: Option<&str>, alerts: &[&str]| Row {
            tenant: tenant.into(),
            shed_ratio: ratio,
            admitted: 10,
            shed,
            top_scope: scope.map(str::to_string),
            top_scope_shed: shed,
            inflight: 2,
            spend_left: None,
            alerts: alerts.iter().map(|a| a.to_string()).collect(),
        };
        let v = View {
            target: "http://127.0.0.1:9470".into(),
            store: "redis".into(),
            ready: false,
            page: Page {
                tenants: vec![
                    row("looping", 0.9, 90, Some("subject"), &["shed_ratio_high"]),
                    row("a-tenant-with-a-very-long-name-indeed", 0.0, 0, None, &[]),
                ],
                total: 3,
                window_s: 300.0,
            },
        };
        let text = render(&v);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("store: redis (NOT READY)"), "{text}");
        assert!(
            lines[0].contains("tenants: 3") && lines[0].contains("alerts firing: 1"),
            "{text}"
        );
        assert!(lines[2].starts_with("TENANT"));
        assert!(
            lines[3].starts_with("looping ") && lines[3].contains("90.0"),
            "{text}"
        );
        assert!(
            lines[3].contains("subject (90)") && lines[3].ends_with("shed_ratio_high"),
            "{text}"
        );
        assert!(lines[4].starts_with("a-tenant-with-a-very-lo…"), "{text}");
        assert_eq!(lines[5], "... and 1 more");
        assert!(
            !text.contains("SPEND"),
            "no spend budgets, no spend column: {text}"
        );
    }

    #[test]
    fn spend_left_is_one_short_column_when_a_tenant_has_a_daily_budget() {
        let row = |tenant: &str, spend: &[(&str, f64)]| Row {
            tenant: tenant.into(),
            shed_ratio: 0.0,
            admitted: 10,
            shed: 0,
            top_scope: None,
            top_scope_shed: 0,
            inflight: 0,
            spend_left: (!spend.is_empty())
                .then(|| spend.iter().map(|(u, x)| (u.to_string(), *x)).collect()),
            alerts: vec!["shed_ratio_high".into()],
        };
        let v = View {
            target: "http://127.0.0.1:9470".into(),
            store: "memory".into(),
            ready: true,
            page: Page {
                tenants: vec![
                    row("acme", &[("usd", 31.42)]),
                    row("globex", &[("usd", -0.5), ("tokens", 1_250_000.0)]),
                    row("initech", &[]),
                ],
                total: 3,
                window_s: 300.0,
            },
        };
        let text = render(&v);
        let lines: Vec<&str> = text.lines().collect();
        let col = lines[2].find("SPEND LEFT").expect("the column");
        assert!(
            lines[2][col..].starts_with("SPEND LEFT          ALERTS"),
            "{text}"
        );
        let cell = |l: &str| l.chars().skip(col).take(SPEND_WIDTH).collect::<String>();
        assert_eq!(cell(lines[3]).trim_end(), "usd 31.42", "{text}");
        // Two units by name, cut to the column.
        assert_eq!(cell(lines[4]), "tokens 1250000 us…", "{text}");
        assert_eq!(cell(lines[5]).trim_end(), "-", "{text}");
        assert!(lines[5].ends_with("shed_ratio_high"), "{text}");
    }
}
