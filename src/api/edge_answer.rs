//! The JSON-RPC shape of an edge refusal, and `POST /v1/edge/refusal`, the route that answers for a
//! call the gateway refused.
//!
//! A refusal decided at the gateway must reach the MCP client as the answer an MCP server would
//! have given; a bare HTTP 429 is an error the SDKs turn into "Server returned an error response",
//! and the model never learns how long to wait. So every refusal of the edge check is also written
//! as a [`Refusal`], and [`answer`] turns it and the refused request's body into JSON-RPC:
//!
//! - a rate-limited `tools/call` gets a JSON-RPC *result*, the contract's `CallToolResult` with
//!   `isError: true` (the wait in words and in `structuredContent`), under the request's own `id`;
//! - any other rate-limited request gets a JSON-RPC *error*: the MCP specification puts only tool
//!   failures in results, and defines no rate-limit code, so the code is [`RATE_LIMITED`], in the
//!   band the specification leaves to implementations (-32000 to -32019, of which the SDKs use
//!   -32000 and -32001 for themselves);
//! - a missing or invalid credential gets a JSON-RPC error under HTTP 401;
//! - a request the check refused for its MCP headers gets the specification's own codes
//!   (`HeaderMismatch`, `UnsupportedProtocolVersion`) under HTTP 400;
//! - a body that is not one JSON-RPC message gets `-32700` (not JSON) or `-32600` (a batch, or not
//!   a JSON-RPC request) under HTTP 400.
//!
//! How the refusal reaches this module depends on the gateway. Envoy's `ext_authz` can send the
//! request's body with the check, so the check answers in JSON-RPC at once (`edge.rs`). nginx's
//! `auth_request` cannot: its check sees headers only, and passes the refusal on in the
//! `X-Admitd-Answer` header of its answer; nginx's `error_page` then hands the original request,
//! body and all, with that header, to `POST /v1/edge/refusal`, which answers for it. The header is
//! the whole refusal, so the route keeps no state and spends nothing: any replica answers, and a
//! caller who reaches the route directly only hears back what it sent.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use warp::http::{HeaderMap, HeaderValue, StatusCode};
use warp::reply::Response;

use super::error::ApiError;

/// The route nginx's `error_page` hands a refused request to.
pub const PATH: &str = "/v1/edge/refusal";
/// The header of an edge check's refusal that carries the [`Refusal`] (ASCII JSON).
pub const ANSWER_HEADER: &str = "x-admitd-answer";

/// JSON-RPC error code of a rate-limited request other than `tools/call` (implementation-defined).
pub const RATE_LIMITED: i64 = -32010;
/// JSON-RPC error code of a request without a valid credential (implementation-defined).
pub const UNAUTHORIZED: i64 = -32011;
/// The MCP specification's code for missing or malformed `Mcp-Method` / `Mcp-Name` headers.
pub const HEADER_MISMATCH: i64 = -32020;
/// The MCP specification's code for a protocol version the server does not support.
pub const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const INTERNAL_ERROR: i64 = -32603;

/// One refusal of the edge check, whatever its cause: what the JSON-RPC answer is made from.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Refusal {
    /// The check's HTTP status: 429, 401, 400, or 503 when the check could not decide.
    pub status: u16,
    /// A machine code: `rate_limited`, `too_many_failed_authentications`, `unauthorized`,
    /// `header_mismatch`, `unsupported_protocol_version`, `unavailable`.
    pub error: String,
    /// One sentence for a person, or for the model.
    pub message: String,
    /// The wait, when waiting helps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// The contract's `CallToolResult` of a shed call (`POST /v1/admit`'s `tool_result`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_result: Option<Value>,
}

impl Refusal {
    pub fn new(status: StatusCode, error: &str, message: impl Into<String>) -> Self {
        Refusal {
            status: status.as_u16(),
            error: error.to_string(),
            message: message.into(),
            retry_after_ms: None,
            tool_result: None,
        }
    }

