//! Redis's wire protocol (RESP2), as a lane speaks it on its own connection to a `redis://` server:
//! a command written straight into the lane's buffer, a reply parsed straight from its read buffer.
//!
//! The lane sends one script call per batch and reads one reply per call, in order, so it needs
//! neither a client's request queue nor its driver task. Through the client library, each batch
//! went through a channel to the connection's driver task and back, and its reply through a
//! general parser built of parser combinators: 2.1 µs of admitd's CPU per admission in the
//! shared-store benchmark (`perf`, 1 000 tenants x 20 subjects, 64 connections), about a tenth of
//! it (docs/BENCHMARKS.md, "Shared store (Redis)"). `rediss://` (TLS) goes through the library.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::error::StoreError;

/// A reply: a value, or the error Redis answered instead.
#[derive(Debug, PartialEq)]
pub(super) enum Frame {
    Value(redis::Value),
    Error(String),
}

/// Appends a command (an array of bulk strings) to `out`.
pub(super) fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    header(out, b'*', args.len());
    for a in args {
        arg(out, a);
    }
}

/// Appends the header of a command of `n` arguments; each follows with [`arg`].
pub(super) fn header(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends one argument of a command.
pub(super) fn arg(out: &mut Vec<u8>, a: &[u8]) {
    header(out, b'$', a.len());
    out.extend_from_slice(a);
    out.extend_from_slice(b"\r\n");
}

/// The bytes a command of these arguments takes (to size a buffer once).
pub(super) fn arg_len(a: &[u8]) -> usize {
    a.len() + 16
}

/// Parses the reply at the front of `buf`: the reply and the bytes it took, `None` while it has not
/// all arrived, an error for bytes that are no reply (the connection is then of no further use).
pub(super) fn parse(buf: &[u8]) -> Result<Option<(Frame, usize)>, String> {
    match value(buf, 0)? {
        None => Ok(None),
        Some((Ok(v), end)) => Ok(Some((Frame::Value(v), end))),
        Some((Err(e), end)) => Ok(Some((Frame::Error(e), end))),
    }
}

type Parsed = Option<(Result<redis::Value, String>, usize)>;

/// The line that starts at `at` (without its CRLF) and where the next one starts. Lines of a reply
/// are short (a length, a number, `OK`): a scan for CR, then its LF, and digits read in place cost
/// 1 100 fewer instructions per admission (of 55 500, one decision per script call) than a search
/// for the two-byte pattern and `str::from_utf8` + `str::parse` (`STORE=redis scripts/count.sh`).
fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let rest = buf.get(at..)?;
    let mut from = 0;
    loop {
        let n = from + rest.get(from..)?.iter().position(|&b| b == b'\r')?;
        if *rest.get(n + 1)? == b'\n' {
            return Some((&rest[..n], at + n + 2));
        }
        from = n + 1;
    }
}

/// A decimal integer of a reply (a length, a `:` number): optional `-`, then digits.
fn int(s: &[u8]) -> Result<i64, String> {
    let bad = || format!("not a number in a reply: {:?}", String::from_utf8_lossy(s));
    let (negative, digits) = match s {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() {
        return Err(bad());
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return Err(bad());
        }
        let d = i64::from(d - b'0');
        n = n
            .checked_mul(10)
            .and_then(|n| {
                if negative {
                    n.checked_sub(d)
                } else {
                    n.checked_add(d)
                }
            })
            .ok_or_else(bad)?;
    }
    Ok(n)
}

fn value(buf: &[u8], at: usize) -> Result<Parsed, String> {
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some((l, next)) = line(buf, at + 1) else {
        return Ok(None);
    };
    let v = match kind {
        b'+' if l == b"OK" => redis::Value::Okay,
        b'+' => redis::Value::SimpleString(String::from_utf8_lossy(l).into_owned()),
        b'-' => return Ok(Some((Err(String::from_utf8_lossy(l).into_owned()), next))),
        b':' => redis::Value::Int(int(l)?),
        b'$' => {
            let n = int(l)?;
            if n < 0 {
                return Ok(Some((Ok(redis::Value::Nil), next)));
            }
            let end = next + n as usize;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err("a bulk string without its CRLF".into());
            }
            return Ok(Some((
                Ok(redis::Value::BulkString(buf[next..end].to_vec())),
                end + 2,
            )));
        }
        b'*' => {
            let n = int(l)?;
            if n < 0 {
                return Ok(Some((Ok(redis::Value::Nil), next)));
            }
            let mut items = Vec::with_capacity((n as usize).min(1024));
            let mut at = next;
            for _ in 0..n {
                let Some((item, end)) = value(buf, at)? else {
                    return Ok(None);
                };
                // An error inside an array (no script of admitd's returns one): kept as a string
                // that no reader takes for an answer.
                items.push(item.unwrap_or_else(|e| redis::Value::SimpleString(format!("-{e}"))));
                at = end;
            }
            return Ok(Some((Ok(redis::Value::Array(items)), at)));
        }
        other => return Err(format!("a reply starting with byte {other}")),
    };
    Ok(Some((Ok(v), next)))
}

