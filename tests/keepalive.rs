//! Black-box: an answer given before the request's body was read never breaks the keep-alive
//! connection it went out on. A client library with a connection pool sends its next request on the
//! same connection; that request must be answered, unless the early answer said `Connection: close`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Daemon;

/// Limits no test here comes near: every valid admission is admitted.
const ROOMY: &str = r#"
[limits.subject]
rate = "100000/s"
burst = 100000
concurrency = 100000
[limits.tenant]
rate = "100000/s"
burst = 100000
concurrency = 100000
[limits.global]
rate = "100000/s"
burst = 100000
"#;

/// One HTTP/1.1 connection, read and written by hand so that the test decides how the request's
/// bytes are split into writes.
struct Conn {
    reader: BufReader<TcpStream>,
}

/// An answer as read off the connection.
struct Answer {
    status: u16,
    close: bool,
    head: String,
}

impl Conn {
    fn open(addr: &str) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Conn {
            reader: BufReader::new(s),
        }
    }

    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let s = self.reader.get_mut();
        s.write_all(bytes)?;
        s.flush()
    }

    /// Reads one answer (head and a `Content-Length` body).
    fn read(&mut self) -> std::io::Result<Answer> {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the connection ended after {head:?}"),
                ));
            }
            if line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let lower = head.to_ascii_lowercase();
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let len: usize = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let close = lower
            .lines()
            .any(|l| l.starts_with("connection:") && l.contains("close"));
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body)?;
        Ok(Answer {
            status,
            close,
            head,
        })
    }
}

/// A request whose answer comes before its body is read: the head, then the body.
struct Case {
    name: &'static str,
    head: String,
    body: Vec<u8>,
    status: u16,
}

fn case(name: &'static str, request_line: &str, headers: &str, body: Vec<u8>, status: u16) -> Case {
    Case {
        name,
        head: format!(
            "{request_line}\r\nHost: admitd\r\n{headers}Content-Length: {}\r\n\r\n",
            body.len()
        ),
        body,
        status,
    }
}

fn admission() -> Vec<u8> {
    let body = br#"{"tenant":"acme","subject":"bot","tool":"search"}"#;
    let mut r = format!(
        "POST /v1/admit HTTP/1.1\r\nHost: admitd\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

#[test]
fn an_early_answer_leaves_the_connection_usable_or_says_it_closes() {
    let d = Daemon::start(ROOMY);
    let json = br#"{"tenant":"acme","subject":"bot","tool":"search","cost":1}"#.to_vec();
    let cases = [
        case(
            "wrong content type",
            "POST /v1/admit HTTP/1.1",
            "Content-Type: text/plain\r\n",
            json.clone(),
            400,
        ),
        case(
            "no content type",
            "POST /v1/release HTTP/1.1",
            "",
            json.clone(),
            400,
        ),
        case(
            "unknown route",
            "POST /v1/admits HTTP/1.1",
            "Content-Type: application/json\r\n",
            json.clone(),
            404,
        ),
        case(
            "method not allowed",
            "PUT /v1/admit HTTP/1.1",
            "Content-Type: application/json\r\n",
            json.clone(),
            405,
        ),
        case(
            "a GET route sent a body",
            "GET /v1/tenants/%zz HTTP/1.1",
            "Content-Type: application/json\r\n",
            json.clone(),
            400,
        ),
        case(
            "declared length over the limit",
            "POST /v1/feedback HTTP/1.1",
            "Content-Type: application/json\r\n",
            vec![b' '; 70 * 1024],
            413,
        ),
    ];
    // The race needs the body to arrive after the answer went out; the delays cover both orders.
    let delays = [0u64, 1, 5, 20];
    let rounds = 25;
    let mut conn = Conn::open(&d.addr);
    let mut kept = 0;
    for c in &cases {
        for round in 0..rounds {
            let delay = Duration::from_millis(delays[round % delays.len()]);
            conn.write(c.head.as_bytes()).expect("send the head");
            std::thread::sleep(delay);
            conn.write(&c.body).expect("send the body");
            let early = conn
                .read()
                .unwrap_or_else(|e| panic!("{}: no answer: {e}", c.name));
            assert_eq!(early.status, c.status, "{}: {}", c.name, early.head);
            if early.close {
                // Said so: the client opens a new connection.
                conn = Conn::open(&d.addr);
                continue;
            }
            let next = conn
                .write(&admission())
                .and_then(|()| conn.read())
                .unwrap_or_else(|e| {
                    panic!(
                        "{} (round {round}, {delay:?} between head and body): the connection broke \
                         after an answer that did not say Connection: close: {e}\n{}",
                        c.name, early.head
                    )
                });
            assert_eq!(next.status, 200, "{}: {}", c.name, next.head);
            kept += 1;
        }
    }
    // Small bodies are read and thrown away: those connections stay open.
    assert!(kept >= 5 * rounds, "only {kept} connections were kept");
}

/// A body too long to drain closes the connection, and the answer says so.
#[test]
fn a_body_too_long_to_drain_closes_the_connection_and_says_so() {
    let d = Daemon::start(ROOMY);
    let mut conn = Conn::open(&d.addr);
    // Chunked, so that nothing in the head tells the daemon how long it is.
    conn.write(
        b"POST /v1/admit HTTP/1.1\r\nHost: admitd\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .unwrap();
    let chunk = format!("{:x}\r\n{}\r\n", 256 * 1024, " ".repeat(256 * 1024));
    // The daemon may stop reading (and close) while this is being written.
    let _ = conn.write(chunk.as_bytes());
    let answer = conn.read().expect("an answer");
    assert_eq!(answer.status, 400, "{}", answer.head);
    assert!(answer.close, "{}", answer.head);
}
