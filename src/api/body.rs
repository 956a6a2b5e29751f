//! Reading request bodies: content type, size limit and JSON, each failure a clear 4xx.
//!
//! The body is read as a stream and cut off at 64 KiB whether or not the client sent a
//! `Content-Length`, so neither a lying header nor a chunked upload can make the daemon buffer more.
//! What is left of an oversized body is read and thrown away (up to 1 MiB, for 1 s at most) before
//! the 413 goes out, so that a client still sending reads the answer rather than a reset.
//!
//! Every answer given before the whole body was read (a wrong content type, an unknown route, a
//! wrong method, any early 4xx) either reads the rest first or says `Connection: close`
//! ([`settle`]). hyper otherwise ends such a keep-alive connection after the answer, without saying
//! so, whenever the body's bytes had not arrived by then, and the client's next request on the
//! pooled connection fails.

use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use warp::http::header::{HeaderName, HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use warp::http::{HeaderMap, StatusCode};

use super::error::ApiError;

/// The largest request body accepted.
pub const MAX_BODY: usize = 64 * 1024;

/// How much of an oversized body is read and thrown away before the 413 goes out, and for how long at
/// most: a client still sending its body then reads the answer instead of a reset connection (closing a
/// socket with unread data resets it). Larger or slower bodies are cut off.
const DRAIN_LIMIT: usize = 1024 * 1024;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(1);

/// Reads and discards what is left of a body that will not be used (see [`DRAIN_LIMIT`]).
pub async fn drain<S, B>(stream: &mut S)
where
    S: Stream<Item = Result<B, warp::Error>> + Unpin,
    B: Buf,
{
    drain_up_to(stream, DRAIN_LIMIT).await;
}

/// Reads and discards at most `limit` bytes of what is left, for [`DRAIN_TIME`] at most. True when
/// the body ended within both bounds.
async fn drain_up_to<S, B>(stream: &mut S, limit: usize) -> bool
where
    S: Stream<Item = Result<B, warp::Error>> + Unpin,
    B: Buf,
{
    let drained = tokio::time::timeout(DRAIN_TIME, async {
        let mut read = 0;
        loop {
            match stream.next().await {
                None => return true,
                Some(Ok(chunk)) => {
                    read += chunk.remaining();
                    if read > limit {
                        return false;
                    }
                }
                Some(Err(_)) => return false,
            }
        }
    })
    .await;
    drained.unwrap_or(false)
}

/// A request body that remembers whether it was read to its end.
pub struct Tracked<S> {
    inner: S,
    ended: bool,
}

impl<S> Tracked<S> {
    pub fn new(inner: S) -> Self {
        Tracked {
            inner,
            ended: false,
        }
    }
}

impl<S: Stream + Unpin> Stream for Tracked<S> {
    type Item = S::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        if self.ended {
            return std::task::Poll::Ready(None);
        }
        let polled = std::pin::Pin::new(&mut self.inner).poll_next(cx);
        if let std::task::Poll::Ready(None) = polled {
            self.ended = true;
        }
        polled
    }
}

/// Makes `answer`, given before `body` was read to its end, safe for the connection it goes out on:
/// what is left of the body (at most [`MAX_BODY`] bytes, for [`DRAIN_TIME`] at most) is read and
/// thrown away, so the next request on a keep-alive connection finds the connection in order; a body
/// longer or slower than that, or one a 413 already gave up on, closes the connection instead, and
/// the answer says `Connection: close` so the client does not send its next request on it.
pub async fn settle<S, B>(body: &mut Tracked<S>, answer: &mut warp::reply::Response)
where
    S: Stream<Item = Result<B, warp::Error>> + Unpin,
    B: Buf,
{
    if body.ended {
        return;
    }
    // A 413 has drained as much as it will (see `DRAIN_LIMIT`).
    if answer.status() != StatusCode::PAYLOAD_TOO_LARGE && drain_up_to(body, MAX_BODY).await {
        return;
    }
    answer.headers_mut().insert(
        warp::http::header::CONNECTION,
        HeaderValue::from_static("close"),
    );
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the request body is larger than {MAX_BODY} bytes"),
    )
}

