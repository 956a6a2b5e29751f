//! The v1 wire contract, exercised over HTTP against the real binary.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{eventually, with_admin, Daemon};
use serde_json::{json, Value};

fn call(tenant: &str, subject: &str, tool: &str) -> Value {
    json!({"tenant": tenant, "subject": subject, "tool": tool, "max_wait_ms": 0})
}

#[test]
fn admit_release_shed_walkthrough() {
    let d = Daemon::start_default();
    let a = d.admit(
        json!({"tenant": "acme", "subject": "acme-bot", "tool": "get_sales", "call_id": "c-17"}),
    );
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.body["admitted"], true);
    assert_eq!(a.body["mode"], "enforce");
    assert_eq!(a.body["waited_ms"], 0);
    assert_eq!(a.body["remaining"], 19);
    assert_eq!(a.body["limit"], 20);
    let reset = a.body["reset_ms"].as_u64().unwrap();
    assert!((400..=500).contains(&reset), "reset_ms {reset}");
    assert_eq!(
        a.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(
        a.header("ratelimit-policy").as_deref(),
        Some("\"subject\";q=20;w=10, \"tenant\";q=50;w=5, \"global\";q=5000;w=1")
    );
    assert_eq!(
        a.header("ratelimit").as_deref(),
        Some("\"subject\";r=19;t=1")
    );
    assert!(a.header("retry-after").is_none());

    let lease = a.body["lease_id"].as_str().unwrap().to_string();
    let r = d.release(&lease);
    assert_eq!((r.status, r.body.clone()), (200, json!({"released": true})));
    let again = d.release(&lease);
    assert_eq!(again.status, 404);
    assert_eq!(again.body["error"], "unknown_lease");
    assert!(again.body["message"].as_str().unwrap().len() > 10);

    // Burn the rest of the subject's burst, then get shed.
    for i in 0..19 {
        let a = d.admit(call("acme", "acme-bot", "get_sales"));
        assert_eq!(a.status, 200);
        let lease = a.body["lease_id"].as_str().unwrap();
        if i == 0 {
            // The same lease id and outcome spelled with JSON escapes are the same strings.
            let escaped = format!("\\u{:04x}{}", lease.as_bytes()[0], &lease[1..]);
            let body = format!(r#"{{"lease_id": "{escaped}", "outcome": "\u006fk"}}"#);
            let r = d.post_raw("/v1/release", "application/json", body.into_bytes());
            assert_eq!((r.status, r.body.clone()), (200, json!({"released": true})));
        } else {
            assert_eq!(d.release(lease).status, 200);
        }
    }
    let s = d.admit(call("acme", "acme-bot", "get_sales"));
    assert_eq!(s.status, 429, "{:?}", s.body);
    assert_eq!(s.body["admitted"], false);
    assert_eq!(s.body["scope"], "subject");
    assert_eq!(s.body["retryable"], true);
    let ms = s.body["retry_after_ms"].as_u64().unwrap();
    assert!((1..=600).contains(&ms), "retry_after_ms {ms}");
    assert_eq!(s.header("retry-after").as_deref(), Some("1"));
    assert_eq!(
        s.header("ratelimit")
            .as_deref()
            .map(|h| h.starts_with("\"subject\";r=0;")),
        Some(true)
    );
    let tr = &s.body["tool_result"];
    assert_eq!(tr["isError"], true);
    assert_eq!(tr["structuredContent"]["scope"], "subject");
    assert_eq!(tr["structuredContent"]["retry_after_ms"].as_u64(), Some(ms));
    let text = tr["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("Wait 1 second"), "{text}");
    assert!(text.contains("same arguments"), "{text}");
    assert!(text.contains("Do not retry sooner"), "{text}");
    assert!(
        !text.contains("acme"),
        "names the tenant or subject: {text}"
    );

    // Another subject of the same tenant is unaffected.
    assert_eq!(d.admit(call("acme", "other-bot", "get_sales")).status, 200);
}

#[test]
fn oversized_is_not_retryable_and_has_no_retry_after() {
    let d = Daemon::start_default();
    let s = d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "cost": 21}));
    assert_eq!(s.status, 429);
    assert_eq!(s.body["scope"], "oversized");
    assert_eq!(s.body["retryable"], false);
    assert_eq!(s.body["retry_after_ms"], 0);
    assert!(s.header("retry-after").is_none());
    let text = s.body["tool_result"]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(text.contains("smaller"), "{text}");
    // and it spent nothing
    let a = d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "cost": 20}));
    assert_eq!(a.status, 200, "{:?}", a.body);
}