    /// The refusal as a header value: JSON with every character outside ASCII escaped (`\uXXXX`),
    /// so any upstream or tool name survives the trip through the gateway's header variables.
    pub fn header_value(&self) -> Option<HeaderValue> {
        let text = serde_json::to_string(self).ok()?;
        let mut out = String::with_capacity(text.len());
        for c in text.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
        HeaderValue::from_str(&out).ok()
    }

    /// The refusal a gateway passed on in [`ANSWER_HEADER`].
    pub fn from_headers(h: &HeaderMap) -> Result<Self, ApiError> {
        let v = h.get(ANSWER_HEADER).ok_or_else(|| {
            ApiError::invalid(format!(
                "{PATH} answers for a request the edge check refused: it needs the check's {ANSWER_HEADER} header, which the gateway passes on"
            ))
        })?;
        serde_json::from_slice(v.as_bytes()).map_err(|e| {
            ApiError::invalid(format!(
                "the {ANSWER_HEADER} header is not an edge check's refusal: {e}"
            ))
        })
    }

    /// A refusal that a wait cures (rate limits and the failed-authentication limit alike).
    fn is_wait(&self) -> bool {
        self.status == 429
    }

    /// The `CallToolResult` for the model: the shed call's own, else one made from the message.
    fn tool_result(&self) -> Value {
        if let Some(r) = &self.tool_result {
            return r.clone();
        }
        let retry_after_ms = self.retry_after_ms.unwrap_or(0);
        json!({
            "content": [{"type": "text", "text": self.message}],
            "structuredContent": {
                "error": self.error,
                "retry_after_ms": retry_after_ms,
                "retryable": retry_after_ms > 0,
            },
            "isError": true,
        })
    }

    fn error_data(&self) -> Value {
        let mut data = json!({"error": self.error});
        if let Some(ms) = self.retry_after_ms {
            data["retry_after_ms"] = ms.into();
        }
        if let Some(scope) = self
            .tool_result
            .as_ref()
            .and_then(|r| r.pointer("/structuredContent/scope"))
        {
            data["scope"] = scope.clone();
        }
        data
    }

    /// The text the model should read: the tool result's when there is one.
    fn text(&self) -> &str {
        self.tool_result
            .as_ref()
            .and_then(|r| r.pointer("/content/0/text"))
            .and_then(Value::as_str)
            .unwrap_or(&self.message)
    }
}

/// What the refused request's body holds, as far as the answer needs to know.
#[derive(Debug, PartialEq)]
enum Message {
    /// A request: its id (a string or a number, as it came) and method.
    Request { id: Value, method: String },
    /// A notification, a response, or no body at all: nothing to answer under an id.
    NoId,
    /// Not one JSON-RPC message: the error code and why.
    Invalid(i64, String),
}

fn classify(body: &[u8]) -> Message {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Message::NoId;
    }
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return Message::Invalid(PARSE_ERROR, format!("the request body is not JSON: {e}"))
        }
    };
    let Value::Object(o) = v else {
        let why = if v.is_array() {
            "the request body is a JSON-RPC batch; MCP sends one message per request"
        } else {
            "the request body is not a JSON-RPC message (a JSON object)"
        };
        return Message::Invalid(INVALID_REQUEST, why.to_string());
    };
    if o.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Message::Invalid(
            INVALID_REQUEST,
            "the request body is not a JSON-RPC 2.0 message: \"jsonrpc\": \"2.0\" is missing"
                .to_string(),
        );
    }
    let Some(method) = o.get("method") else {
        // A response the client sends back to the server: it has no answer of its own.
        return Message::NoId;
    };
    let Some(method) = method.as_str() else {
        return Message::Invalid(INVALID_REQUEST, "\"method\" must be a string".to_string());
    };
    match o.get("id") {
        None => Message::NoId,
        Some(id @ (Value::String(_) | Value::Number(_))) => Message::Request {
            id: id.clone(),
            method: method.to_string(),
        },
        Some(_) => Message::Invalid(
            INVALID_REQUEST,
            "a request's \"id\" must be a string or a number".to_string(),
        ),
    }
}

/// The JSON-RPC answer to a refused request: its HTTP status and body.
#[derive(Debug, PartialEq)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Value,
}