/// A request header as the API reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Header<T> {
    Absent,
    Present(T),
    /// Sent, but not visible ASCII, or not of the header's form.
    Unreadable,
}

impl<T> Header<T> {
    fn read(v: Option<&HeaderValue>, parse: impl FnOnce(&str) -> Option<T>) -> Self {
        match v.map(|v| v.to_str().ok().and_then(parse)) {
            None => Header::Absent,
            Some(Some(t)) => Header::Present(t),
            Some(None) => Header::Unreadable,
        }
    }
}

/// The `Content-Type` of a request: the exact value nearly every client sends, told apart without
/// a copy, or anything else, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentType {
    Json,
    Other(String),
}

/// The request headers the API reads, taken from the request before warp sees it (see
/// [`super::service`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub content_type: Header<ContentType>,
    /// The declared `Content-Length`.
    pub content_length: Header<u64>,
    /// The W3C `traceparent` header, read only when spans are exported.
    pub traceparent: Option<String>,
    /// Every header, for the edge check only (see [`super::service`]).
    pub edge: Option<Box<HeaderMap>>,
    /// `Authorization`, as sent (a reference-counted copy), for [`super::auth`].
    pub authorization: Option<HeaderValue>,
    /// The query string, for the routes that read one only (see [`super::service`]).
    pub query: Option<Box<str>>,
}

/// Looked up by a ready name: by a `&str` the map would parse and validate the name on every call.
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

impl Head {
    /// What a request without any of the headers has.
    pub const NONE: Head = Head {
        content_type: Header::Absent,
        content_length: Header::Absent,
        traceparent: None,
        edge: None,
        authorization: None,
        query: None,
    };

    /// Reads the headers; `traceparent` only when `traced` (spans are exported).
    pub fn read(headers: &HeaderMap, traced: bool) -> Self {
        let content_type = match headers.get(CONTENT_TYPE) {
            // What clients send nearly always, told without a copy.
            Some(v) if v.as_bytes() == b"application/json" => Header::Present(ContentType::Json),
            v => Header::read(v, |s| Some(ContentType::Other(s.to_owned()))),
        };
        Head {
            content_type,
            content_length: Header::read(headers.get(CONTENT_LENGTH), |s| s.trim().parse().ok()),
            traceparent: traced
                .then(|| headers.get(&TRACEPARENT)?.to_str().ok().map(str::to_owned))
                .flatten(),
            edge: None,
            authorization: headers.get(AUTHORIZATION).cloned(),
            query: None,
        }
    }
}

/// Checks the content type and declared length before anything is read.
pub fn check_headers(head: &Head) -> Result<(), ApiError> {
    match &head.content_type {
        // What clients send nearly always, checked without parsing.
        Header::Present(ContentType::Json) => {}
        Header::Present(ContentType::Other(ct)) => check_content_type(ct)?,
        Header::Absent => check_content_type("")?,
        Header::Unreadable => {
            return Err(ApiError::invalid(
                "the body must be JSON with Content-Type: application/json (got a value that is not visible ASCII)",
            ))
        }
    }
    match head.content_length {
        Header::Present(n) if n > MAX_BODY as u64 => Err(too_large()),
        Header::Unreadable => Err(ApiError::invalid(
            "the Content-Length header is not a number",
        )),
        _ => Ok(()),
    }
}

fn check_content_type(ct: &str) -> Result<(), ApiError> {
    let mime = ct.split(';').next().unwrap_or("").trim();
    if !mime.eq_ignore_ascii_case("application/json") {
        let shown = if ct.is_empty() {
            "none".to_string()
        } else {
            format!("{ct:?}")
        };
        return Err(ApiError::invalid(format!(
            "the body must be JSON with Content-Type: application/json (got {shown})"
        )));
    }
    Ok(())
}