#[test]
fn bad_input_is_a_clear_4xx_and_loses_no_state() {
    let d = Daemon::start_default();
    let held = d.admit(call("acme", "bot", "t"));
    assert_eq!(held.status, 200);
    let lease = held.body["lease_id"].as_str().unwrap().to_string();
    let remaining = held.body["remaining"].as_u64().unwrap();

    let long = "x".repeat(129);
    let cases: Vec<(&str, &str, Vec<u8>)> = vec![
        ("/v1/admit", "application/json", b"{not json".to_vec()),
        ("/v1/admit", "application/json", b"".to_vec()),
        ("/v1/admit", "application/json", b"[1,2]".to_vec()),
        ("/v1/admit", "application/json", br#"["acme","bot","t"]"#.to_vec()),
        ("/v1/admit", "text/plain", call("acme", "bot", "t").to_string().into_bytes()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"bot"}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"b\u0007ot","tool":"t"}"#.to_vec()),
        ("/v1/admit", "application/json", json!({"tenant": long, "subject": "s", "tool": "t"}).to_string().into_bytes()),
        ("/v1/admit", "application/json", br#"{"tenant":"","subject":"s","tool":"t"}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"bot","tool":"t","cost":-1}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"bot","tool":"t","cost":0}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"bot","tool":"t","cost":"1"}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"bot","tool":"t","cost":1e999}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":"acme","subject":"bot","tool":"t","max_wait_ms":-5}"#.to_vec()),
        ("/v1/admit", "application/json", br#"{"tenant":7,"subject":"bot","tool":"t"}"#.to_vec()),
        ("/v1/release", "application/json", json!({"lease_id": lease, "outcome": "done"}).to_string().into_bytes()),
        ("/v1/release", "application/json", json!({"lease_id": lease}).to_string().into_bytes()),
        ("/v1/release", "application/json", json!({"lease_id": lease, "outcome": "ok", "retry_after": "soon"}).to_string().into_bytes()),
        ("/v1/release", "application/json", json!({"lease_id": lease, "outcome": "ok", "upstream_status": 1000}).to_string().into_bytes()),
        ("/v1/release", "application/json", json!({"lease_id": lease, "outcome": "ok", "duration_ms": -3}).to_string().into_bytes()),
        ("/v1/release", "application/json", json!([lease, "ok"]).to_string().into_bytes()),
        ("/v1/feedback", "application/json", json!({"tenant": "acme", "upstream": "u", "status": "429"}).to_string().into_bytes()),
        ("/v1/feedback", "application/json", json!(["acme", "u", 429]).to_string().into_bytes()),
        ("/v1/feedback", "application/json", json!({"tenant": "acme", "upstream": "u\n", "status": 429}).to_string().into_bytes()),
        ("/v1/feedback", "application/json", json!({"tenant": "acme", "upstream": "u", "status": 429, "retry_after": "yesterday-ish"}).to_string().into_bytes()),
    ];
    for (path, ct, body) in cases {
        let shown = String::from_utf8_lossy(&body)
            .chars()
            .take(80)
            .collect::<String>();
        let a = d.post_raw(path, ct, body);
        assert_eq!(a.status, 400, "{path} {shown}: {:?}", a.body);
        assert_eq!(a.body["error"], "invalid_request", "{path} {shown}");
        let msg = a.body["message"].as_str().unwrap_or("");
        assert!(msg.len() > 10, "{path} {shown}: message {msg:?}");
    }

    // Bodies over 64 KiB: declared, and streamed without a length.
    let big = format!(
        "{{\"tenant\":\"acme\",\"subject\":\"bot\",\"tool\":\"t\",\"pad\":\"{}\"}}",
        "x".repeat(70_000)
    );
    let a = d.post_raw("/v1/admit", "application/json", big.clone().into_bytes());
    assert_eq!(
        (a.status, a.body["error"].as_str()),
        (413, Some("body_too_large"))
    );
    let chunked = reqwest::blocking::Body::new(std::io::Cursor::new(big.into_bytes()));
    let r = d
        .client
        .post(d.url("/v1/admit"))
        .header("content-type", "application/json")
        .body(chunked)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);

    // Nothing above changed the state: the lease is still live, the bucket untouched.
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(snap.status, 200);
    assert_eq!(snap.body["inflight"], 1);
    assert_eq!(d.release(&lease).status, 200);
    let next = d.admit(call("acme", "bot", "t"));
    assert_eq!(next.status, 200);
    assert!(next.body["remaining"].as_u64().unwrap() + 1 >= remaining);
}

#[test]
fn an_admission_refused_for_a_bad_field_still_carries_its_keys_rate_limit_headers() {
    let d = Daemon::start_default();
    assert_eq!(d.admit(call("acme", "bot", "t1")).status, 200);
    for bad in [
        json!({"cost": 0}),
        json!({"max_wait_ms": -5}),
        json!({"call_id": "a\u{1}b"}),
    ] {
        let mut body = call("acme", "bot", "t1");
        for (k, v) in bad.as_object().unwrap() {
            body[k] = v.clone();
        }
        let a = d.admit(body);
        assert_eq!(a.status, 400, "{bad}: {:?}", a.body);
        assert_eq!(a.body["error"], "invalid_request");
        assert_eq!(
            a.header("ratelimit-policy").as_deref(),
            Some("\"subject\";q=20;w=10, \"tenant\";q=50;w=5, \"global\";q=5000;w=1"),
            "{bad}"
        );
        // The state as it is: the one admission above spent a token, this one nothing.
        assert_eq!(
            a.header("ratelimit").as_deref(),
            Some("\"subject\";r=19;t=1"),
            "{bad}"
        );
    }
    // Without a valid key there is no layer to describe.
    let a = d.post_raw("/v1/admit", "application/json", b"{not json".to_vec());
    assert_eq!(a.status, 400);
    assert!(a.header("ratelimit-policy").is_none());
}

#[test]
fn operations_routes() {
    let d = Daemon::start_default();
    let h = d.get("/healthz");
    assert_eq!(h.status, 200);
    let r = d.get("/readyz");
    assert_eq!((r.status, r.body["ready"].as_bool()), (200, Some(true)));
    let n = d.get("/v1/tenants/nobody");
    assert_eq!(
        (n.status, n.body["error"].as_str()),
        (404, Some("unknown_tenant"))
    );
    let bad = d.get("/v1/tenants/%ff");
    assert_eq!(bad.status, 400);
    let nf = d.get("/v1/nothing");
    assert_eq!(
        (nf.status, nf.body["error"].as_str()),
        (404, Some("not_found"))
    );
    let m = d.get("/v1/admit");
    assert_eq!(m.status, 405);
    assert_eq!(m.header("allow").as_deref(), Some("POST"));
    // HEAD is GET without a body; other methods on a GET route are told which it takes.
    let head = d.client.head(d.url("/healthz")).send().unwrap();
    assert_eq!(head.status().as_u16(), 200);
    assert!(head.bytes().unwrap().is_empty());
    let p = d.post("/healthz", json!({}));
    assert_eq!(p.status, 405);
    assert_eq!(p.header("allow").as_deref(), Some("GET, HEAD"));

    // call_id is optional: empty is the same as absent; a control character is refused.
    let empty = d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "t", "call_id": ""}));
    assert_eq!(empty.status, 200, "{:?}", empty.body);
    let ctl =
        d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "t", "call_id": "c\u{1}"}));
    assert_eq!(
        (ctl.status, ctl.body["error"].as_str()),
        (400, Some("invalid_request"))
    );

    let a = d.admit(call("acme corp", "bot", "t"));
    assert_eq!(a.status, 200);
    let s = d.get("/v1/tenants/acme%20corp");
    assert_eq!(s.status, 200, "{:?}", s.body);
    assert_eq!(s.body["tenant"], "acme corp");
    assert_eq!(s.body["inflight"], 1);
    let buckets = s.body["buckets"].as_array().unwrap();
    let subject = buckets
        .iter()
        .find(|b| b["layer"] == "subject" && b["key"] == "bot")
        .expect("subject bucket");
    assert_eq!(subject["tokens"], 19);
    assert!(buckets.iter().any(|b| b["layer"] == "tenant"));
    assert!(s.body["penalties"].as_array().unwrap().is_empty());

    // Over TCP without an admin token the admin routes are closed.
    let rl = d.post("/v1/admin/reload", json!({}));
    assert_eq!(
        (rl.status, rl.body["error"].as_str()),
        (403, Some("forbidden"))
    );
}

