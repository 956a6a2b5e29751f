//! Black-box: `GET /v1/edge/check`, asked as a gateway asks it (the original request's headers,
//! and with Envoy's `with_request_body` its body), and `POST /v1/edge/refusal`. The same route behind a real nginx is tested in `tests/nginx_edge.rs`.

mod common;

use std::process::Command;

use common::{Answer, Daemon};
use serde_json::Value;
use sha2::{Digest, Sha256};

const KEY: &str = "acme-edge-key-7f3a9c";
const VERSION: &str = "2026-07-28";

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/edge/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Subjects get three calls (one more a minute); failed authentications three per address.
fn config(jwt: &str) -> String {
    format!(
        r#"
[limits.subject]
rate = "1/min"
burst = 3
[edge]
client_address_header = "x-forwarded-for"
failed_auth_rate = "1/min"
failed_auth_burst = 3
[[edge.api_keys]]
sha256 = "{}"
tenant = "acme"
subject = "acme-bot"
{jwt}
"#,
        sha256_hex(KEY)
    )
}

fn check(d: &Daemon, headers: &[(&str, &str)]) -> Answer {
    let mut r = d.client.get(d.url("/v1/edge/check"));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().expect("request");
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().unwrap_or_default();
    Answer {
        status,
        headers,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
    }
}

/// A `tools/call` of `tool` with this credential header, from `client`.
fn call<'a>(auth: (&'a str, &'a str), tool: &'a str, client: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        auth,
        ("mcp-method", "tools/call"),
        ("mcp-name", tool),
        ("mcp-protocol-version", VERSION),
        ("x-forwarded-for", client),
    ]
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

#[test]
fn an_api_key_is_admitted_on_its_tools_budget_and_holds_no_slot() {
    let d = Daemon::start_logging(&config(""), "debug");
    let auth = bearer(KEY);
    for i in 0..3 {
        let a = check(&d, &call(("authorization", &auth), "search", "203.0.113.1"));
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(a.header("x-admitd-tenant").as_deref(), Some("acme"));
        assert_eq!(a.header("x-admitd-subject").as_deref(), Some("acme-bot"));
        assert!(a
            .header("ratelimit-policy")
            .is_some_and(|p| p.contains("\"subject\";q=3")));
        assert_eq!(
            a.header("ratelimit").as_deref(),
            Some(&*format!("\"subject\";r={};t={}", 2 - i, 60 * (i + 1)))
        );
        assert_eq!(a.body["admitted"], true);
        assert!(a.body.get("lease_id").is_none(), "{:?}", a.body);
    }
    // X-Api-Key works as well, and spends the same budget: it is empty now.
    let a = check(&d, &call(("x-api-key", KEY), "search", "203.0.113.1"));
    assert_eq!(a.status, 429, "{:?}", a.body);
    assert_eq!(a.body["scope"], "subject");
    let retry: u64 = a.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert!(a.header("ratelimit-policy").is_some());
    assert_eq!(
        a.header("ratelimit").as_deref().map(|r| &r[..16]),
        Some("\"subject\";r=0;t=")
    );
    // Methods other than tools/call are let through without spending.
    let mut list = call(("x-api-key", KEY), "search", "203.0.113.1");
    list[1] = ("mcp-method", "tools/list");
    let a = check(&d, &list);
    assert_eq!((a.status, &a.body["metered"]), (200, &Value::Bool(false)));
    assert!(a.header("ratelimit").is_none());
    // Edge admissions hold no concurrency slot: the gateway could never release it.
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(snap.body["inflight"], 0, "{:?}", snap.body);
    assert_eq!(snap.body["leases"], 0, "{:?}", snap.body);
    // The in-server check shares the budget: it is spent there too.
    let a = d.admit(serde_json::json!({"tenant": "acme", "subject": "acme-bot", "tool": "search"}));
    assert_eq!(a.status, 429);
    // Edge answers are counted by result.
    let m = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        common::metric(&m, "admitd_edge_checks_total{result=\"admitted\"}"),
        Some(3.0),
        "{m}"
    );
    assert_eq!(
        common::metric(&m, "admitd_edge_checks_total{result=\"shed\"}"),
        Some(1.0)
    );
    // The key never reaches the log.
    assert!(!d.log_lines().iter().any(|l| l.contains(KEY)));
}

