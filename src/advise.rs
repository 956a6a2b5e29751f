//! `admitd advise`: asks running daemons for their advice and prints it as a config file whose
//! comments say where each number came from and what the replay found.
//!
//! With one `--url` it prints that daemon's `GET /v1/advice`. With several (the replicas of one
//! shared store, each of which saw only its own calls) it fetches each one's recording
//! (`?format=raw`), merges them into one period ([`Period::merge`]) and runs the same method here
//! on the whole, against the first daemon's config.
//!
//! The HTTP it speaks is just enough for that: one `GET` per daemon over a blocking socket,
//! `http://` only, the answer read to its end.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::advice::Period;
use crate::api::advice::{Raw, RAW_FORMAT};
use crate::config::Config;

/// How long one daemon may take to answer (the advice replays the period twice).
const TIMEOUT: Duration = Duration::from_secs(60);

/// Host and port, and the path prefix, of an `http://` URL.
fn split_url(url: &str) -> Result<(String, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// URLs are supported"))?;
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(format!("{url}: no host"));
    }
    let authority = if authority.contains(':') && !authority.ends_with(']') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    Ok((authority, prefix.to_string()))
}

/// `GET` of `path` on the daemon at `url`: the status and the body.
fn get(url: &str, path: &str, token: Option<&str>) -> Result<(u16, Vec<u8>), String> {
    let (authority, prefix) = split_url(url)?;
    let deadline = Instant::now() + TIMEOUT;
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("{url}: {e}"))?
        .next()
        .ok_or_else(|| format!("{url}: no address"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let request = format!(
        "GET {prefix}{path} HTTP/1.1\r\nhost: {authority}\r\n{auth}connection: close\r\n\r\n"
    );
    s.set_write_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.write_all(request.as_bytes())
        .map_err(|e| format!("{url}: cannot send: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| format!("{url}: no complete answer within {}s", TIMEOUT.as_secs()))?;
        s.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("{url}: cannot read the answer: {e}")),
        }
    }
    parse_answer(&got).ok_or_else(|| format!("{url}: the answer is not HTTP"))
}

/// The status and body of a complete HTTP/1.1 answer (plain or chunked).
fn parse_answer(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = &raw[end + 4..];
    if !chunked {
        return Some((status, body.to_vec()));
    }
    let (mut out, mut rest) = (Vec::new(), body);
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some((status, out));
        }
        out.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

fn get_json(url: &str, path: &str, token: Option<&str>) -> Result<Value, String> {
    let (status, body) = get(url, path, token)?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| format!("{url}{path}: answered {status} with a body that is not JSON: {e}"))?;
    if status != 200 {
        let message = v["message"].as_str().unwrap_or("(no message)");
        return Err(format!("{url}{path}: {status} {message}"));
    }
    Ok(v)
}

/// The advice, as `GET /v1/advice` answers it, from one daemon or merged from several.
pub fn fetch(urls: &[String], over: &str, token: Option<&str>) -> Result<Value, String> {
    let over_q = format!("over={over}");
    if let [url] = urls {
        return get_json(url, &format!("/v1/advice?{over_q}"), token);
    }
    let mut periods = Vec::new();
    let mut config: Option<(String, String)> = None;
    let mut end_unix_ms = 0;
    for url in urls {
        let v = get_json(url, &format!("/v1/advice?{over_q}&format=raw"), token)?;
        let raw: Raw = serde_json::from_value(v)
            .map_err(|e| format!("{url}: not a recording admitd can read: {e}"))?;
        if raw.format != RAW_FORMAT {
            return Err(format!(
                "{url}: recording format {:?}, not {RAW_FORMAT}",
                raw.format
            ));
        }
        if !raw.period.is_consistent() {
            return Err(format!(
                "{url}: the recording names calls it has no names for"
            ));
        }
        end_unix_ms = end_unix_ms.max(raw.end_unix_ms);
        config.get_or_insert((url.clone(), raw.config));
        periods.push(raw.period);
    }
    let (from, text) = config.unwrap_or_default();
    let cfg = Config::parse(&from, &text).map_err(|e| e.to_string())?;
    let merged = Period::merge(&periods);
    let mut advice = crate::advice::advise(&merged, &cfg, &text, end_unix_ms)?;
    advice.notes.push(format!(
        "merged from {} replicas' recordings (each records only the calls it decided), against the config of {from}",
        urls.len()
    ));
    serde_json::to_value(&advice).map_err(|e| e.to_string())
}