#[test]
fn the_reload_route_refuses_a_body_over_the_limit() {
    let d = Daemon::start(&with_admin(""));
    // The reload route takes no body, but one over 64 KiB is refused as anywhere else.
    let r = d
        .client
        .post(d.url("/v1/admin/reload"))
        .header("content-type", "text/plain")
        .header("authorization", format!("Bearer {}", common::ADMIN_TOKEN))
        .body(vec![b'x'; 70_000])
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let body: Value = r.json().unwrap();
    assert_eq!(body["error"], "body_too_large");
    let rl = d.post_admin("/v1/admin/reload", json!({}));
    assert_eq!(rl.status, 200, "{:?}", rl.body);
}

const UPSTREAMS: &str = r#"
[upstreams.warehouse]
rate = "20/s"
burst = 20

[upstreams.crm]
rate = "20/s"
burst = 20
shared = true

[tools.get_sales]
cost = 2
upstream = "warehouse"
"#;

#[test]
fn upstream_429_puts_the_upstream_in_the_penalty_box() {
    let d = Daemon::start(UPSTREAMS);
    let a = d.admit(call("acme", "bot", "get_sales"));
    assert_eq!(a.status, 200);
    assert!(a
        .header("ratelimit-policy")
        .unwrap()
        .contains("\"tenant_upstream\";q=20;w=1"));
    let r = d.post(
        "/v1/release",
        json!({"lease_id": a.body["lease_id"], "outcome": "upstream_rate_limited", "upstream_status": 429, "retry_after": "3", "duration_ms": 120}),
    );
    assert_eq!(r.status, 200);
    let s = d.admit(call("acme", "bot", "get_sales"));
    assert_eq!(s.status, 429);
    assert_eq!(s.body["scope"], "upstream_penalty");
    let ms = s.body["retry_after_ms"].as_u64().unwrap();
    assert!((2_000..=3_200).contains(&ms), "{ms}");
    let ra = s.header("retry-after").unwrap();
    assert!(ra == "3" || ra == "4", "Retry-After {ra}");
    assert!(s.body["tool_result"]["content"][0]["text"]
        .as_str()
        .unwrap()
        .contains("warehouse"));
    // other tenants keep their own warehouse budget, and other upstreams are fine
    assert_eq!(d.admit(call("globex", "bot", "get_sales")).status, 200);
    assert_eq!(
        d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "other", "max_wait_ms": 0}))
            .status,
        200
    );
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(snap.body["penalties"][0]["upstream"], "warehouse");

    // A shared upstream's penalty, via feedback with an HTTP-date, hits every tenant.
    let when = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(5));
    let f = d.post(
        "/v1/feedback",
        json!({"tenant": "acme", "upstream": "crm", "status": 429, "retry_after": when}),
    );
    assert_eq!((f.status, f.body.clone()), (202, json!({"accepted": true})));
    for tenant in ["acme", "initech"] {
        let s = d.admit(json!({"tenant": tenant, "subject": "x", "tool": "sync", "upstream": "crm", "max_wait_ms": 0}));
        assert_eq!(s.status, 429, "{tenant}");
        assert_eq!(s.body["scope"], "upstream_penalty");
        let ms = s.body["retry_after_ms"].as_u64().unwrap();
        assert!((3_000..=5_300).contains(&ms), "{ms}");
    }
    // Feedback that is not a 429 starts nothing.
    let f = d.post(
        "/v1/feedback",
        json!({"tenant": "umbrella", "upstream": "warehouse", "status": 200}),
    );
    assert_eq!(f.status, 202);
    assert_eq!(d.admit(call("umbrella", "bot", "get_sales")).status, 200);
}