#[test]
fn failed_authentications_are_limited_per_address_and_spend_no_tenants_budget() {
    let d = Daemon::start_logging(&config(""), "debug");
    let attacker = "198.51.100.9, 10.0.0.1";
    for _ in 0..3 {
        let a = check(&d, &call(("x-api-key", "guess-1234"), "search", attacker));
        assert_eq!(a.status, 401, "{:?}", a.body);
        assert_eq!(a.body["error"], "unauthorized");
        assert!(a.header("www-authenticate").is_some());
    }
    for creds in [("x-api-key", "guess-5678"), ("x-api-key", KEY)] {
        let a = check(&d, &call(creds, "search", attacker));
        assert_eq!(a.status, 429, "{:?}", a.body);
        assert_eq!(a.body["error"], "too_many_failed_authentications");
        let retry: u64 = a.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
    }
    // A malformed Authorization header is a failure too; another address is not affected, and
    // the tenant's budget is whole.
    let a = check(
        &d,
        &call(
            ("authorization", "Basic Zm9vOmJhcg=="),
            "search",
            "192.0.2.4",
        ),
    );
    assert_eq!(a.status, 401);
    let a = check(&d, &call(("x-api-key", KEY), "search", "192.0.2.4"));
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(
        a.header("ratelimit").as_deref(),
        Some("\"subject\";r=2;t=60")
    );
    assert!(!d
        .log_lines()
        .iter()
        .any(|l| l.contains("guess-1234") || l.contains("Zm9vOmJhcg")));
}