/// Reads at most [`MAX_BODY`] bytes. A body that arrives in one piece (the usual case) is taken
/// as it is, without copying.
pub async fn read_limited<S, B>(mut stream: S) -> Result<Bytes, ApiError>
where
    S: Stream<Item = Result<B, warp::Error>> + Unpin,
    B: Buf,
{
    let read_error =
        |e: warp::Error| ApiError::invalid(format!("could not read the request body: {e}"));
    let Some(first) = stream.next().await else {
        return Ok(Bytes::new());
    };
    let mut first = first.map_err(read_error)?;
    if first.remaining() > MAX_BODY {
        drain(&mut stream).await;
        return Err(too_large());
    }
    let first = first.copy_to_bytes(first.remaining());
    let Some(second) = stream.next().await else {
        return Ok(first);
    };
    let mut buf = BytesMut::from(&first[..]);
    let mut next = Some(second);
    while let Some(chunk) = next {
        let mut chunk = chunk.map_err(read_error)?;
        if buf.len() + chunk.remaining() > MAX_BODY {
            drain(&mut stream).await;
            return Err(too_large());
        }
        while chunk.has_remaining() {
            let part = chunk.chunk();
            let n = part.len();
            buf.extend_from_slice(part);
            chunk.advance(n);
        }
        next = stream.next().await;
    }
    Ok(buf.freeze())
}