#[test]
fn calls_refused_together_by_a_penalty_or_full_slots_are_told_different_times() {
    // No budget for the upstream: the penalty's hints step by the tenant's refill (60/min: 1 s). Steps
    // this long keep the test about the spread, whatever the requests' own delays on a busy machine:
    // each hint is its slot less the time the daemon answered, so later hints can only be shorter
    // than their slots, never longer.
    let d = Daemon::start(
        "[server]\nmax_wait = \"0ms\"\n[limits.subject]\nconcurrency = 1\n\
         [limits.tenant]\nrate = \"60/min\"\nburst = 1000\n",
    );
    let f = d.post(
        "/v1/feedback",
        json!({"tenant": "acme", "upstream": "w", "status": 429, "retry_after": "30"}),
    );
    assert_eq!(f.status, 202);
    let hints: Vec<u64> = (0..6)
        .map(|i| {
            let mut body = call("acme", &format!("s{i}"), "t");
            body["upstream"] = json!("w");
            let a = d.admit(body);
            assert_eq!(a.body["scope"], "upstream_penalty", "{:?}", a.body);
            a.body["retry_after_ms"].as_u64().unwrap()
        })
        .collect();
    // The first is told the penalty's end (30 s less the time since the feedback), each next one
    // a second after the one before (less the time between their answers), plus up to 100 ms of
    // jitter each. Unstaggered, all six would be within 100 ms of the first.
    assert!((25_000..=30_000).contains(&hints[0]), "{hints:?}");
    for (k, h) in hints.iter().enumerate() {
        assert!(*h <= hints[0] + 1_000 * k as u64 + 100, "{k}: {hints:?}");
    }
    assert!(hints[5] >= hints[0] + 2_500, "not spread: {hints:?}");

    // Concurrency: one slot, held; the refusals are promised the slot in turn, one expected run
    // (1 s before any is reported) and a 50 ms margin apart.
    assert_eq!(d.admit(call("acme", "bot", "t")).status, 200);
    let hints: Vec<u64> = (0..3)
        .map(|_| {
            d.admit(call("acme", "bot", "t")).body["retry_after_ms"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!((1..=1_150).contains(&hints[0]), "{hints:?}");
    for (k, h) in hints.iter().enumerate() {
        assert!(*h <= 1_050 * (k as u64 + 1) + 100, "{k}: {hints:?}");
    }
    assert!(hints[2] >= hints[0] + 1_000, "not spread: {hints:?}");
}

#[test]
fn penalty_ends_when_retry_after_passes() {
    let d = Daemon::start(UPSTREAMS);
    let a = d.admit(call("acme", "bot", "get_sales"));
    let r = d.post(
        "/v1/release",
        json!({"lease_id": a.body["lease_id"], "outcome": "ok", "upstream_status": 429}),
    );
    assert_eq!(r.status, 200);
    // default penalty is one second
    assert_eq!(
        d.admit(call("acme", "bot", "get_sales")).body["scope"],
        "upstream_penalty"
    );
    std::thread::sleep(Duration::from_millis(1_300));
    assert_eq!(d.admit(call("acme", "bot", "get_sales")).status, 200);
}

#[test]
fn a_short_shortfall_is_held_instead_of_shed() {
    let d = Daemon::start("[limits.subject]\nrate = \"10/s\"\nburst = 1\n");
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    let t = Instant::now();
    let a = d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 1000}));
    let took = t.elapsed();
    assert_eq!(a.status, 200, "{:?}", a.body);
    let waited = a.body["waited_ms"].as_u64().unwrap();
    assert!((60..=100).contains(&waited), "waited_ms {waited}");
    assert!(took >= Duration::from_millis(60), "{took:?}");
    // a caller that cannot wait that long is shed
    let s = d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 10}));
    assert_eq!(s.status, 429);
}

