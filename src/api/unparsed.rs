//! Answers to requests that are not HTTP the server can read, in the API's JSON error form.
//!
//! A request whose request line, headers or framing hyper cannot parse (a `Content-Length` that is not
//! a number, two different ones, a garbled request line, more than 100 headers, a path longer than
//! hyper's buffer) never reaches the routes: hyper answers it itself, with a status, `connection:
//! close`, `content-length: 0` and nothing else, then closes the connection. The contract says every
//! error answer carries `{"error","message"}`, and a client that reads that body on every 4xx would
//! find nothing there. hyper has no hook for those answers, so [`JsonErrors`] sits between hyper and
//! the socket and rewrites that one form of answer, which no route produces (the routes' errors all
//! have a JSON body), into the same status with a JSON body. Every other write passes through
//! untouched after a comparison of its first bytes.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What hyper writes after the status line of its own error answers (hyper 1.x).
const HYPER_ERROR_HEADERS: &[u8] = b"connection: close\r\ncontent-length: 0\r\n";

/// A connection's socket, with hyper's own error answers given a JSON body (see the module doc).
pub struct JsonErrors<T> {
    inner: T,
    /// A rewritten answer and how much of it has been written. hyper was told the whole of its own
    /// answer was written; the rewrite goes out before any flush or shutdown completes.
    pending: Option<(Vec<u8>, usize)>,
}

impl<T> JsonErrors<T> {
    pub fn new(inner: T) -> Self {
        JsonErrors {
            inner,
            pending: None,
        }
    }
}

impl<T: AsyncWrite + Unpin> JsonErrors<T> {
    /// Writes what is left of a rewritten answer.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written == bytes.len() {
                self.pending = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrors<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrors<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(answer) = rewrite(buf) {
            this.pending = Some((answer, 0));
            // The rewrite stands for all of hyper's bytes; what the socket does not take now is
            // written by the next call, flush or shutdown.
            let _ = this.poll_pending(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// hyper's own error answer in `head`, rewritten with a JSON body; `None` for anything else.
///
/// The answer is recognised by its form: a 4xx or 5xx status line, then exactly
/// [`HYPER_ERROR_HEADERS`], then the rest of the head and nothing after it. Any other bytes pass
/// through as they are; should hyper change the form, its answers would pass through unchanged
/// (the black-box tests would say so).
fn rewrite(head: &[u8]) -> Option<Vec<u8>> {
    let status = head.strip_prefix(b"HTTP/1.1 ")?;
    if !matches!(status.first(), Some(b'4' | b'5')) {
        return None;
    }
    let line_end = head.windows(2).take(64).position(|w| w == b"\r\n")? + 2;
    let rest = head[line_end..].strip_prefix(HYPER_ERROR_HEADERS)?;
    // The head ends where the write does: one answer, with no body.
    if head.windows(4).position(|w| w == b"\r\n\r\n") != Some(head.len() - 4) {
        return None;
    }
    let code = std::str::from_utf8(status.get(..3)?).ok()?;
    let (error, message) = explain(code);
    let body = serde_json::json!({ "error": error, "message": message }).to_string();
    let mut out = Vec::with_capacity(head.len() + body.len() + 48);
    out.extend_from_slice(&head[..line_end]);
    out.extend_from_slice(b"content-type: application/json\r\nconnection: close\r\n");
    out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    out.extend_from_slice(rest);
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

/// The error code and sentence for a status hyper answered by itself.
fn explain(status: &str) -> (&'static str, &'static str) {
    match status {
        "431" => (
            "headers_too_large",
            "The request has too many headers (at most 100) or headers too large to read.",
        ),
        "414" => (
            "uri_too_long",
            "The request's path is too long to read; admitd's routes are short.",
        ),
        "505" => (
            "http_version_not_supported",
            "admitd speaks HTTP/1.1; send the request as HTTP/1.1.",
        ),
        _ => (
            "invalid_request",
            "The request is not HTTP/1.1 that admitd can read: check its request line, its headers and its Content-Length.",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HYPER_400: &[u8] = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Fri, 04 Dec 2026 06:08:51 GMT\r\n\r\n";

    fn split(answer: &[u8]) -> (String, serde_json::Value) {
        let text = std::str::from_utf8(answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, body.len(), "{text}");
        (head.to_string(), serde_json::from_str(body).unwrap())
    }

    #[test]
    fn hypers_own_error_answers_get_the_json_body() {
        let (head, body) = split(&rewrite(HYPER_400).unwrap());
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        assert!(
            head.contains("date: Fri, 04 Dec 2026 06:08:51 GMT"),
            "{head}"
        );
        assert_eq!(body["error"], "invalid_request");
        assert!(body["message"].as_str().unwrap().ends_with('.'));

        let h431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        assert_eq!(
            split(&rewrite(h431).unwrap()).1["error"],
            "headers_too_large"
        );
        let h414 =
            b"HTTP/1.1 414 URI Too Long\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        assert_eq!(split(&rewrite(h414).unwrap()).1["error"], "uri_too_long");
    }

    #[test]
    fn every_other_write_passes_through() {
        for other in [
            &b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n"[..],
            b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            // an error answer with bytes after its head, or two heads in one write
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\nmore",
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\nHTTP/1.1 400 Bad Request\r\n\r\n",
            b"{\"admitted\":true}",
            b"HTTP/1.1 4",
            b"",
        ] {
            assert!(rewrite(other).is_none(), "{}", String::from_utf8_lossy(other));
        }
    }

    /// Through the wrapper, hyper's answer leaves as the rewrite even when the socket takes it a
    /// few bytes at a time, and hyper is told its own bytes were all written.
    #[tokio::test]
    async fn a_rewritten_answer_is_written_whole_before_the_flush_completes() {
        let (client, server) = tokio::io::duplex(7);
        let mut io = JsonErrors::new(server);
        let reader = tokio::spawn(async move {
            let mut client = client;
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        });
        let n = io.write(HYPER_400).await.unwrap();
        assert_eq!(n, HYPER_400.len());
        io.flush().await.unwrap();
        io.shutdown().await.unwrap();
        drop(io);
        let got = reader.await.unwrap();
        assert_eq!(got, rewrite(HYPER_400).unwrap());
        // Ordinary bytes pass through unchanged.
        let (client, server) = tokio::io::duplex(64);
        let mut io = JsonErrors::new(server);
        io.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        io.shutdown().await.unwrap();
        drop(io);
        let mut got = Vec::new();
        let mut client = client;
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"HTTP/1.1 200 OK\r\n\r\n");
    }
}
