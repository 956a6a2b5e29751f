//! Telemetry seen from outside: the Prometheus exposition, OTLP spans arriving at a real receiver,
//! the refusal log, and the shed-ratio alerts (with an Alertmanager push).

mod common;

use std::time::{Duration, Instant};

use common::{eventually, metric, Daemon, GrpcRecorder, Recorder};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

fn call(tenant: &str, subject: &str, tool: &str) -> serde_json::Value {
    json!({"tenant": tenant, "subject": subject, "tool": tool, "max_wait_ms": 0})
}

#[test]
fn metrics_cover_decisions_upstreams_leases_and_cap_subject_labels() {
    let d = Daemon::start(
        "[server]\nlease_ttl = \"1s\"\n[limits.subject]\nrate = \"1/h\"\nburst = 2\n[telemetry]\nmax_subjects_per_tenant = 3\n\
         [upstreams.warehouse]\nrate = \"100/s\"\nburst = 100\n",
    );
    // s0 admitted twice then shed; s1..s9 once each; the cap keeps 3 subject names.
    let mut leases = Vec::new();
    for i in 0..10 {
        let n = if i == 0 { 3 } else { 1 };
        for _ in 0..n {
            let a = d.admit(json!({"tenant": "acme", "subject": format!("s{i}"), "tool": "search", "upstream": "warehouse", "max_wait_ms": 0}));
            if a.status == 200 {
                leases.push(a.body["lease_id"].as_str().unwrap().to_string());
            }
        }
    }
    assert_eq!(leases.len(), 11);
    // release most: one with an upstream 429 and a duration, the rest ok; leave one to expire
    let r = d.post("/v1/release", json!({"lease_id": leases[0], "outcome": "upstream_rate_limited", "retry_after": "1", "duration_ms": 250}));
    assert_eq!(r.status, 200);
    for l in &leases[1..10] {
        assert_eq!(
            d.post(
                "/v1/release",
                json!({"lease_id": l, "outcome": "ok", "upstream_status": 200, "duration_ms": 40})
            )
            .status,
            200
        );
    }
    assert_eq!(
        d.post(
            "/v1/feedback",
            json!({"tenant": "acme", "upstream": "warehouse", "status": 503})
        )
        .status,
        202
    );

    let scrape = || d.get("/metrics").body.as_str().unwrap_or("").to_string();
    let mut text = String::new();
    // The expiry is counted and the in-flight gauge set from the same tick of the tenant actor, but
    // the telemetry thread records them one after the other: a scrape can fall in between.
    assert!(
        eventually(Duration::from_secs(6), || {
            text = scrape();
            metric(
                &text,
                r#"admitd_lease_expiries_total{tenant="acme",subject="__other__",tool="search",upstream="warehouse"}"#,
            ) == Some(1.0)
                && metric(&text, r#"admitd_inflight{tenant="acme"}"#) == Some(0.0)
        }),
        "lease expiry not counted, or the expired lease still in flight:\n{text}"
    );
    let m = |s: &str| metric(&text, s);
    assert_eq!(
        m(
            r#"admitd_admissions_total{tenant="acme",subject="s0",tool="search",upstream="warehouse",decision="admitted",scope="none"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        m(
            r#"admitd_admissions_total{tenant="acme",subject="s0",tool="search",upstream="warehouse",decision="shed",scope="subject"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        m(
            r#"admitd_admissions_total{tenant="acme",subject="__other__",tool="search",upstream="warehouse",decision="admitted",scope="none"}"#
        ),
        Some(7.0)
    );
    for s in 3..10 {
        assert!(
            !text.contains(&format!("subject=\"s{s}\"")),
            "s{s} should fold into __other__"
        );
    }
    assert_eq!(
        m(r#"admitd_upstream_responses_total{tenant="acme",upstream="warehouse",status="429"}"#),
        Some(1.0)
    );
    assert_eq!(
        m(r#"admitd_upstream_responses_total{tenant="acme",upstream="warehouse",status="200"}"#),
        Some(9.0)
    );
    assert_eq!(
        m(r#"admitd_upstream_responses_total{tenant="acme",upstream="warehouse",status="503"}"#),
        Some(1.0)
    );
    assert_eq!(
        m(
            r#"admitd_tool_duration_seconds_count{tenant="acme",tool="search",upstream="warehouse"}"#
        ),
        Some(10.0)
    );
    assert_eq!(
        m(r#"admitd_retry_after_seconds_count{tenant="acme",scope="subject"}"#),
        Some(1.0)
    );
    assert_eq!(
        m(r#"admitd_admission_wait_seconds_count{tenant="acme",tool="search"}"#),
        Some(11.0)
    );
    assert_eq!(m("admitd_decision_duration_seconds_count"), Some(12.0));
    assert_eq!(m("admitd_telemetry_events_dropped_total"), Some(0.0));
    assert_eq!(m(r#"admitd_build_info{version="0.1.0"}"#), Some(1.0));
    assert_eq!(m("admitd_tenant_actors"), Some(1.0));
    assert_eq!(m(r#"admitd_inflight{tenant="acme"}"#), Some(0.0));
    let util = m(r#"admitd_bucket_utilization{tenant="acme",layer="subject"}"#).unwrap();
    assert!(util > 0.9, "s0 used its whole burst: {util}");
    assert!(text.contains("# TYPE admitd_admission_wait_seconds histogram"));
    assert!(
        text.contains("admitd_upstream_penalty_seconds{tenant=\"acme\",upstream=\"warehouse\"}")
    );

    // The refusal log line for the shed, with the subject hashed.
    let log = d.log_lines();
    let line = log
        .iter()
        .find(|l| l.contains("\"admitd::refusal\"") && l.contains("call refused"))
        .expect("refusal log line");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["fields"]["scope"], "subject");
    assert_eq!(v["fields"]["tool"], "search");
    assert_eq!(v["fields"]["upstream"], "warehouse");
    assert!(v["fields"]["subject_hash"].as_str().unwrap().len() == 16);
    assert!(
        !line.contains("\"s0\""),
        "the subject is logged in clear: {line}"
    );
}

#[test]
fn the_first_subjects_to_call_keep_their_names_under_the_cap() {
    // Calls one after another, each answered before the next: whichever worker thread answers
    // which call, the subjects named are the first two to call, in every tenant.
    let d = Daemon::start("[telemetry]\nmax_subjects_per_tenant = 2\n");
    let tenants = 24;
    for t in 0..tenants {
        for s in 1..=4 {
            let a = d.admit(call(&format!("card{t}"), &format!("s{s}"), "search"));
            assert_eq!(a.status, 200);
            d.release(a.body["lease_id"].as_str().unwrap());
        }
    }
    let series = |t: usize, subject: &str| {
        format!(
            r#"admitd_admissions_total{{tenant="card{t}",subject="{subject}",tool="search",upstream="none",decision="admitted",scope="none"}}"#
        )
    };
    let mut text = String::new();
    assert!(
        eventually(Duration::from_secs(2), || {
            text = d.get("/metrics").body.as_str().unwrap().to_string();
            // Every call counted: the last one of each tenant is its second __other__.
            (0..tenants).all(|t| metric(&text, &series(t, "__other__")) == Some(2.0))
        }),
        "{text}"
    );
    for t in 0..tenants {
        assert_eq!(
            metric(&text, &series(t, "s1")),
            Some(1.0),
            "card{t}:\n{text}"
        );
        assert_eq!(
            metric(&text, &series(t, "s2")),
            Some(1.0),
            "card{t}:\n{text}"
        );
        assert_eq!(
            metric(&text, &series(t, "__other__")),
            Some(2.0),
            "card{t}:\n{text}"
        );
        let named = text
            .lines()
            .filter(|l| l.starts_with(&format!("admitd_admissions_total{{tenant=\"card{t}\",")))
            .count();
        assert_eq!(named, 3, "card{t}: s1, s2 and __other__ only:\n{text}");
    }
}

#[test]
fn total_series_stay_bounded_however_many_subjects_appear() {
    let d = Daemon::start(
        "[telemetry]\nmax_subjects_per_tenant = 5\n[limits.subject]\nconcurrency = 1000\n[limits.tenant]\nrate = \"10000/s\"\nburst = 10000\n",
    );
    for i in 0..300 {
        let a = d.admit(call("acme", &format!("agent-{i}"), "search"));
        assert_eq!(a.status, 200);
        d.release(a.body["lease_id"].as_str().unwrap());
    }
    // Workers hand telemetry over in batches at least every 10 ms: wait for the last one.
    let other = r#"admitd_admissions_total{tenant="acme",subject="__other__",tool="search",upstream="none",decision="admitted",scope="none"}"#;
    let mut text = String::new();
    assert!(
        eventually(Duration::from_secs(2), || {
            text = d.get("/metrics").body.as_str().unwrap().to_string();
            metric(&text, other) == Some(295.0)
        }),
        "{text}"
    );
    let series = text
        .lines()
        .filter(|l| l.starts_with("admitd_admissions_total{"))
        .count();
    assert_eq!(series, 6, "5 named subjects + __other__:\n{text}");
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn attr_str(attrs: &[KeyValue], key: &str) -> Option<String> {
    match attr(attrs, key) {
        Some(any_value::Value::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn attr_int(attrs: &[KeyValue], key: &str) -> Option<i64> {
    match attr(attrs, key) {
        Some(any_value::Value::IntValue(i)) => Some(*i),
        _ => None,
    }
}

fn received_spans(r: &Recorder) -> Vec<(Span, Option<String>)> {
    spans_of(r.bodies("/v1/traces").iter().map(|body| {
        ExportTraceServiceRequest::decode(body.as_slice()).expect("a valid OTLP protobuf body")
    }))
}

/// The spans in OTLP requests, each with its resource's `service.name`.
fn spans_of(
    requests: impl Iterator<Item = ExportTraceServiceRequest>,
) -> Vec<(Span, Option<String>)> {
    let mut out = Vec::new();
    for req in requests {
        for rs in req.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|res| attr_str(&res.attributes, "service.name"));
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push((s, service.clone()));
                }
            }
        }
    }
    out
}

#[test]
fn admission_spans_reach_an_otlp_receiver() {
    let collector = Recorder::start();
    spans_arrive_with_their_attributes(
        &format!("endpoint = \"http://{}/v1/traces\"", collector.addr),
        || received_spans(&collector),
    );
}

#[test]
fn spans_travel_as_otlp_http_json_too() {
    let collector = Recorder::start();
    spans_arrive_with_their_attributes(
        &format!(
            "endpoint = \"http://{}/v1/traces\"\nprotocol = \"http/json\"",
            collector.addr
        ),
        || {
            spans_of(collector.bodies("/v1/traces").iter().map(|body| {
                serde_json::from_slice::<ExportTraceServiceRequest>(body)
                    .expect("a valid OTLP JSON body")
            }))
        },
    );
}

#[test]
fn spans_travel_as_otlp_grpc_too() {
    let collector = GrpcRecorder::start();
    spans_arrive_with_their_attributes(
        &format!(
            "endpoint = \"http://{}\"\nprotocol = \"grpc\"",
            collector.addr
        ),
        || {
            let requests = collector.requests.lock().unwrap().clone();
            spans_of(requests.into_iter().map(|(path, message)| {
                assert_eq!(
                    path,
                    "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
                );
                ExportTraceServiceRequest::decode(message.as_slice())
                    .expect("a valid OTLP protobuf message")
            }))
        },
    );
}

/// Runs an admitted call (child of a caller's trace, released with a 429) and a shed call through a
/// daemon exporting spans with `otlp` (the `[telemetry.otlp]` lines besides `service_name`), and checks
/// what `received` says arrived.
fn spans_arrive_with_their_attributes(
    otlp: &str,
    received: impl Fn() -> Vec<(Span, Option<String>)>,
) {
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 1\n[telemetry.otlp]\n{otlp}\nservice_name = \"admitd-test\"\n"
    ));
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let r = d
        .client
        .post(d.url("/v1/admit"))
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{trace_id}-{parent}-01"))
        .body(json!({"tenant": "acme", "subject": "acme-bot", "tool": "get_sales", "upstream": "warehouse", "call_id": "c-17"}).to_string())
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let lease = r.json::<serde_json::Value>().unwrap()["lease_id"]
        .as_str()
        .unwrap()
        .to_string();
    let shed = d.admit(call("acme", "acme-bot", "get_sales"));
    assert_eq!(shed.status, 429);
    let rel = d.post("/v1/release", json!({"lease_id": lease, "outcome": "upstream_rate_limited", "upstream_status": 429, "retry_after": "2"}));
    assert_eq!(rel.status, 200);

    let mut spans = Vec::new();
    assert!(
        eventually(Duration::from_secs(10), || {
            spans = received();
            let named = |name: &str| spans.iter().filter(|(s, _)| s.name == name).count();
            named("admitd admit get_sales") >= 2 && named("admitd release get_sales") >= 1
        }),
        "spans did not arrive: {:?}",
        spans.iter().map(|s| &s.0.name).collect::<Vec<_>>()
    );
    let (admitted, service) = spans
        .iter()
        .find(|(s, _)| attr_str(&s.attributes, "admitd.decision").as_deref() == Some("admitted"))
        .expect("the admitted call's admission span");
    assert_eq!(service.as_deref(), Some("admitd-test"));
    let a = &admitted.attributes;
    assert_eq!(
        hex(&admitted.trace_id),
        trace_id,
        "child of the caller's traceparent"
    );
    assert_eq!(hex(&admitted.parent_span_id), parent);
    assert_eq!(
        attr_str(a, "gen_ai.operation.name").as_deref(),
        Some("execute_tool")
    );
    assert_eq!(
        attr_str(a, "gen_ai.tool.name").as_deref(),
        Some("get_sales")
    );
    assert_eq!(
        attr_str(a, "mcp.method.name").as_deref(),
        Some("tools/call")
    );
    assert_eq!(attr_str(a, "gen_ai.tool.call.id").as_deref(), Some("c-17"));
    assert_eq!(attr_str(a, "admitd.tenant").as_deref(), Some("acme"));
    assert_eq!(attr_str(a, "admitd.upstream").as_deref(), Some("warehouse"));
    assert_eq!(attr_str(a, "admitd.scope").as_deref(), Some("none"));
    let hash = attr_str(a, "admitd.subject_hash").unwrap();
    assert_eq!(hash.len(), 16);
    assert_ne!(hash, "acme-bot");
    assert_eq!(attr_int(a, "admitd.waited_ms"), Some(0));
    assert!(admitted.end_time_unix_nano >= admitted.start_time_unix_nano);
    // The release: a span of its own beside the admission under the caller's span, linked to it.
    let (release, _) = spans
        .iter()
        .find(|(s, _)| s.name == "admitd release get_sales")
        .expect("the release span");
    assert_eq!(hex(&release.trace_id), trace_id);
    assert_eq!(hex(&release.parent_span_id), parent);
    assert_eq!(release.links.len(), 1, "{:?}", release.links);
    assert_eq!(release.links[0].trace_id, admitted.trace_id);
    assert_eq!(release.links[0].span_id, admitted.span_id);
    let r = &release.attributes;
    assert_eq!(
        attr_str(r, "gen_ai.operation.name").as_deref(),
        Some("execute_tool")
    );
    assert_eq!(
        attr_str(r, "gen_ai.tool.name").as_deref(),
        Some("get_sales")
    );
    assert_eq!(attr_str(r, "gen_ai.tool.call.id").as_deref(), Some("c-17"));
    assert_eq!(
        attr_str(r, "admitd.outcome").as_deref(),
        Some("upstream_rate_limited")
    );
    assert_eq!(attr_int(r, "http.response.status_code"), Some(429));
    assert_eq!(attr_str(r, "admitd.retry_after").as_deref(), Some("2"));
    assert!(release.start_time_unix_nano >= admitted.end_time_unix_nano);
    // Dated by the request's own wall-clock start, not left at the epoch.
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    assert!(
        admitted.start_time_unix_nano > now_ns - 3_600_000_000_000
            && admitted.start_time_unix_nano <= now_ns,
        "start {} against now {now_ns}",
        admitted.start_time_unix_nano
    );

    let (shed_span, _) = spans
        .iter()
        .find(|(s, _)| attr_str(&s.attributes, "admitd.decision").as_deref() == Some("shed"))
        .expect("the shed call's span");
    assert_eq!(
        attr_str(&shed_span.attributes, "admitd.scope").as_deref(),
        Some("subject")
    );
    assert!(attr_int(&shed_span.attributes, "admitd.retry_after_ms").unwrap() > 0);
    assert_eq!(
        shed_span.status.as_ref().map(|s| s.code),
        Some(2),
        "error status"
    );
    assert_ne!(
        hex(&shed_span.trace_id),
        trace_id,
        "no traceparent: a new trace"
    );
}

#[test]
fn admission_spans_arrive_within_the_export_interval_whether_or_not_the_calls_are_released() {
    let collector = Recorder::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nconcurrency = 10\n[telemetry.otlp]\nendpoint = \"http://{}/v1/traces\"\n",
        collector.addr
    ));
    let ids = ["held-1", "held-2", "held-3"];
    for id in ids {
        let a =
            d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "search", "call_id": id}));
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let answered = Instant::now();
    // Leases live 5 minutes and none is released: the spans must not wait for either. The span
    // actor hands spans over every 500 ms; allow for a busy machine on top.
    let arrived = |spans: &[(Span, Option<String>)]| {
        ids.iter()
            .filter(|id| {
                spans.iter().any(|(s, _)| {
                    s.name == "admitd admit search"
                        && attr_str(&s.attributes, "gen_ai.tool.call.id").as_deref() == Some(**id)
                })
            })
            .count()
    };
    let mut spans = Vec::new();
    assert!(
        eventually(Duration::from_secs(3), || {
            spans = received_spans(&collector);
            arrived(&spans) == 3
        }),
        "{} of 3 admission spans arrived: {:?}",
        arrived(&spans),
        spans.iter().map(|s| &s.0.name).collect::<Vec<_>>()
    );
    println!(
        "3 admission spans arrived {:?} after the last answer",
        answered.elapsed()
    );
    assert!(
        spans.iter().all(|(s, _)| s.name != "admitd release search"),
        "nothing was released"
    );
}

#[test]
fn a_release_without_a_caller_trace_is_a_child_of_its_admission_span() {
    let collector = Recorder::start();
    let d = Daemon::start(&format!(
        "[telemetry.otlp]\nendpoint = \"http://{}/v1/traces\"\n",
        collector.addr
    ));
    let a =
        d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "search", "upstream": "crm"}));
    assert_eq!(a.status, 200);
    let rel = d.post("/v1/release", json!({"lease_id": a.body["lease_id"], "outcome": "ok", "upstream_status": 200, "duration_ms": 35}));
    assert_eq!(rel.status, 200);
    let mut spans = Vec::new();
    assert!(
        eventually(Duration::from_secs(5), || {
            spans = received_spans(&collector);
            spans.len() >= 2
        }),
        "{:?}",
        spans.iter().map(|s| &s.0.name).collect::<Vec<_>>()
    );
    let find = |name: &str| {
        &spans
            .iter()
            .find(|(s, _)| s.name == name)
            .unwrap_or_else(|| panic!("no span {name}"))
            .0
    };
    let (admission, release) = (find("admitd admit search"), find("admitd release search"));
    assert!(
        admission.parent_span_id.is_empty(),
        "a new trace: the admission is its root"
    );
    assert_eq!(release.trace_id, admission.trace_id);
    assert_eq!(release.parent_span_id, admission.span_id);
    assert_eq!(release.links.len(), 1);
    assert_eq!(release.links[0].span_id, admission.span_id);
    assert_eq!(
        attr_str(&release.attributes, "admitd.outcome").as_deref(),
        Some("ok")
    );
    assert_eq!(
        attr_int(&release.attributes, "http.response.status_code"),
        Some(200)
    );
    assert_eq!(
        attr_int(&release.attributes, "admitd.tool_duration_ms"),
        Some(35)
    );
    assert_eq!(
        attr_str(&release.attributes, "admitd.upstream").as_deref(),
        Some("crm")
    );
    assert_eq!(release.status.as_ref().map_or(0, |s| s.code), 0, "unset");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn a_collector_that_is_down_does_not_slow_admissions() {
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let d = Daemon::start(&format!(
        "[limits.subject]\nconcurrency = 1000\n[telemetry.otlp]\nendpoint = \"http://{closed}/v1/traces\"\n"
    ));
    let mut slowest = Duration::ZERO;
    let start = Instant::now();
    for i in 0..300 {
        let t = Instant::now();
        let a = d.admit(call("acme", &format!("s{}", i % 20), "search"));
        slowest = slowest.max(t.elapsed());
        assert!(a.status == 200 || a.status == 429);
        if a.status == 200 {
            d.release(a.body["lease_id"].as_str().unwrap());
        }
    }
    println!(
        "300 admissions with a dead collector in {:?}, slowest {slowest:?}",
        start.elapsed()
    );
    // Export waits up to seconds on a dead endpoint; none of it may show in an admission.
    assert!(
        slowest < Duration::from_millis(500),
        "slowest admission {slowest:?}"
    );
    let text = d.get("/metrics").body.as_str().unwrap().to_string();
    assert_eq!(
        metric(&text, "admitd_telemetry_events_dropped_total"),
        Some(0.0)
    );
}

#[test]
fn spans_flow_again_once_a_collector_that_was_down_comes_back() {
    // A port nobody listens on yet.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 1\n[telemetry.otlp]\nendpoint = \"http://{addr}/v1/traces\"\n"
    ));
    let shed = |id: &str| {
        let a = d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "search", "call_id": id, "max_wait_ms": 0}));
        assert!(a.status == 200 || a.status == 429, "{}", a.status);
    };
    shed("early-1"); // admitted
    shed("early-2"); // shed
                     // The first export fails (nothing listens): admitd says so once and counts the dropped spans.
    assert!(
        d.logged("OTLP span export failed", Duration::from_secs(10)),
        "no log line about the failed export"
    );
    let text = d.get("/metrics").body.as_str().unwrap().to_string();
    assert!(
        metric(
            &text,
            "admitd_spans_dropped_total{reason=\"export_failed\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{text}"
    );
    let collector = Recorder::start_at(&addr);
    // Export resumes at the next probe (pauses grow 1 s, 2 s, 4 s ... while it stays down).
    let mut n = 0;
    let arrived = eventually(Duration::from_secs(20), || {
        n += 1;
        shed(&format!("late-{n}"));
        received_spans(&collector).iter().any(|(s, _)| {
            attr_str(&s.attributes, "gen_ai.tool.call.id").is_some_and(|id| id.starts_with("late-"))
        })
    });
    assert!(arrived, "no span arrived after the collector came back");
    // The export is counted once the collector's answer is back, just after it recorded the spans.
    let mut text = String::new();
    assert!(
        eventually(Duration::from_secs(5), || {
            text = d.get("/metrics").body.as_str().unwrap().to_string();
            metric(&text, "admitd_spans_exported_total").unwrap_or(0.0) >= 1.0
        }),
        "{text}"
    );
    assert!(d.logged("OTLP span export works again", Duration::from_secs(5)));
}