#[test]
fn a_held_call_counts_its_reset_from_when_it_is_answered() {
    // Ten tokens a second, burst 10: drained, then a call of 5 is held about half a second. When it
    // is answered the bucket is empty again and full one second later (not one and a half: the hold
    // is already behind it).
    let d = Daemon::start("[limits.subject]\nrate = \"10/s\"\nburst = 10\n");
    assert_eq!(
        d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "cost": 10}))
            .status,
        200
    );
    let a = d
        .admit(json!({"tenant": "t", "subject": "s", "tool": "x", "cost": 5, "max_wait_ms": 2000}));
    assert_eq!(a.status, 200, "{:?}", a.body);
    let waited = a.body["waited_ms"].as_u64().unwrap();
    assert!((50..=520).contains(&waited), "waited_ms {waited}");
    assert_eq!(a.body["remaining"], 0, "{:?}", a.body);
    let reset = a.body["reset_ms"].as_u64().unwrap();
    assert!((900..=1_050).contains(&reset), "reset_ms {reset}");
}

/// Sends an admit on a raw socket and closes it before the answer.
fn admit_and_hang_up(d: &Daemon, body: Value, after: Duration) {
    let mut s = TcpStream::connect(&d.addr).unwrap();
    let body = body.to_string();
    write!(s, "POST /v1/admit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}", body.len(), body).unwrap();
    std::thread::sleep(after);
    s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    let mut buf = [0u8; 16];
    assert!(
        s.read(&mut buf).is_err(),
        "the call was answered before the hang-up; the test needs a longer hold"
    );
    drop(s);
}

#[test]
fn a_caller_that_hangs_up_during_a_hold_spends_nothing() {
    // One token a second, so the second call is held about a second.
    let d =
        Daemon::start("[server]\nmax_wait = \"5s\"\n[limits.subject]\nrate = \"1/s\"\nburst = 1\n");
    let start = Instant::now();
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    admit_and_hang_up(
        &d,
        json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 3000}),
        Duration::from_millis(250),
    );
    // Once the next token is minted (1 s after the first call), it must still be there: the abandoned
    // call gave its reservation back. Had it kept it, this call would be shed until 2 s.
    let due = Duration::from_millis(1_300);
    if let Some(rest) = due.checked_sub(start.elapsed()) {
        std::thread::sleep(rest);
    }
    let a = d.admit(call("t", "s", "x"));
    assert_eq!(
        a.status, 200,
        "the abandoned hold kept its token: {:?}",
        a.body
    );
}

#[test]
fn concurrency_slots_queue_fifo_and_expire_with_the_lease_ttl() {
    let d = Daemon::start("[server]\nlease_ttl = \"1s\"\n[limits.subject]\nconcurrency = 1\n");
    let first = d.admit(call("t", "s", "x"));
    assert_eq!(first.status, 200);
    // no wait allowed: shed by concurrency
    let s = d.admit(call("t", "s", "x"));
    assert_eq!(s.status, 429);
    assert_eq!(s.body["scope"], "concurrency");
    assert!(s.header("retry-after").is_some());

    // a caller willing to wait gets the slot when the first releases
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 2000}))
        });
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            d.release(first.body["lease_id"].as_str().unwrap()).status,
            200
        );
        let a = waiter.join().unwrap();
        assert_eq!(a.status, 200, "{:?}", a.body);
        let waited = a.body["waited_ms"].as_u64().unwrap();
        assert!(waited >= 200, "waited_ms {waited}");
    });

    // the waiter's lease is never released: the TTL frees the slot
    let t = Instant::now();
    let timed_out =
        d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 300}));
    assert_eq!(timed_out.status, 429, "{:?}", timed_out.body);
    assert_eq!(timed_out.body["scope"], "concurrency");
    assert!(t.elapsed() >= Duration::from_millis(250));
    assert!(eventually(Duration::from_secs(4), || d
        .admit(call("t", "s", "x"))
        .status
        == 200));
}

#[test]
fn a_lease_frees_its_slot_at_its_ttl() {
    let d = Daemon::start("[server]\nlease_ttl = \"1s\"\n[limits.subject]\nconcurrency = 1\n");
    // Never released: a call queued for the slot gets it when the lease's second is up (the
    // once-a-second tick could come up to a second later).
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    let queued = d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 2000}));
    assert_eq!(queued.status, 200, "{:?}", queued.body);
    let waited = queued.body["waited_ms"].as_u64().unwrap();
    assert!((700..=1500).contains(&waited), "waited_ms {waited}");
    // And a call that comes once the TTL has passed finds the slot free, whatever the tick does.
    std::thread::sleep(Duration::from_millis(1100));
    let after = d.admit(json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 0}));
    assert_eq!(after.status, 200, "{:?}", after.body);
    // Released after its TTL, a lease is unknown, reaped or not.
    std::thread::sleep(Duration::from_millis(1100));
    let late = d.release(after.body["lease_id"].as_str().unwrap());
    assert_eq!(late.status, 404, "{:?}", late.body);
    assert_eq!(late.body["error"], "unknown_lease");
}