/// Opens a connection to `host:port` and makes it ready as the client library would for `info`
/// (`AUTH`, `SELECT`), within `limit`.
pub(super) async fn connect(
    host: &str,
    port: u16,
    info: &redis::RedisConnectionInfo,
    limit: Duration,
) -> Result<TcpStream, StoreError> {
    let open = async {
        let mut s = TcpStream::connect((host, port))
            .await
            .map_err(|e| StoreError::Connection(format!("{host}:{port}: {e}")))?;
        let _ = s.set_nodelay(true);
        let mut hello = Vec::new();
        let mut expect = 0;
        if let Some(password) = info.password() {
            match info.username() {
                Some(user) => command(&mut hello, &[b"AUTH", user.as_bytes(), password.as_bytes()]),
                None => command(&mut hello, &[b"AUTH", password.as_bytes()]),
            }
            expect += 1;
        }
        if info.db() != 0 {
            command(
                &mut hello,
                &[b"SELECT", itoa::Buffer::new().format(info.db()).as_bytes()],
            );
            expect += 1;
        }
        if expect > 0 {
            s.write_all(&hello)
                .await
                .map_err(|e| StoreError::Connection(e.to_string()))?;
            let mut buf = Vec::with_capacity(256);
            let mut start = 0;
            while expect > 0 {
                match parse(&buf[start..]).map_err(StoreError::Connection)? {
                    Some((Frame::Error(e), _)) => return Err(StoreError::Connection(e)),
                    Some((Frame::Value(_), used)) => {
                        start += used;
                        expect -= 1;
                    }
                    None => {
                        if s.read_buf(&mut buf)
                            .await
                            .map_err(|e| StoreError::Connection(e.to_string()))?
                            == 0
                        {
                            return Err(StoreError::Connection(
                                "the server closed the connection".into(),
                            ));
                        }
                    }
                }
            }
        }
        Ok(s)
    };
    match tokio::time::timeout(limit, open).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Connection("connecting timed out".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_command_is_an_array_of_bulk_strings() {
        let mut out = Vec::new();
        command(&mut out, &[b"EVALSHA", b"ab", b"", b"x\r\ny"]);
        assert_eq!(
            out,
            b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$0\r\n\r\n$4\r\nx\r\ny\r\n"
        );
    }

    #[test]
    fn every_reply_a_script_call_gets_is_read() {
        let wire = b"*5\r\n$2\r\nok\r\n:-12\r\n$-1\r\n*2\r\n+OK\r\n+PONG\r\n*0\r\n";
        let (frame, used) = parse(wire).unwrap().unwrap();
        assert_eq!(used, wire.len());
        assert_eq!(
            frame,
            Frame::Value(Value::Array(vec![
                bulk("ok"),
                Value::Int(-12),
                Value::Nil,
                Value::Array(vec![Value::Okay, Value::SimpleString("PONG".into())]),
                Value::Array(vec![]),
            ]))
        );
        let (frame, used) = parse(b"-NOSCRIPT No matching script\r\n:1\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(frame, Frame::Error("NOSCRIPT No matching script".into()));
        assert_eq!(used, 30);
        // A bulk string may hold CRLF and binary bytes.
        let (frame, _) = parse(b"$4\r\n\r\n\x00\xff\r\n").unwrap().unwrap();
        assert_eq!(frame, Frame::Value(Value::BulkString(vec![13, 10, 0, 255])));
    }

    #[test]
    fn integers_to_the_ends_of_i64_and_a_cr_inside_a_line() {
        for n in [0, 7, -1, 1234567890123, i64::MAX, i64::MIN] {
            let wire = format!(":{n}\r\n");
            let (frame, used) = parse(wire.as_bytes()).unwrap().unwrap();
            assert_eq!((frame, used), (Frame::Value(Value::Int(n)), wire.len()));
        }
        // A CR not followed by LF is part of the line (only CRLF ends it).
        let (frame, used) = parse(b"+a\rb\r\n:1\r\n").unwrap().unwrap();
        assert_eq!(frame, Frame::Value(Value::SimpleString("a\rb".into())));
        assert_eq!(used, 6);
        // A line whose CR is the last byte so far waits for its LF.
        assert_eq!(parse(b":12\r").unwrap(), None);
    }

    #[test]
    fn a_reply_cut_anywhere_waits_for_the_rest() {
        let wire = b"*3\r\n$5\r\nhello\r\n:7\r\n*1\r\n$-1\r\n";
        for cut in 0..wire.len() {
            assert_eq!(parse(&wire[..cut]).unwrap(), None, "cut at {cut}");
        }
        assert!(parse(wire).unwrap().is_some());
    }

    #[test]
    fn bytes_that_are_no_reply_are_an_error_not_a_panic() {
        for bad in [
            &b"?x\r\n"[..],
            b":1x\r\n",
            b"$3\r\nabcde\r\n",
            b"*z\r\n",
            b":-\r\n",
            b":\r\n",
            b":+5\r\n",
            b":9223372036854775808\r\n",
            b"$-\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