#[test]
fn spans_past_max_spans_per_second_are_counted_not_exported() {
    let collector = Recorder::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 1\n[telemetry.otlp]\nendpoint = \"http://{}/v1/traces\"\nmax_spans_per_second = 5\n",
        collector.addr
    ));
    let started = Instant::now();
    for i in 0..40 {
        let a = d.admit(json!({"tenant": "acme", "subject": "bot", "tool": "search", "call_id": format!("c-{i}"), "max_wait_ms": 0}));
        assert!(a.status == 200 || a.status == 429, "{}", a.status);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let limited = || {
        let text = d.get("/metrics").body.as_str().unwrap().to_string();
        metric(&text, "admitd_spans_dropped_total{reason=\"rate_limited\"}").unwrap_or(0.0) as usize
    };
    // Every call was sampled: each one is either an admission span that reaches the collector (the
    // admitted call's too, although its lease is never released) or counted as rate limited.
    assert!(
        eventually(Duration::from_secs(10), || limited()
            + received_spans(&collector).len()
            == 40),
        "spans received {}, rate limited {}",
        received_spans(&collector).len(),
        limited()
    );
    let exported = 40 - limited();
    assert_eq!(exported, received_spans(&collector).len());
    // A burst of one second's worth, then 5 a second.
    let allowed = 5 + (elapsed * 5.0).ceil() as usize;
    assert!(
        (5..=allowed).contains(&exported),
        "{exported} spans in {elapsed:.2} s, at most {allowed} allowed"
    );
}