#[test]
fn the_protocol_version_and_the_mirrored_headers_are_required() {
    let d = Daemon::start(&config(""));
    let mut h = call(("x-api-key", KEY), "search", "192.0.2.1");
    h.retain(|(k, _)| *k != "mcp-protocol-version");
    let a = check(&d, &h);
    assert_eq!(a.status, 400);
    let m = a.body["message"].as_str().unwrap();
    assert!(
        m.contains("MCP-Protocol-Version is missing") && m.contains(VERSION),
        "{m}"
    );
    h.push(("mcp-protocol-version", "2025-06-18"));
    let a = check(&d, &h);
    assert_eq!(a.status, 400);
    assert!(a.body["message"]
        .as_str()
        .unwrap()
        .contains("\"2025-06-18\" is older than 2026-07-28"));
    // Newer revisions pass.
    h.pop();
    h.push(("mcp-protocol-version", "2027-01-15"));
    assert_eq!(check(&d, &h).status, 200);
    // tools/call without the tool's name.
    let mut h = call(("x-api-key", KEY), "search", "192.0.2.1");
    h.retain(|(k, _)| *k != "mcp-name");
    let a = check(&d, &h);
    assert_eq!(a.status, 400);
    assert!(a.body["message"]
        .as_str()
        .unwrap()
        .contains("Mcp-Name is missing"));
    // A POST (as nginx says in X-Original-Method) without Mcp-Method; a GET needs none.
    let mut h = call(("x-api-key", KEY), "search", "192.0.2.1");
    h.retain(|(k, _)| *k != "mcp-method");
    h.push(("x-original-method", "POST"));
    let a = check(&d, &h);
    assert_eq!(a.status, 400);
    assert!(a.body["message"]
        .as_str()
        .unwrap()
        .contains("Mcp-Method is missing"));
    h.pop();
    h.push(("x-original-method", "GET"));
    let a = check(&d, &h);
    assert_eq!((a.status, &a.body["metered"]), (200, &Value::Bool(false)));
    // Envoy appends the original path, and sends the original method.
    let r = d
        .client
        .post(d.url("/v1/edge/check/mcp"))
        .header("x-api-key", KEY)
        .header("mcp-method", "tools/call")
        .header("mcp-name", "search")
        .header("mcp-protocol-version", VERSION)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

#[test]
fn without_an_edge_section_the_route_is_off() {
    let d = Daemon::start_default();
    let a = check(&d, &call(("x-api-key", KEY), "search", "192.0.2.1"));
    assert_eq!(a.status, 404);
    assert!(a.body["message"].as_str().unwrap().contains("[edge]"));
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

fn claims(aud: &str, exp: u64) -> Value {
    serde_json::json!({"iss": "https://auth.example", "aud": aud, "exp": exp,
                       "sub": "agent-7", "org": "globex"})
}

/// A daemon taking JWTs signed with `algorithm`, with its key settings.
fn jwt_daemon(algorithm: &str, keys: &str) -> Daemon {
    Daemon::start_logging(
        &config(&format!(
            "[edge.jwt]\nalgorithm = \"{algorithm}\"\n{keys}\nissuer = \"https://auth.example\"\n\
             audience = \"mcp.example\"\ntenant_claim = \"org\"\n"
        )),
        "debug",
    )
}

fn jwt_cases(d: &Daemon, sign: impl Fn(&Value) -> String) {
    let good = sign(&claims("mcp.example", now() + 300));
    let a = check(
        d,
        &call(("authorization", &bearer(&good)), "search", "192.0.2.1"),
    );
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.header("x-admitd-tenant").as_deref(), Some("globex"));
    assert_eq!(a.header("x-admitd-subject").as_deref(), Some("agent-7"));
    for bad in [
        sign(&claims("another-audience", now() + 300)),
        sign(&claims("mcp.example", now() - 600)),
    ] {
        let a = check(
            d,
            &call(("authorization", &bearer(&bad)), "search", "192.0.2.2"),
        );
        assert_eq!(a.status, 401, "{:?}", a.body);
    }
    // A token whose signature was tampered with.
    let mut forged = good.clone();
    let last = forged.pop().unwrap();
    forged.push(if last == 'A' { 'B' } else { 'A' });
    let a = check(
        d,
        &call(("authorization", &bearer(&forged)), "search", "192.0.2.3"),
    );
    assert_eq!(a.status, 401);
    assert!(!d.log_lines().iter().any(|l| l.contains(&good[..20])));
}

fn sign_with(
    alg: jsonwebtoken::Algorithm,
    kid: &str,
    key: jsonwebtoken::EncodingKey,
) -> impl Fn(&Value) -> String {
    let kid = kid.to_string();
    move |claims: &Value| {
        let mut header = jsonwebtoken::Header::new(alg);
        header.kid = Some(kid.clone());
        jsonwebtoken::encode(&header, claims, &key).unwrap()
    }
}

#[test]
fn rs256_and_es256_tokens_are_checked_against_the_jwks_file() {
    let pem = |f: &str| std::fs::read(fixture(f)).unwrap();
    let d = jwt_daemon(
        "RS256",
        &format!("jwks_file = {:?}", fixture("rs256-jwks.json")),
    );
    let key = jsonwebtoken::EncodingKey::from_rsa_pem(&pem("rs256-private.pem")).unwrap();
    jwt_cases(&d, sign_with(jsonwebtoken::Algorithm::RS256, "rsa-1", key));
    let d = jwt_daemon(
        "ES256",
        &format!("jwks_file = {:?}", fixture("es256-jwks.json")),
    );
    let key = jsonwebtoken::EncodingKey::from_ec_pem(&pem("es256-private.pem")).unwrap();
    jwt_cases(
        &d,
        sign_with(jsonwebtoken::Algorithm::ES256, "ec-1", key.clone()),
    );
    // A key id the JWKS does not hold.
    let t =
        sign_with(jsonwebtoken::Algorithm::ES256, "ec-9", key)(&claims("mcp.example", now() + 60));
    assert_eq!(
        check(
            &d,
            &call(("authorization", &bearer(&t)), "search", "192.0.2.5")
        )
        .status,
        401
    );
}

#[test]
fn hs256_tokens_are_checked_against_the_secret_file() {
    let dir = tempfile::tempdir().unwrap();
    let secret = b"edge-test-secret-of-forty-bytes-0123456";
    let path = dir.path().join("jwt.key");
    std::fs::write(&path, [&secret[..], b"\n"].concat()).unwrap();
    let d = jwt_daemon(
        "HS256",
        &format!("secret_file = {:?}", path.display().to_string()),
    );
    let key = jsonwebtoken::EncodingKey::from_secret(secret);
    jwt_cases(&d, sign_with(jsonwebtoken::Algorithm::HS256, "any", key));
    // A token signed with a JWKS key's algorithm is not accepted by an HS256 daemon.
    let pem = std::fs::read(fixture("rs256-private.pem")).unwrap();
    let rsa = jsonwebtoken::EncodingKey::from_rsa_pem(&pem).unwrap();
    let t =
        sign_with(jsonwebtoken::Algorithm::RS256, "rsa-1", rsa)(&claims("mcp.example", now() + 60));
    assert_eq!(
        check(
            &d,
            &call(("authorization", &bearer(&t)), "search", "192.0.2.6")
        )
        .status,
        401
    );
}

#[test]
fn check_names_the_line_of_an_edge_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admitd.toml");
    std::fs::write(
        &path,
        "[edge]\nmin_protocol_version = \"2026-07-28\"\n[[edge.api_keys]]\nsha256 = \"the-key-itself\"\ntenant = \"acme\"\nsubject = \"bot\"\n",
    )
    .unwrap();
    let out = Command::new(common::bin())
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!(
            "{}:4: edge.api_keys.sha256 must be 64 hex digits",
            path.display()
        )),
        "{err}"
    );
    assert!(!err.contains("the-key-itself"), "{err}");
}