fn comment_lines(out: &mut String, text: &str) {
    for line in text.lines() {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
}

fn shed_summary(list: &Value) -> String {
    let Some(list) = list.as_array().filter(|l| !l.is_empty()) else {
        return "nobody".into();
    };
    let names: Vec<String> = list
        .iter()
        .take(8)
        .map(|w| {
            format!(
                "{}/{} ({} of {})",
                w["tenant"].as_str().unwrap_or("?"),
                w["subject"].as_str().unwrap_or("?"),
                w["shed"],
                w["calls"]
            )
        })
        .collect();
    let more = list.len().saturating_sub(names.len());
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!("{} subjects: {}{more}", list.len(), names.join(", "))
}

/// The advice as a config file: a summary in comments, then the proposed config.
pub fn render(advice: &Value, urls: &[String]) -> String {
    let mut out = String::new();
    let mut summary = format!(
        "admitd advise: {} calls over {}s seen by {}\n",
        advice["calls"],
        advice["over_s"],
        urls.join(", ")
    );
    let limits = &advice["limits"];
    let mut section = |name: String, p: &Value| {
        summary.push_str(&format!("[{name}]\n"));
        for key in ["rate", "burst", "concurrency"] {
            if p[key].is_null() && p["from"][key].is_null() {
                continue;
            }
            let value = if p[key].is_null() {
                "(kept)".to_string()
            } else {
                p[key].to_string()
            };
            summary.push_str(&format!(
                "  {key} = {value}: {}\n",
                p["from"][key].as_str().unwrap_or("")
            ));
        }
    };
    for layer in ["subject", "tenant"] {
        if limits[layer].is_object() {
            section(format!("limits.{layer}"), &limits[layer]);
        }
    }
    for (kind, key) in [("tools", "tools"), ("upstreams", "upstreams")] {
        if let Some(m) = limits[key].as_object() {
            for (name, p) in m {
                section(format!("{kind}.{name}"), p);
            }
        }
    }
    summary.push_str(&format!(
        "Replayed, the current config would refuse {}\n",
        shed_summary(&advice["would_shed"]["current"])
    ));
    summary.push_str(&format!(
        "Replayed, the proposal would refuse {}\n",
        shed_summary(&advice["would_shed"]["proposed"])
    ));
    for n in advice["notes"].as_array().into_iter().flatten() {
        summary.push_str(&format!("Note: {}\n", n.as_str().unwrap_or("")));
    }
    comment_lines(&mut out, &summary);
    out.push('\n');
    out.push_str(advice["toml"].as_str().unwrap_or(""));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_authority_and_prefix() {
        assert_eq!(
            split_url("http://127.0.0.1:9470").unwrap(),
            ("127.0.0.1:9470".into(), String::new())
        );
        assert_eq!(
            split_url("http://admitd.internal/api/").unwrap(),
            ("admitd.internal:80".into(), "/api".into())
        );
        assert!(split_url("https://x:1")
            .unwrap_err()
            .contains("only http://"));
        assert!(split_url("http:///x").is_err());
    }

    #[test]
    fn answers_are_read_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_answer(plain), Some((200, b"{}".to_vec())));
        let chunked =
            b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n2\r\n\"}\r\n0\r\n\r\n";
        assert_eq!(parse_answer(chunked), Some((400, b"{\"a\"}".to_vec())));
        assert_eq!(parse_answer(b"garbage"), None);
    }
}
