//! `admitd health`: asks a running daemon's `/healthz` (or `/readyz`) and exits 0 on a 200, 1
//! otherwise, so that a container `HEALTHCHECK` or a script needs no HTTP client in the image.
//!
//! The probe speaks just enough HTTP/1.1 over a blocking socket (TCP or the Unix socket `listen`
//! names) to read the status line, within one overall timeout.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::config::ListenAddr;

/// Where to connect to reach a daemon listening on `listen`: a wildcard address is reached on
/// loopback.
pub fn probe_target(listen: &ListenAddr) -> ListenAddr {
    match listen {
        ListenAddr::Tcp(a) if a.ip().is_unspecified() => {
            let ip = match a.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            };
            ListenAddr::Tcp(SocketAddr::new(ip, a.port()))
        }
        other => other.clone(),
    }
}

/// Sends `GET path` to `target` and returns the answer's status code.
pub fn probe(target: &ListenAddr, path: &str, timeout: Duration) -> Result<u16, String> {
    let deadline = Instant::now() + timeout;
    let request = format!("GET {path} HTTP/1.1\r\nhost: admitd\r\nconnection: close\r\n\r\n");
    let answer = match target {
        ListenAddr::Tcp(addr) => {
            let mut s = TcpStream::connect_timeout(addr, timeout)
                .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
            exchange(&mut s, &request, deadline, |s, t| {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            })?
        }
        #[cfg(unix)]
        ListenAddr::Unix(path) => {
            let mut s = std::os::unix::net::UnixStream::connect(path)
                .map_err(|e| format!("cannot connect to unix:{}: {e}", path.display()))?;
            exchange(&mut s, &request, deadline, |s, t| {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            })?
        }
        #[cfg(not(unix))]
        ListenAddr::Unix(_) => return Err("Unix sockets need a Unix system".into()),
    };
    status_of(&answer).ok_or_else(|| "the answer is not HTTP".to_string())
}

/// Writes the request and reads until the status line is complete, the peer closes, or the deadline.
fn exchange<S: Read + Write>(
    s: &mut S,
    request: &str,
    deadline: Instant,
    set_timeout: impl Fn(&S, Duration) -> std::io::Result<()>,
) -> Result<Vec<u8>, String> {
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| "no answer in time".to_string())
    };
    set_timeout(s, left()?).map_err(|e| e.to_string())?;
    s.write_all(request.as_bytes())
        .map_err(|e| format!("cannot send the probe: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while !got.windows(2).any(|w| w == b"\r\n") && got.len() < 4096 {
        set_timeout(s, left()?).map_err(|e| e.to_string())?;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("cannot read the answer: {e}")),
        }
    }
    Ok(got)
}

/// The status code of an HTTP/1.x status line.
fn status_of(answer: &[u8]) -> Option<u16> {
    let line = answer.split(|b| *b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let code = parts.next()?;
    (code.len() == 3).then(|| code.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_addresses_are_probed_on_loopback() {
        let t = |s: &str| probe_target(&s.parse().unwrap()).to_string();
        assert_eq!(t("0.0.0.0:9470"), "127.0.0.1:9470");
        assert_eq!(t("[::]:9470"), "[::1]:9470");
        assert_eq!(t("10.0.0.5:1"), "10.0.0.5:1");
        assert_eq!(t("unix:/run/a.sock"), "unix:/run/a.sock");
    }

    #[test]
    fn status_lines_are_read_and_anything_else_is_not_http() {
        assert_eq!(status_of(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(
            status_of(b"HTTP/1.0 503 Service Unavailable\r\nx"),
            Some(503)
        );
        assert_eq!(status_of(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(status_of(b"HTTP/1.1 20"), None);
        assert_eq!(status_of(b""), None);
    }

    #[test]
    fn nothing_listening_is_an_error_not_a_hang() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let e = probe(&ListenAddr::Tcp(addr), "/healthz", Duration::from_secs(2)).unwrap_err();
        assert!(e.contains("cannot connect"), "{e}");
        // A peer that accepts and never answers: the timeout ends the probe.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let start = Instant::now();
        let e = probe(
            &ListenAddr::Tcp(silent.local_addr().unwrap()),
            "/healthz",
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3), "{e}");
    }
}