/// As Envoy's `with_request_body` asks: a POST to the check with the original body.
fn check_with_body(d: &Daemon, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut r = d.client.post(d.url("/v1/edge/check/mcp"));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.body(body.to_string()).send().expect("request");
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().unwrap_or_default();
    Answer {
        status,
        headers,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
    }
}

#[test]
fn with_the_body_a_refusal_is_the_json_rpc_answer_and_without_it_travels_in_a_header() {
    let d = Daemon::start(&config(""));
    let key = ("x-api-key", KEY);
    let body = |id: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"search"}}}}"#
        )
    };
    for _ in 0..3 {
        let a = check_with_body(&d, &call(key, "search", "10.1.0.1"), &body("1"));
        assert_eq!(a.status, 200, "{}", a.body);
    }
    // Over the burst: 429 (the gateway must deny) whose body is the JSON-RPC result for the model.
    let a = check_with_body(&d, &call(key, "search", "10.1.0.1"), &body("\"q-4\""));
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["jsonrpc"], "2.0");
    assert_eq!(a.body["id"], "q-4");
    assert_eq!(a.body["result"]["isError"], true);
    let retry: u64 = a.headers["retry-after"].to_str().unwrap().parse().unwrap();
    let text = a.body["result"]["content"][0]["text"].as_str().unwrap();
    assert!(text.contains(&format!("Wait {retry} second")), "{text}");
    assert!(a.headers.get("ratelimit").is_some());
    assert!(a.headers.get("x-admitd-answer").is_none());
    // Cut by the gateway: the id may be lost, so the plain refusal.
    let mut cut = call(key, "search", "10.1.0.1");
    cut.push(("x-envoy-auth-partial-body", "true"));
    let a = check_with_body(&d, &cut, &body("5")[..30]);
    assert_eq!(a.status, 429);
    assert_eq!(a.body["admitted"], false);
    // No credential, with a body: a JSON-RPC 401 under the request's id.
    let a = check_with_body(
        &d,
        &call(("x-api-key", "nope"), "search", "10.1.0.2"),
        &body("6"),
    );
    assert_eq!(a.status, 401);
    assert_eq!(a.body["id"], 6);
    assert!(a.body["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("no valid credential"));
    assert!(a.headers.get("www-authenticate").is_some());

    // Without a body (nginx): the plain answer, and the refusal in X-Admitd-Answer, which
    // POST /v1/edge/refusal turns into the same JSON-RPC answer.
    let a = check(&d, &call(key, "search", "10.1.0.1"));
    assert_eq!(a.status, 429);
    assert_eq!(a.body["admitted"], false);
    let refusal = a.headers["x-admitd-answer"].clone();
    let v: Value = serde_json::from_slice(refusal.as_bytes()).unwrap();
    assert_eq!(v["status"], 429);
    assert_eq!(v["tool_result"], a.body["tool_result"]);
    let r = d
        .client
        .post(d.url("/v1/edge/refusal"))
        .header("x-admitd-answer", refusal)
        .body(body("7"))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["id"], 7);
    assert_eq!(v["result"], a.body["tool_result"]);
    // The route without a refusal says what it needs.
    let r = d
        .client
        .post(d.url("/v1/edge/refusal"))
        .body(body("8"))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().unwrap();
    assert!(v["message"].as_str().unwrap().contains("x-admitd-answer"));
}