/// Parses a JSON body, naming the problem and where it is.
pub fn parse_json<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            "the request body is empty; send a JSON object",
        ));
    }
    // Every request is an object; serde would also take the fields of a struct from an array.
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') && serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok() {
        return Err(ApiError::invalid(
            "the request body must be a JSON object ({\"name\": value, ...})",
        ));
    }
    // serde_json checks the UTF-8 of every string it reads from bytes, keys included (seven per
    // admission); checked once for the whole body, the strings are read from a `str` as they are.
    // A body that is not UTF-8 goes the slow way, for serde's own error message and position.
    let parsed = match std::str::from_utf8(bytes) {
        Ok(text) => serde_json::from_str(text),
        Err(_) => serde_json::from_slice(bytes),
    };
    parsed.map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Data => "the JSON does not match the request schema",
            serde_json::error::Category::Eof => "the JSON ends too early",
            _ => "the body is not valid JSON",
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The [`Head`] of a request with these headers.
    fn head_of(headers: &[(&str, &[u8])], traced: bool) -> Head {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        Head::read(&map, traced)
    }

    fn headers(ct: Option<&str>, len: Option<&str>) -> Head {
        let mut sent: Vec<(&str, &[u8])> = Vec::new();
        if let Some(ct) = ct {
            sent.push(("content-type", ct.as_bytes()));
        }
        if let Some(len) = len {
            sent.push(("content-length", len.as_bytes()));
        }
        head_of(&sent, false)
    }

    #[test]
    fn the_head_holds_the_headers_as_sent() {
        let json: &[u8] = b"application/json";
        let h = head_of(
            &[("content-type", json), ("content-length", b" 12 ")],
            false,
        );
        assert_eq!(h.content_type, Header::Present(ContentType::Json));
        assert_eq!(h.content_length, Header::Present(12));
        let h = head_of(&[("Content-Type", b"text/plain; charset=utf-8")], false);
        assert_eq!(
            h.content_type,
            Header::Present(ContentType::Other("text/plain; charset=utf-8".into()))
        );
        assert_eq!(h.content_length, Header::Absent);
        // Not visible ASCII, or not a number: sent, but unreadable.
        let h = head_of(
            &[
                ("content-type", b"application/j\xf8on"),
                ("content-length", b"ten"),
            ],
            false,
        );
        assert_eq!(h.content_type, Header::Unreadable);
        assert_eq!(h.content_length, Header::Unreadable);
        assert_eq!(head_of(&[], true), Head::NONE);
    }

    #[test]
    fn traceparent_is_read_only_when_spans_are_exported() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let sent = [("traceparent", tp.as_bytes())];
        assert_eq!(head_of(&sent, true).traceparent.as_deref(), Some(tp));
        assert_eq!(head_of(&sent, false).traceparent, None);
        assert_eq!(head_of(&[("traceparent", b"\xff")], true).traceparent, None);
    }

    #[test]
    fn unreadable_headers_are_refused_as_missing_or_not_a_number() {
        let e = check_headers(&Head {
            content_type: Header::Unreadable,
            ..headers(None, None)
        })
        .unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message
                .contains("(got a value that is not visible ASCII)"),
            "{}",
            e.message
        );
        let e = check_headers(&headers(None, None)).unwrap_err();
        assert!(e.message.contains("(got none)"), "{}", e.message);
        let e = check_headers(&Head {
            content_length: Header::Unreadable,
            ..headers(Some("application/json"), None)
        })
        .unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("Content-Length"), "{}", e.message);
    }

    #[test]
    fn content_type_must_be_json() {
        assert!(check_headers(&headers(Some("application/json"), None)).is_ok());
        assert!(check_headers(&headers(Some("application/json; charset=utf-8"), None)).is_ok());
        assert!(check_headers(&headers(Some("Application/JSON"), None)).is_ok());
        let e = check_headers(&headers(Some("text/plain"), None)).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "invalid_request")
        );
        assert!(check_headers(&headers(None, None)).is_err());
    }

    #[test]
    fn declared_length_over_the_limit_is_413() {
        let e = check_headers(&headers(Some("application/json"), Some("70000"))).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large")
        );
        assert!(check_headers(&headers(Some("application/json"), Some("65536"))).is_ok());
    }

    #[tokio::test]
    async fn streamed_bodies_are_cut_at_the_limit() {
        let chunks: Vec<Result<bytes::Bytes, warp::Error>> = (0..70)
            .map(|_| Ok(bytes::Bytes::from(vec![b' '; 1024])))
            .collect();
        let e = read_limited(futures_util::stream::iter(chunks))
            .await
            .unwrap_err();
        assert_eq!(e.code, "body_too_large");
        let ok: Vec<Result<bytes::Bytes, warp::Error>> = vec![Ok(bytes::Bytes::from_static(b"{}"))];
        assert_eq!(
            &read_limited(futures_util::stream::iter(ok)).await.unwrap()[..],
            b"{}"
        );
        // In pieces: put together in order, and cut at the limit however it is split.
        let pieces: Vec<Result<bytes::Bytes, warp::Error>> = ["{\"a\"", ":", "1}"]
            .into_iter()
            .map(|p| Ok(bytes::Bytes::from_static(p.as_bytes())))
            .collect();
        assert_eq!(
            &read_limited(futures_util::stream::iter(pieces))
                .await
                .unwrap()[..],
            b"{\"a\":1}"
        );
        let one_big: Vec<Result<bytes::Bytes, warp::Error>> =
            vec![Ok(bytes::Bytes::from(vec![b' '; MAX_BODY + 1]))];
        let e = read_limited(futures_util::stream::iter(one_big))
            .await
            .unwrap_err();
        assert_eq!(e.code, "body_too_large");
        let exactly: Vec<Result<bytes::Bytes, warp::Error>> = vec![
            Ok(bytes::Bytes::from(vec![b' '; MAX_BODY - 1])),
            Ok(bytes::Bytes::from_static(b" ")),
        ];
        let body = read_limited(futures_util::stream::iter(exactly)).await;
        assert_eq!(body.unwrap().len(), MAX_BODY);
        let none: Vec<Result<bytes::Bytes, warp::Error>> = vec![];
        assert!(read_limited(futures_util::stream::iter(none))
            .await
            .unwrap()
            .is_empty());
    }

    fn stream_of(
        sizes: &[usize],
    ) -> Tracked<futures_util::stream::Iter<std::vec::IntoIter<Result<Bytes, warp::Error>>>> {
        let chunks: Vec<Result<Bytes, warp::Error>> = sizes
            .iter()
            .map(|n| Ok(Bytes::from(vec![b' '; *n])))
            .collect();
        Tracked::new(futures_util::stream::iter(chunks))
    }

    fn answer(status: StatusCode) -> warp::reply::Response {
        let mut r = warp::reply::Response::new(Vec::new().into());
        *r.status_mut() = status;
        r
    }

    fn says_close(r: &warp::reply::Response) -> bool {
        r.headers().get(warp::http::header::CONNECTION) == Some(&HeaderValue::from_static("close"))
    }

    #[tokio::test]
    async fn an_early_answer_drains_a_short_body_and_closes_on_a_long_one() {
        // Read to its end by the route: nothing to do.
        let mut body = stream_of(&[10]);
        while body.next().await.is_some() {}
        let mut r = answer(StatusCode::OK);
        settle(&mut body, &mut r).await;
        assert!(!says_close(&r));
        // Unread but short: drained, the connection stays.
        let mut body = stream_of(&[100, 100]);
        let mut r = answer(StatusCode::BAD_REQUEST);
        settle(&mut body, &mut r).await;
        assert!(!says_close(&r));
        assert!(body.next().await.is_none());
        // Longer than the body limit: closed, and said.
        let mut body = stream_of(&[MAX_BODY, 1]);
        let mut r = answer(StatusCode::NOT_FOUND);
        settle(&mut body, &mut r).await;
        assert!(says_close(&r));
        // A 413 that left bytes unread is not drained again.
        let mut body = stream_of(&[1]);
        let mut r = answer(StatusCode::PAYLOAD_TOO_LARGE);
        settle(&mut body, &mut r).await;
        assert!(says_close(&r));
    }

    #[test]
    fn json_errors_say_what_is_wrong() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct T {
            a: u32,
        }
        assert!(parse_json::<T>(b"").unwrap_err().message.contains("empty"));
        assert!(parse_json::<T>(b"{\"a\":")
            .unwrap_err()
            .message
            .contains("ends too early"));
        assert!(parse_json::<T>(b"{\"a\":\"x\"}")
            .unwrap_err()
            .message
            .contains("does not match"));
        assert!(parse_json::<T>(b"nope")
            .unwrap_err()
            .message
            .contains("not valid JSON"));
        assert_eq!(parse_json::<T>(b"{\"a\":3}").unwrap().a, 3);
        #[derive(serde::Deserialize, Debug)]
        struct S<'a> {
            #[serde(borrow)]
            s: std::borrow::Cow<'a, str>,
        }
        // Not UTF-8: serde's message, with where.
        let e = parse_json::<S>(b"{\"s\":\"a\xffb\"}").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        assert!(e.message.contains("column 8"), "{}", e.message);
        // UTF-8 beyond ASCII, borrowed from the body; escapes still unescaped.
        let body = "{\"s\":\"caf\u{e9} \u{1f600}\"}".as_bytes();
        let parsed = parse_json::<S>(body).unwrap();
        assert_eq!(parsed.s, "caf\u{e9} \u{1f600}");
        assert!(matches!(parsed.s, std::borrow::Cow::Borrowed(_)));
        assert_eq!(parse_json::<S>(br#"{"s":"a\u00e9"}"#).unwrap().s, "a\u{e9}");
        assert_eq!(parse_json::<T>(b" \n{\"a\":4}").unwrap().a, 4);
        // Serde alone would take a struct's fields from an array.
        for not_an_object in [&b"[3]"[..], b" [3] ", b"3", b"\"a\"", b"null"] {
            let e = parse_json::<T>(not_an_object).unwrap_err();
            assert!(e.message.contains("must be a JSON object"), "{}", e.message);
        }
    }
}