fn error(status: StatusCode, id: Value, code: i64, message: &str, data: Option<Value>) -> Answer {
    let mut e = json!({"code": code, "message": message});
    if let Some(d) = data {
        e["data"] = d;
    }
    Answer {
        status,
        body: json!({"jsonrpc": "2.0", "id": id, "error": e}),
    }
}

/// The first MCP revision whose results carry `resultType` (its clients refuse a result without).
const RESULT_TYPE_SINCE: &str = "2026-07-28";

/// The answer an MCP server would give to the request in `body` had it refused it as `refusal`
/// says. Requests are answered under their own id (HTTP 200, as a server answers a request);
/// what has no id to answer under gets a JSON-RPC error with `"id": null` and the refusal's status.
/// `version` is the request's `MCP-Protocol-Version`: the result is written in that revision.
pub fn answer(refusal: &Refusal, body: &[u8], version: Option<&str>) -> Answer {
    // Only the statuses the check refuses with; anything else in a header is not the check's.
    let status = match refusal.status {
        400 | 401 | 404 | 429 | 503 => {
            StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
        }
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    let message = classify(body);
    // A credential is checked before a body is read, on a server as here.
    if status == StatusCode::UNAUTHORIZED {
        let id = match message {
            Message::Request { id, .. } => id,
            _ => Value::Null,
        };
        return error(
            status,
            id,
            UNAUTHORIZED,
            &refusal.message,
            Some(json!({"error": refusal.error})),
        );
    }
    let (id, method) = match message {
        Message::Invalid(code, why) => {
            return error(StatusCode::BAD_REQUEST, Value::Null, code, &why, None)
        }
        Message::NoId => (Value::Null, None),
        Message::Request { id, method } => (id, Some(method)),
    };
    let code = match refusal.error.as_str() {
        _ if refusal.is_wait() => RATE_LIMITED,
        "header_mismatch" => HEADER_MISMATCH,
        "unsupported_protocol_version" => UNSUPPORTED_PROTOCOL_VERSION,
        _ if status == StatusCode::BAD_REQUEST => INVALID_REQUEST,
        _ => INTERNAL_ERROR,
    };
    match method.as_deref() {
        Some("tools/call") if refusal.is_wait() => {
            let mut result = refusal.tool_result();
            // Revisions are dates (YYYY-MM-DD): they compare as strings.
            if version.is_some_and(|v| v.trim() >= RESULT_TYPE_SINCE) {
                result["resultType"] = "complete".into();
            }
            Answer {
                status: StatusCode::OK,
                body: json!({"jsonrpc": "2.0", "id": id, "result": result}),
            }
        }
        Some(_) if refusal.is_wait() => error(
            StatusCode::OK,
            id,
            code,
            refusal.text(),
            Some(refusal.error_data()),
        ),
        _ => error(status, id, code, refusal.text(), Some(refusal.error_data())),
    }
}

/// Renders an [`Answer`] as an HTTP response.
pub fn render(a: &Answer) -> Response {
    super::json(a.status, &a.body)
}

/// `POST /v1/edge/refusal` (any method: nginx hands the original request on as it came).
pub fn refusal_route(headers: Option<&HeaderMap>, body: &[u8]) -> Result<Response, ApiError> {
    let empty = HeaderMap::new();
    let headers = headers.unwrap_or(&empty);
    let refusal = Refusal::from_headers(headers)?;
    let version = headers
        .get("mcp-protocol-version")
        .and_then(|v| v.to_str().ok());
    Ok(render(&answer(&refusal, body, version)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shed() -> Refusal {
        Refusal {
            status: 429,
            error: "rate_limited".into(),
            message: "Rate limited by the warehouse quota. Wait 4 seconds.".into(),
            retry_after_ms: Some(4000),
            tool_result: Some(json!({
                "content": [{"type": "text", "text": "Rate limited by the warehouse quota. Wait 4 seconds."}],
                "structuredContent": {"error": "rate_limited", "scope": "tenant_upstream", "retry_after_ms": 4000, "retryable": true},
                "isError": true
            })),
        }
    }

    fn call(id: &str) -> String {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"get_sales","arguments":{{}}}}}}"#
        )
    }

    #[test]
    fn a_refused_tool_call_is_a_tool_result_under_its_own_id_of_any_type() {
        for id in ["7", "0", "-3", "1.5", "\"abc\"", "\"\"", "\"ü-1\""] {
            let a = answer(&shed(), call(id).as_bytes(), None);
            assert_eq!(a.status, StatusCode::OK, "{id}");
            let want: Value = serde_json::from_str(id).unwrap();
            assert_eq!(a.body["id"], want, "{id}");
            assert_eq!(a.body["jsonrpc"], "2.0");
            assert_eq!(a.body["result"], shed().tool_result.unwrap());
            assert!(a.body.get("error").is_none());
        }
    }

    #[test]
    fn from_2026_07_28_on_the_result_says_it_is_complete() {
        for (version, tagged) in [
            (None, false),
            (Some("2025-11-25"), false),
            (Some("2026-07-28"), true),
            (Some("2027-01-01"), true),
        ] {
            let a = answer(&shed(), call("1").as_bytes(), version);
            let tag = a.body["result"].get("resultType");
            assert_eq!(tag.is_some(), tagged, "{version:?}");
            if tagged {
                assert_eq!(tag.unwrap(), "complete");
            }
        }
    }

    #[test]
    fn the_method_is_read_from_the_body_wherever_the_id_is() {
        // The TypeScript SDK writes the id last.
        let body = r#"{"method":"tools/call","params":{"name":"x"},"jsonrpc":"2.0","id":42}"#;
        let a = answer(&shed(), body.as_bytes(), None);
        assert_eq!(a.body["id"], 42);
        assert_eq!(a.body["result"]["isError"], true);
    }

    #[test]
    fn a_failed_authentication_limit_on_a_tool_call_is_a_tool_result_with_the_wait() {
        let r = Refusal {
            retry_after_ms: Some(6000),
            ..Refusal::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_failed_authentications",
                "too many failed authentications from this address; retry in 6 seconds",
            )
        };
        let a = answer(&r, call("\"c1\"").as_bytes(), None);
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body["id"], "c1");
        let result = &a.body["result"];
        assert_eq!(result["isError"], true);
        assert!(result["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("retry in 6 seconds"));
        assert_eq!(result["structuredContent"]["retry_after_ms"], 6000);
        assert_eq!(result["structuredContent"]["retryable"], true);
    }

    #[test]
    fn other_rate_limited_methods_get_a_json_rpc_error_with_the_wait() {
        let body = r#"{"jsonrpc":"2.0","id":"r-9","method":"resources/read","params":{"uri":"x"}}"#;
        let a = answer(&shed(), body.as_bytes(), None);
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body["id"], "r-9");
        assert!(a.body.get("result").is_none());
        assert_eq!(a.body["error"]["code"], RATE_LIMITED);
        assert!(a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Wait 4 seconds"));
        assert_eq!(a.body["error"]["data"]["retry_after_ms"], 4000);
        assert_eq!(a.body["error"]["data"]["scope"], "tenant_upstream");
    }

    #[test]
    fn no_credential_is_a_json_rpc_401_whatever_the_body() {
        let r = Refusal::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "no valid credential: send Authorization: Bearer <key or JWT>, or X-Api-Key: <key>",
        );
        for (body, id) in [
            (call("5"), json!(5)),
            (String::new(), Value::Null),
            ("not json".to_string(), Value::Null),
            ("[1,2]".to_string(), Value::Null),
        ] {
            let a = answer(&r, body.as_bytes(), None);
            assert_eq!(a.status, StatusCode::UNAUTHORIZED);
            assert_eq!(a.body["jsonrpc"], "2.0");
            assert_eq!(a.body["id"], id, "{body}");
            assert_eq!(a.body["error"]["code"], UNAUTHORIZED);
            assert!(a.body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("no valid credential"));
        }
    }

    #[test]
    fn a_body_that_is_not_json_rpc_gets_a_clear_json_rpc_error() {
        for (body, code, says) in [
            ("{\"jsonrpc\": \"2.0\", ", PARSE_ERROR, "not JSON"),
            (
                "[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\"}]",
                INVALID_REQUEST,
                "batch",
            ),
            ("\"tools/call\"", INVALID_REQUEST, "JSON object"),
            (
                "{\"id\":1,\"method\":\"tools/call\"}",
                INVALID_REQUEST,
                "\"jsonrpc\": \"2.0\"",
            ),
            (
                "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":7}",
                INVALID_REQUEST,
                "method",
            ),
            (
                "{\"jsonrpc\":\"2.0\",\"id\":null,\"method\":\"tools/call\"}",
                INVALID_REQUEST,
                "string or a number",
            ),
            (
                "{\"jsonrpc\":\"2.0\",\"id\":[1],\"method\":\"tools/call\"}",
                INVALID_REQUEST,
                "string or a number",
            ),
            (
                "{\"jsonrpc\":\"2.0\",\"id\":true,\"method\":\"tools/call\"}",
                INVALID_REQUEST,
                "string or a number",
            ),
        ] {
            let a = answer(&shed(), body.as_bytes(), None);
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(a.body["id"], Value::Null, "{body}");
            assert_eq!(a.body["error"]["code"], code, "{body}");
            let m = a.body["error"]["message"].as_str().unwrap();
            assert!(m.contains(says), "{body}: {m}");
        }
    }

    #[test]
    fn a_notification_or_an_empty_body_is_answered_without_an_id() {
        for body in [
            "",
            "{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}",
        ] {
            let a = answer(&shed(), body.as_bytes(), None);
            assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(a.body["id"], Value::Null);
            assert_eq!(a.body["error"]["code"], RATE_LIMITED);
        }
    }

    #[test]
    fn header_refusals_use_the_specification_codes() {
        for (error, code) in [
            ("header_mismatch", HEADER_MISMATCH),
            ("unsupported_protocol_version", UNSUPPORTED_PROTOCOL_VERSION),
            ("invalid_request", INVALID_REQUEST),
        ] {
            let r = Refusal::new(StatusCode::BAD_REQUEST, error, "Mcp-Name is missing");
            let a = answer(&r, call("3").as_bytes(), None);
            assert_eq!(a.status, StatusCode::BAD_REQUEST);
            assert_eq!(a.body["id"], 3);
            assert_eq!(a.body["error"]["code"], code);
            assert_eq!(a.body["error"]["message"], "Mcp-Name is missing");
        }
        let r = Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "retry");
        let a = answer(&r, call("3").as_bytes(), None);
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(a.body["error"]["code"], INTERNAL_ERROR);
        // A status the check never refuses with is not passed on.
        for status in [200, 302, 418, 999] {
            let r = Refusal {
                status,
                ..Refusal::new(StatusCode::OK, "x", "y")
            };
            assert_eq!(
                answer(&r, call("3").as_bytes(), None).status,
                StatusCode::SERVICE_UNAVAILABLE
            );
        }
    }

    #[test]
    fn the_refusal_goes_through_a_header_and_back_unchanged() {
        let mut r = shed();
        r.message = "Rate limited by the Lagerhaus-Kontingent — ü 🚚".into();
        r.tool_result.as_mut().unwrap()["content"][0]["text"] = r.message.clone().into();
        let v = r.header_value().unwrap();
        assert!(v.as_bytes().iter().all(|b| (0x20..0x7f).contains(b)));
        let mut h = HeaderMap::new();
        h.insert(ANSWER_HEADER, v);
        assert_eq!(Refusal::from_headers(&h).unwrap(), r);
    }

    #[test]
    fn the_route_without_a_refusal_says_what_it_needs() {
        let e = refusal_route(None, call("1").as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains(ANSWER_HEADER));
        let mut h = HeaderMap::new();
        h.insert(ANSWER_HEADER, HeaderValue::from_static("{\"status\":"));
        let e = refusal_route(Some(&h), b"").unwrap_err();
        assert!(
            e.message.contains("not an edge check's refusal"),
            "{}",
            e.message
        );
    }
}