#[test]
fn a_tenant_whose_calls_are_mostly_shed_raises_an_alert_that_clears() {
    let am = Recorder::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 2\n[alerts]\nshed_ratio = 0.5\nwindow = \"4s\"\nfor = \"1s\"\nmin_calls = 10\nalertmanager_url = \"http://{}\"\n",
        am.addr
    ));
    for _ in 0..30 {
        d.admit(call("initech", "loop-bot", "search"));
    }
    // a polite tenant stays quiet
    for _ in 0..2 {
        d.admit(call("acme", "bot", "search"));
    }
    let mut alerts = json!(null);
    assert!(
        eventually(Duration::from_secs(6), || {
            alerts = d.get("/v1/alerts").body;
            alerts["alerts"].as_array().is_some_and(|a| !a.is_empty())
        }),
        "no alert: {alerts}"
    );
    let list = alerts["alerts"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{alerts}");
    assert_eq!(list[0]["tenant"], "initech");
    assert_eq!(list[0]["alert"], "shed_ratio_high");
    let ratio = list[0]["shed_ratio"].as_f64().unwrap();
    assert!((0.9..=0.95).contains(&ratio), "{ratio}");
    assert!(list[0]["since"].as_str().unwrap().ends_with('Z'));
    let text = d.get("/metrics").body.as_str().unwrap().to_string();
    assert_eq!(
        metric(
            &text,
            r#"admitd_alert_firing{tenant="initech",alert="shed_ratio_high"}"#
        ),
        Some(1.0)
    );
    assert!(metric(&text, r#"admitd_tenant_shed_ratio{tenant="initech"}"#).unwrap() > 0.9);
    assert!(eventually(Duration::from_secs(3), || !am
        .bodies("/api/v2/alerts")
        .is_empty()));
    let pushed: serde_json::Value =
        serde_json::from_slice(&am.bodies("/api/v2/alerts")[0]).unwrap();
    assert_eq!(pushed[0]["labels"]["tenant"], "initech");
    assert!(pushed[0].get("endsAt").is_none());
    assert!(d
        .log_lines()
        .iter()
        .any(|l| l.contains("alert firing") && l.contains("initech")));

    // The window slides past the burst of sheds: the alert clears, and Alertmanager hears it.
    assert!(eventually(Duration::from_secs(8), || d
        .get("/v1/alerts")
        .body["alerts"]
        .as_array()
        .is_some_and(|a| a.is_empty())));
    assert!(eventually(Duration::from_secs(3), || am
        .bodies("/api/v2/alerts")
        .iter()
        .any(|b| serde_json::from_slice::<serde_json::Value>(b)
            .unwrap()[0]
            .get("endsAt")
            .is_some())));
    let text = d.get("/metrics").body.as_str().unwrap().to_string();
    assert_eq!(
        metric(
            &text,
            r#"admitd_alert_firing{tenant="initech",alert="shed_ratio_high"}"#
        ),
        Some(0.0)
    );
}

#[test]
fn upstream_rate_gauges_show_the_cut_and_return_to_the_configured_rate() {
    let d = Daemon::start("[server]\nidle_ttl = \"1s\"\n[upstreams.u]\nrate = \"10/s\"\nburst = 10\nadaptive_window = \"2s\"\n");
    let a = d.admit(json!({"tenant": "acme", "subject": "s", "tool": "t", "upstream": "u"}));
    let r = d.post("/v1/release", json!({"lease_id": a.body["lease_id"], "outcome": "upstream_rate_limited", "retry_after": "0"}));
    assert_eq!(r.status, 200);
    let rate = |d: &Daemon| {
        metric(
            d.get("/metrics").body.as_str().unwrap_or(""),
            r#"admitd_upstream_effective_rate{tenant="acme",upstream="u"}"#,
        )
    };
    assert!(
        eventually(Duration::from_secs(3), || rate(&d) == Some(5.0)),
        "the cut is not shown: {:?}",
        rate(&d)
    );
    assert_eq!(
        d.get("/v1/tenants/acme").body["upstreams"][0]["effective_rate"],
        5.0
    );
    // No 429 for the adaptive window: the cut is forgotten, the tenant goes idle, and the gauge goes
    // back to the configured rate instead of freezing at the cut.
    assert!(
        eventually(Duration::from_secs(10), || rate(&d) == Some(10.0)),
        "stuck at {:?}",
        rate(&d)
    );
}

#[test]
fn admitted_calls_are_logged_with_their_call_id_only_when_asked() {
    let config = "[limits.subject]\nrate = \"1/h\"\nburst = 1\n";
    let call = |id: &str| json!({"tenant": "acme", "subject": "bot", "tool": "search", "call_id": id, "max_wait_ms": 0});
    for (filter, logged) in [("info,admitd::admission=debug", true), ("info", false)] {
        let d = Daemon::start_logging(config, filter);
        assert_eq!(d.admit(call("c-admitted-7")).status, 200);
        assert_eq!(d.admit(call("c-refused-8")).status, 429);
        // The telemetry thread logs in order: once the refusal is logged, so is the admission if
        // it is to be.
        assert!(
            d.logged("c-refused-8", Duration::from_secs(10)),
            "{filter}: no refusal line"
        );
        let lines = d.log_lines();
        let line = lines.iter().find(|l| l.contains("c-admitted-7"));
        assert_eq!(line.is_some(), logged, "{filter}: {lines:?}");
        if let Some(line) = line {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["target"], "admitd::admission");
            assert_eq!(v["fields"]["message"], "call admitted");
            assert_eq!(v["fields"]["tool"], "search");
            assert_eq!(v["fields"]["call_id"], "c-admitted-7");
            assert_eq!(v["fields"]["subject_hash"].as_str().unwrap().len(), 16);
            assert!(
                !line.contains("\"bot\""),
                "the subject is logged in clear: {line}"
            );
        }
    }
}