#[test]
fn a_queued_caller_that_hangs_up_leaks_no_slot() {
    let d = Daemon::start("[limits.subject]\nconcurrency = 1\n");
    let first = d.admit(call("t", "s", "x"));
    admit_and_hang_up(
        &d,
        json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 2000}),
        Duration::from_millis(200),
    );
    // Released only once admitd has seen the hang-up: a caller that hangs up at the instant its
    // slot is granted cannot be told from one that hung up just after its answer, and that lease
    // lives to its TTL (on a loaded machine the hang-up can reach admitd after the release).
    assert!(eventually(Duration::from_secs(10), || {
        d.get("/v1/tenants/t").body["waiting"] == 0
    }));
    assert_eq!(
        d.release(first.body["lease_id"].as_str().unwrap()).status,
        200
    );
    assert!(eventually(Duration::from_secs(5), || {
        let a = d.admit(call("t", "s", "x"));
        if a.status == 200 {
            d.release(a.body["lease_id"].as_str().unwrap());
        }
        a.status == 200
    }));
    let snap = d.get("/v1/tenants/t");
    assert_eq!(snap.body["inflight"], 0);
    assert_eq!(snap.body["waiting"], 0);
}

#[test]
fn shadow_mode_admits_everything_and_reports_would_shed() {
    let d = Daemon::start(
        "[server]\nmode = \"shadow\"\n[limits.subject]\nrate = \"1/min\"\nburst = 2\n",
    );
    let mut would = 0;
    for i in 0..5 {
        let a = d.admit(call("t", "s", "x"));
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(a.body["mode"], "shadow");
        if i >= 2 {
            assert_eq!(a.body["would_shed"]["scope"], "subject", "{:?}", a.body);
            assert!(a.body["would_shed"]["retry_after_ms"].as_u64().unwrap() > 0);
            would += 1;
        } else {
            assert!(a.body.get("would_shed").is_none());
        }
        assert_eq!(d.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    }
    assert_eq!(would, 3);
}

#[test]
fn shadow_mode_says_how_long_enforce_mode_would_have_held_a_call() {
    // 1/min, burst 1: enforce mode would hold the second call about a minute (max_wait allows 2).
    let d = Daemon::start(
        "[server]\nmode = \"shadow\"\nmax_wait = \"2m\"\n[limits.subject]\nrate = \"1/min\"\nburst = 1\n",
    );
    // No max_wait_ms: the server's cap applies.
    let body = json!({"tenant": "t", "subject": "s", "tool": "x"});
    let first = d.admit(body.clone());
    assert!(
        first.body.get("would_wait_ms").is_none(),
        "{:?}",
        first.body
    );
    let second = d.admit(body);
    assert_eq!(second.status, 200);
    // Not held: a held call reports the time it was held as waited_ms (and would take a minute).
    assert_eq!(second.body["waited_ms"], 0, "{:?}", second.body);
    let would = second.body["would_wait_ms"].as_u64().unwrap();
    assert!((50_000..=60_000).contains(&would), "{:?}", second.body);
    assert!(second.body.get("would_shed").is_none());
}

const RELOAD_BEFORE: &str = "[limits.subject]\nrate = \"1/h\"\nburst = 5\n";
const RELOAD_AFTER: &str = "[limits.subject]\nrate = \"1/h\"\nburst = 10\n";

fn subject_tokens(d: &Daemon) -> u64 {
    let s = d.get("/v1/tenants/t");
    s.body["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["layer"] == "subject")
        .unwrap()["tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn reload_swaps_policy_without_resetting_state() {
    let d = Daemon::start(&with_admin(RELOAD_BEFORE));
    let lease = d.admit(call("t", "s", "x")).body["lease_id"]
        .as_str()
        .unwrap()
        .to_string();
    for _ in 0..2 {
        assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    }
    assert_eq!(subject_tokens(&d), 2);

    d.rewrite_config(&with_admin(RELOAD_AFTER));
    let r = d.post_admin("/v1/admin/reload", json!({}));
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["reloaded"], true);
    // The daemon runs with --listen, which a reload keeps: nothing needs a restart.
    assert_eq!(r.body["restart_required"], json!([]));
    // three tokens are still missing, now out of ten
    assert_eq!(subject_tokens(&d), 7);
    assert_eq!(
        d.release(&lease).status,
        200,
        "the lease survived the reload"
    );

    // A broken file is refused with FILE:LINE and the running config stays.
    d.rewrite_config("[limits.subject]\nrate = \"5/mins\"\n");
    let bad = d.post_admin("/v1/admin/reload", json!({}));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.body["error"], "invalid_config");
    let msg = bad.body["message"].as_str().unwrap();
    assert!(
        msg.starts_with(&format!("{}:2: ", d.config_path())),
        "{msg}"
    );
    assert_eq!(subject_tokens(&d), 7);
    let a = d.admit(call("t", "s", "x"));
    assert_eq!(a.body["limit"], 10, "old config kept: {:?}", a.body);
}

/// `restart_required` names the keys whose new values differ from what the process runs with, so a
/// change undone by the next reload needs no restart.
#[test]
fn a_reload_asks_for_a_restart_only_while_the_file_differs_from_the_running_process() {
    let d = Daemon::start(&with_admin("[server]\nworkers = 1\n"));
    let reload = |text: &str| {
        d.rewrite_config(&with_admin(text));
        let r = d.post_admin("/v1/admin/reload", json!({}));
        assert_eq!(r.status, 200, "{:?}", r.body);
        r.body["restart_required"].clone()
    };
    assert_eq!(reload("[server]\nworkers = 2\n"), json!(["server.workers"]));
    assert_eq!(reload("[server]\nworkers = 2\n"), json!(["server.workers"]));
    assert_eq!(reload("[server]\nworkers = 1\n"), json!([]));
    // --listen keeps the address the daemon listens on, whatever the file says.
    assert_eq!(
        reload("[server]\nworkers = 1\nlisten = \"127.0.0.1:1\"\n"),
        json!([])
    );
}

#[cfg(unix)]
#[test]
fn sigterm_answers_the_call_in_flight_then_exits() {
    // One token a second: the second call is held about a second, and SIGTERM arrives during the hold.
    let mut d =
        Daemon::start("[server]\nmax_wait = \"5s\"\n[limits.subject]\nrate = \"1/s\"\nburst = 1\n");
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    let held = {
        let (client, url) = (d.client.clone(), d.url("/v1/admit"));
        std::thread::spawn(move || {
            client
                .post(url)
                .json(&json!({"tenant": "t", "subject": "s", "tool": "x", "max_wait_ms": 3000}))
                .send()
                .map(|r| r.status().as_u16())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    d.signal("TERM");
    // The held call is decided as if nothing happened: admitted once its token is minted.
    assert_eq!(
        held.join().unwrap().expect("the held call was answered"),
        200
    );
    // ... and the daemon then exits on its own, cleanly, well before the 5 s it allows for answers.
    let status = loop {
        if let Some(status) = d.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(8),
            "admitd still runs {:?} after SIGTERM",
            sent.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
    assert!(d.logged("shutting down", Duration::from_secs(2)));
}

#[test]
fn a_daemon_out_of_file_descriptors_says_so_and_recovers() {
    // Few enough descriptors that a few dozen idle connections use up the rest.
    let d = Daemon::start_with_fd_limit("", 64);
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    // Open connections (each answered once, then kept idle) until one is no longer taken: the
    // kernel still completes the handshake, but admitd cannot accept it.
    let mut idle = Vec::new();
    let mut stalled = None;
    for _ in 0..100 {
        let mut s = TcpStream::connect(&d.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        write!(s, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => idle.push(s),
            _ => {
                stalled = Some(s);
                break;
            }
        }
    }
    let stalled = stalled.expect("100 connections never exhausted 64 descriptors");
    assert!(d.logged("cannot accept a connection", Duration::from_secs(5)));
    // Closing the idle connections frees descriptors: the daemon accepts again by itself, the
    // connection that waited in the backlog included, and admits as before.
    drop(idle);
    let mut stalled = stalled;
    stalled
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 512];
    let n = stalled
        .read(&mut buf)
        .expect("the waiting connection was served");
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
}

#[test]
fn sighup_reloads_the_config() {
    let d = Daemon::start(RELOAD_BEFORE);
    assert_eq!(d.admit(call("t", "s", "x")).body["limit"], 5);
    d.rewrite_config(RELOAD_AFTER);
    d.signal("HUP");
    assert!(eventually(Duration::from_secs(5), || d
        .admit(call("t", "s", "x"))
        .body["limit"]
        == 10));
    assert!(d.logged("SIGHUP: config reloaded", Duration::from_secs(5)));
}

#[test]
fn daily_quota_and_plans_apply_per_tenant() {
    let d = Daemon::start(
        "[limits.subject]\ndaily_quota = 3\n[plans.free.subject]\nrate = \"30/min\"\nburst = 5\n[tenants.globex]\nplan = \"free\"\n",
    );
    for _ in 0..3 {
        assert_eq!(d.admit(call("acme", "s", "x")).status, 200);
    }
    let q = d.admit(call("acme", "s", "x"));
    assert_eq!(q.status, 429);
    assert_eq!(q.body["scope"], "daily_quota");
    let ms = q.body["retry_after_ms"].as_u64().unwrap();
    assert!(ms <= 86_400_000 + 100 && ms > 0, "{ms}");
    let g = d.admit(call("globex", "s", "x"));
    assert_eq!(g.body["limit"], 5, "{:?}", g.body);
    assert!(g
        .header("ratelimit-policy")
        .unwrap()
        .starts_with("\"subject\";q=5;w=10"));
}

#[test]
fn a_plan_can_give_its_tenants_a_global_bucket_of_their_own() {
    // The free plan's tenants share 2 calls of global burst (refilling once an hour); others pass
    // [limits.global].
    let d = Daemon::start(
        "[limits.global]\nrate = \"1/h\"\nburst = 100\n[plans.free.global]\nburst = 2\n\
         [tenants.globex]\nplan = \"free\"\n[tenants.initech]\nplan = \"free\"\n",
    );
    let admitted_under = |tenant: &str, subject: &str, global: &str| {
        let a = d.admit(call(tenant, subject, "x"));
        assert_eq!(a.status, 200, "{:?}", a.body);
        let policy = a.header("ratelimit-policy").unwrap();
        assert!(policy.contains(global), "{tenant}: {policy}");
    };
    admitted_under("globex", "a", "\"global\";q=2;w=7200");
    admitted_under("initech", "b", "\"global\";q=2;w=7200");
    let third = d.admit(call("globex", "c", "x"));
    assert_eq!(third.status, 429);
    assert_eq!(third.body["scope"], "global");
    admitted_under("acme", "d", "\"global\";q=100;w=360000");
}

#[test]
fn idle_tenants_are_dropped_once_their_state_is_back_at_rest() {
    let d = Daemon::start("[server]\nidle_ttl = \"1s\"\n");
    for t in 0..10 {
        let a = d.admit(call(&format!("t{t}"), "bot", "x"));
        assert_eq!(a.status, 200);
        assert_eq!(d.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    }
    assert_eq!(d.get("/v1/tenants/t3").status, 200);
    let actors = |d: &Daemon| {
        common::metric(
            d.get("/metrics").body.as_str().unwrap_or(""),
            "admitd_tenant_actors",
        )
    };
    assert!(
        eventually(Duration::from_secs(3), || actors(&d) == Some(10.0)),
        "{:?}",
        actors(&d)
    );
    // One token refills in half a second; a second later the tenants have been idle for idle_ttl.
    assert!(
        eventually(Duration::from_secs(8), || actors(&d) == Some(0.0)),
        "actors left: {:?}",
        actors(&d)
    );
    let gone = d.get("/v1/tenants/t3");
    assert_eq!(
        (gone.status, gone.body["error"].as_str()),
        (404, Some("unknown_tenant"))
    );
    // A tenant that comes back starts from a full bucket, as if nothing had been dropped.
    let back = d.admit(call("t3", "bot", "x"));
    assert_eq!(
        (back.status, back.body["remaining"].as_u64()),
        (200, Some(19))
    );
}

#[test]
fn a_tenant_with_a_live_lease_is_never_dropped() {
    let d = Daemon::start("[server]\nidle_ttl = \"1s\"\n");
    let a = d.admit(call("keep", "bot", "x"));
    std::thread::sleep(Duration::from_millis(2_500));
    let snap = d.get("/v1/tenants/keep");
    assert_eq!(
        (snap.status, snap.body["inflight"].as_u64()),
        (200, Some(1)),
        "{:?}",
        snap.body
    );
    assert_eq!(
        d.release(a.body["lease_id"].as_str().unwrap()).status,
        200,
        "the lease survived"
    );
}

#[test]
fn telemetry_can_be_turned_off() {
    let d = Daemon::start("[telemetry]\nenabled = false\n");
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
    let m = d.get("/metrics");
    assert_eq!(
        (m.status, m.body["error"].as_str()),
        (404, Some("not_found"))
    );
    assert_eq!(d.get("/v1/alerts").status, 404);
}

#[test]
fn names_written_with_json_escapes_are_the_same_names() {
    let d = Daemon::start_default();
    let plain = d.admit(call("acme-prod", "bot/1", "get_sales"));
    assert_eq!(plain.status, 200, "{:?}", plain.body);
    // The same three names, spelled with escapes: they must spend from the same subject bucket.
    let escaped = d.post_raw(
        "/v1/admit",
        "application/json",
        br#"{"tenant":"acme\u002dprod","subject":"bot\/1","tool":"get\u005fsales","max_wait_ms":0}"#
            .to_vec(),
    );
    assert_eq!(escaped.status, 200, "{:?}", escaped.body);
    assert_eq!(
        escaped.body["remaining"].as_u64(),
        Some(plain.body["remaining"].as_u64().unwrap() - 1),
        "{:?}",
        escaped.body
    );
    let t = d.get("/v1/tenants/acme-prod");
    assert_eq!(t.status, 200, "{:?}", t.body);
    let lease = escaped.body["lease_id"].as_str().unwrap();
    assert_eq!(d.release(lease).status, 200);
}

/// Sends `request` on a fresh connection and reads until the daemon closes it.
fn raw_exchange(d: &Daemon, request: &[u8]) -> String {
    let mut s = TcpStream::connect(&d.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    String::from_utf8_lossy(&got).into_owned()
}

/// Requests the HTTP server cannot parse never reach the routes, but their answers still carry the
/// contract's error body, and the daemon serves on.
#[test]
fn unparsable_requests_get_the_json_error_body_too() {
    let d = Daemon::start_default();
    let many_headers: String = (0..120).map(|i| format!("X-H{i}: 1\r\n")).collect();
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (
            b"POST /v1/admit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: abc\r\n\r\n{}".to_vec(),
            "400",
            "invalid_request",
        ),
        (
            b"POST /v1/admit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\n{}".to_vec(),
            "400",
            "invalid_request",
        ),
        (b"GARBAGE\r\n\r\n".to_vec(), "400", "invalid_request"),
        (
            format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n").into_bytes(),
            "431",
            "headers_too_large",
        ),
    ];
    for (request, status, code) in cases {
        let answer = raw_exchange(&d, &request);
        let (head, body) = answer.split_once("\r\n\r\n").expect(&answer);
        assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{answer}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{answer}"
        );
        let body: Value = serde_json::from_str(body).expect(&answer);
        assert_eq!(body["error"], code, "{answer}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(body.as_object().unwrap().len(), 2, "{answer}");
    }
    assert_eq!(d.get("/healthz").status, 200);
    assert_eq!(d.admit(call("t", "s", "x")).status, 200);
}
