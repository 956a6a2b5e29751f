//! docs/openapi.yaml against the daemon: every route `dispatch` serves is in the spec and every path
//! of the spec is served (read from src/api/mod.rs as text), and the running daemon answers each
//! operation of the spec, its wrong methods and a missing token with a status, headers and body the
//! spec lists. scripts/schemathesis.sh searches the same spec with generated input.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{sha256_hex, Daemon};
use reqwest::blocking::RequestBuilder;
use reqwest::Method;
use serde_json::{json, Value};

/// The methods an OpenAPI 3.1 path item can hold.
const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

const CALLER: &str = "spec-caller-token";
const ADMIN: &str = "spec-admin-token";
const METRICS: &str = "spec-metrics-token";
const EDGE_KEY: &str = "spec-edge-key";

fn read(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

fn spec() -> Value {
    serde_norway::from_str(&read("docs/openapi.yaml")).expect("docs/openapi.yaml is YAML")
}

/// Follows `$ref`s (local ones: `#/components/...`) until `v` is not one.
fn resolve<'a>(spec: &'a Value, mut v: &'a Value) -> &'a Value {
    while let Some(r) = v.get("$ref").and_then(Value::as_str) {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("non-local $ref {r}"));
        v = spec
            .pointer(pointer)
            .unwrap_or_else(|| panic!("$ref {r} resolves to nothing"));
    }
    v
}

/// Path -> its methods, upper case, as the spec lists them.
fn spec_paths(spec: &Value) -> BTreeMap<String, BTreeSet<String>> {
    spec["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .map(|(path, item)| {
            let methods = METHODS
                .iter()
                .filter(|m| item.get(**m).is_some())
                .map(|m| m.to_uppercase())
                .collect();
            (path.clone(), methods)
        })
        .collect()
}

/// A route as `dispatch` matches it.
#[derive(Debug)]
enum Served {
    /// An exact path, with the methods of its guard.
    Exact(String, BTreeSet<String>),
    /// A path prefix followed by one parameter (`/v1/tenants/` + tenant).
    Prefix(String, BTreeSet<String>),
    /// The edge check: its path and anything under it, every method.
    Edge(String),
}

fn guard_methods(arm: &str) -> BTreeSet<String> {
    let guard = arm.split(" if ").nth(1).unwrap_or("");
    let words: Vec<&str> = guard
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .collect();
    let mut m = BTreeSet::new();
    if words.contains(&"get") {
        // `dispatch` serves HEAD wherever it serves GET.
        m.extend(["GET".to_string(), "HEAD".to_string()]);
    }
    if words.contains(&"post") {
        m.insert("POST".to_string());
    }
    if words.contains(&"delete") {
        m.insert("DELETE".to_string());
    }
    assert!(!m.is_empty(), "no method in the guard of `{arm}`");
    m
}

/// The first string literal in `s`.
fn literal(s: &str) -> Option<&str> {
    let start = s.find('"')? + 1;
    let len = s[start..].find('"')?;
    Some(&s[start..start + len])
}

/// The routes of `dispatch`, read from its `match path` up to the arm that answers 404 and 405.
fn served_routes() -> Vec<Served> {
    let src = read("src/api/mod.rs");
    let body = &src[src.find("async fn dispatch").expect("fn dispatch")..];
    let arms = &body[body.find("match path {").expect("match path")..];
    let arms = &arms[..arms.find("\n        p => {").expect("the fallback arm")];
    let edge_src = read("src/api/edge.rs");
    let edge_path = edge_src
        .lines()
        .find_map(|l| l.strip_prefix("pub const PATH: &str = "))
        .and_then(literal)
        .expect("edge::PATH");
    let mut routes = Vec::new();
    // An arm starts at a line of the match's own indentation and ends at its `=>`.
    let mut arm = String::new();
    for line in arms.lines().skip(1) {
        let indented = line.starts_with("        ") && !line.starts_with("         ");
        if indented && !line.trim_start().starts_with("//") {
            arm = line.trim().to_string();
        } else if !arm.is_empty() && !arm.contains("=>") {
            arm.push(' ');
            arm.push_str(line.trim());
        }
        if !arm.contains("=>") {
            continue;
        }
        let head = arm[..arm.find("=>").unwrap()].to_string();
        arm.clear();
        if head.starts_with('"') {
            let path = literal(&head).unwrap().to_string();
            routes.push(Served::Exact(path, guard_methods(&head)));
        } else if head.contains("is_edge_path(") {
            routes.push(Served::Edge(edge_path.to_string()));
        } else if let Some(at) = head.find(".starts_with(") {
            let prefix = literal(&head[at..]).unwrap().to_string();
            routes.push(Served::Prefix(prefix, guard_methods(&head)));
        } else {
            panic!("a route arm of dispatch this test cannot read: `{head}`");
        }
    }
    routes
}

/// The served routes, merged per spec path: path -> methods.
fn served_paths(spec: &BTreeMap<String, BTreeSet<String>>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for route in served_routes() {
        match route {
            Served::Exact(p, m) => out.entry(p).or_default().extend(m),
            Served::Prefix(prefix, m) => {
                // In the spec: the prefix and one templated segment.
                let templated: Vec<&String> = spec
                    .keys()
                    .filter(|p| {
                        p.strip_prefix(prefix.as_str()).is_some_and(|rest| {
                            rest.starts_with('{') && rest.ends_with('}') && !rest.contains('/')
                        })
                    })
                    .collect();
                assert_eq!(
                    templated.len(),
                    1,
                    "dispatch serves {prefix}<name>; the spec needs one path {prefix}{{name}}"
                );
                out.entry(templated[0].clone()).or_default().extend(m);
            }
            Served::Edge(path) => {
                let all: BTreeSet<String> = METHODS.iter().map(|m| m.to_uppercase()).collect();
                let under = spec
                    .keys()
                    .find(|p| {
                        p.strip_prefix(&format!("{path}/"))
                            .is_some_and(|rest| rest.starts_with('{') && rest.ends_with('}'))
                    })
                    .cloned()
                    .unwrap_or_else(|| format!("{path}/{{path}} (missing from the spec)"));
                out.insert(path, all.clone());
                out.insert(under, all);
            }
        }
    }
    out
}

#[test]
fn every_route_served_is_in_the_spec_and_every_path_in_the_spec_is_served() {
    let spec = spec();
    assert!(
        spec["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.")),
        "an OpenAPI 3 document"
    );
    let documented = spec_paths(&spec);
    let served = served_paths(&documented);
    // Each served route comes with the methods its guard takes; the spec lists exactly those.
    assert_eq!(
        served, documented,
        "left: routes dispatch serves (src/api/mod.rs); right: docs/openapi.yaml"
    );
}

#[test]
fn every_operation_answers_only_what_the_spec_documents() {
    let spec = spec();
    let d = Daemon::start(&config());
    let mut problems = Vec::new();
    for (path, item) in spec["paths"].as_object().unwrap() {
        for method in METHODS.iter().filter(|m| item.get(**m).is_some()) {
            let op = &item[*method];
            let (req, what) = request(&d, &spec, path, item, method, op, true);
            let answer = req.send().expect("request");
            check_answer(&spec, &what, op, method, answer, &mut problems);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_missing_token_is_the_401_the_spec_documents() {
    let spec = spec();
    let d = Daemon::start(&config());
    let mut problems = Vec::new();
    let mut refused = 0;
    for (path, item) in spec["paths"].as_object().unwrap() {
        for method in METHODS.iter().filter(|m| item.get(**m).is_some()) {
            let op = &item[*method];
            let security = op.get("security").or(spec.get("security"));
            let schemes: Vec<&str> = security
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|r| r.as_object()?.keys().next().map(String::as_str))
                .collect();
            let (req, what) = request(&d, &spec, path, item, method, op, false);
            let answer = req.send().expect("request");
            let status = answer.status().as_u16();
            if schemes.is_empty() {
                if status == 401 {
                    problems.push(format!("{what}: 401 on a route the spec says is open"));
                }
                continue;
            }
            // The edge check authenticates with its own keys, and may refuse an unknown client
            // address first; every other route needs its token once one is configured.
            if status != 401 {
                problems.push(format!("{what}: {status} without a token"));
                continue;
            }
            refused += 1;
            check_answer(&spec, &what, op, method, answer, &mut problems);
        }
    }
    assert!(refused >= 10, "only {refused} operations refused");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn wrong_methods_are_405_with_the_methods_of_the_spec_and_unknown_routes_404() {
    let spec = spec();
    let d = Daemon::start(&config());
    let mut problems = Vec::new();
    for (path, methods) in spec_paths(&spec) {
        if path.starts_with("/v1/edge/check") {
            continue; // takes any method
        }
        let item = &spec["paths"][&path];
        let url = d.url(&fill_path(&spec, &path, item));
        // In the order `dispatch` writes them: GET before HEAD.
        let allow: Vec<String> = METHODS
            .iter()
            .map(|m| m.to_uppercase())
            .filter(|m| methods.contains(m))
            .collect();
        for wrong in [
            "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "QUERY",
        ] {
            if methods.contains(wrong) {
                continue;
            }
            let method = Method::from_bytes(wrong.as_bytes()).unwrap();
            let mut req = d.client.request(method, &url);
            // The token the route needs, so that it is the method that is refused.
            if let Some(token) = token_for(&spec, item) {
                req = req.bearer_auth(token);
            }
            let r = req.send().expect("request");
            let status = r.status().as_u16();
            let got = r
                .headers()
                .get("allow")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body: Value = r.json().unwrap_or(Value::Null);
            if status != 405 || got.as_deref() != Some(allow.join(", ").as_str()) {
                problems.push(format!(
                    "{wrong} {path}: {status}, Allow {got:?}; the spec lists {}",
                    allow.join(", ")
                ));
            } else if body["error"] != "method_not_allowed" {
                problems.push(format!("{wrong} {path}: body {body}"));
            }
        }
    }
    for unknown in [
        "/index.html",
        "/v1",
        "/v1/admitx",
        "/v1/tenant",
        "/v2/admit",
        "/v1/edge/checks",
    ] {
        let r = d.client.get(d.url(unknown)).send().expect("request");
        let status = r.status().as_u16();
        let body: Value = r.json().unwrap_or(Value::Null);
        if status != 404 || body["error"] != "not_found" {
            problems.push(format!("GET {unknown}: {status} {body}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_examples_of_the_spec_go_through_admit_release_and_the_snapshot() {
    let spec = spec();
    let d = Daemon::start(&config());
    let example = |path: &str| {
        spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"].clone()
    };
    let admit = example("/v1/admit");
    let a = d.post_with_token("/v1/admit", CALLER, admit.clone());
    assert_eq!(a.status, 200, "{}", a.body);
    assert_valid(&spec, "#/components/schemas/Admitted", &a.body);
    let lease = a.body["lease_id"].as_str().unwrap().to_string();

    let snap = d
        .client
        .get(d.url(&format!(
            "/v1/tenants/{}",
            admit["tenant"].as_str().unwrap()
        )))
        .bearer_auth(CALLER)
        .send()
        .unwrap();
    assert_eq!(snap.status().as_u16(), 200);
    assert_valid(
        &spec,
        "#/components/schemas/TenantSnapshot",
        &snap.json().unwrap(),
    );

    let mut release = example("/v1/release");
    release["lease_id"] = json!(lease);
    let r = d.post_with_token("/v1/release", CALLER, release.clone());
    assert_eq!((r.status, &r.body), (200, &json!({"released": true})));
    let again = d.post_with_token("/v1/release", CALLER, release);
    assert_eq!(again.status, 404);
    assert_eq!(again.body["error"], "unknown_lease");

    let f = d.post_with_token("/v1/feedback", CALLER, example("/v1/feedback"));
    assert_eq!((f.status, &f.body), (202, &json!({"accepted": true})));
    let reload = d.post_with_token("/v1/admin/reload", ADMIN, json!({}));
    assert_eq!(reload.status, 200, "{}", reload.body);
}

/// Known defect, expected to fail until admitd is fixed (scripts/schemathesis_hooks.py keeps such
/// input out of the Schemathesis search meanwhile): JSON does not tell `429.0` from `429`, so
/// neither does the spec's `type: integer`, but admitd refuses a status code written with a
/// fraction with 400 ("invalid type: floating point `429.0`, expected i64").
#[test]
fn status_codes_written_as_integral_floats_are_status_codes() {
    let d = Daemon::start_default();
    let f = d.post(
        "/v1/feedback",
        json!({"tenant": "acme", "upstream": "warehouse", "status": 429.0}),
    );
    assert_eq!(f.status, 202, "{}", f.body);
    let a = d.admit(json!({"tenant": "acme", "subject": "s", "tool": "t"}));
    let r = d.post(
        "/v1/release",
        json!({"lease_id": a.body["lease_id"], "outcome": "ok", "upstream_status": 200.0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

fn config() -> String {
    format!(
        r#"[server]
api_tokens_sha256 = ["{caller}"]
admin_token_sha256 = "{admin}"
metrics_token_sha256 = "{metrics}"
max_wait = "100ms"

[tools.get_sales]
upstream = "warehouse"

[upstreams.warehouse]
rate = "20/s"
burst = 20

[edge]
# Every edge operation of the spec is asked once without a credential, from one address.
failed_auth_burst = 1000

[[edge.api_keys]]
sha256 = "{edge}"
tenant = "acme"
subject = "acme-bot"
"#,
        caller = sha256_hex(CALLER),
        admin = sha256_hex(ADMIN),
        metrics = sha256_hex(METRICS),
        edge = sha256_hex(EDGE_KEY),
    )
}

/// The token of the first security scheme an operation of `item` names.
fn token_for(spec: &Value, item: &Value) -> Option<&'static str> {
    METHODS
        .iter()
        .filter_map(|m| item.get(*m))
        .flat_map(|op| op.get("security").or(spec.get("security")).into_iter())
        .flat_map(|s| s.as_array().cloned().unwrap_or_default())
        .find_map(|req| req.as_object()?.keys().next().and_then(|k| scheme_token(k)))
}

fn scheme_token(scheme: &str) -> Option<&'static str> {
    match scheme {
        "CallerToken" => Some(CALLER),
        "AdminToken" => Some(ADMIN),
        "MetricsToken" => Some(METRICS),
        "EdgeBearer" | "EdgeApiKey" => Some(EDGE_KEY),
        _ => None,
    }
}

/// The parameters of an operation: the path item's, then its own.
fn parameters<'a>(spec: &'a Value, item: &'a Value, op: &'a Value) -> Vec<&'a Value> {
    [item.get("parameters"), op.get("parameters")]
        .into_iter()
        .flatten()
        .filter_map(Value::as_array)
        .flatten()
        .map(|p| resolve(spec, p))
        .collect()
}

fn fill_path(spec: &Value, path: &str, item: &Value) -> String {
    let mut out = path.to_string();
    for p in parameters(spec, item, &Value::Null) {
        if p["in"] == "path" {
            let name = p["name"].as_str().unwrap();
            let value = p["example"]
                .as_str()
                .expect("path parameters have an example");
            out = out.replace(&format!("{{{name}}}"), value);
        }
    }
    assert!(
        !out.contains('{'),
        "{path}: a path parameter without an example"
    );
    out
}

/// The request the spec's examples make for an operation, with its token when `authorized`, and
/// how to name it in a message.
fn request(
    d: &Daemon,
    spec: &Value,
    path: &str,
    item: &Value,
    method: &str,
    op: &Value,
    authorized: bool,
) -> (RequestBuilder, String) {
    let url = d.url(&fill_path(spec, path, item));
    let m = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
    let what = format!("{} {path}", method.to_uppercase());
    let mut req = d.client.request(m, url);
    for p in parameters(spec, item, op) {
        if p["in"] == "header" {
            if let Some(v) = p["example"].as_str() {
                req = req.header(p["name"].as_str().unwrap(), v);
            }
        }
    }
    if authorized {
        let scheme = op
            .get("security")
            .and_then(|s| s.as_array()?.first()?.as_object()?.keys().next().cloned());
        if let Some(token) = scheme.as_deref().and_then(scheme_token) {
            req = req.bearer_auth(token);
        }
    }
    if let Some(body) = op.pointer("/requestBody/content/application~1json/example") {
        req = req
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    (req, what)
}

/// Checks an answer against the operation's responses: a documented status, the required headers,
/// the content type, and the body against the schema.
fn check_answer(
    spec: &Value,
    what: &str,
    op: &Value,
    method: &str,
    answer: reqwest::blocking::Response,
    problems: &mut Vec<String>,
) {
    let status = answer.status().as_u16();
    let Some(documented) = op["responses"].get(status.to_string()) else {
        let listed: Vec<&String> = op["responses"].as_object().unwrap().keys().collect();
        problems.push(format!(
            "{what}: {status}, which the spec does not list ({listed:?})"
        ));
        return;
    };
    let documented = resolve(spec, documented);
    let headers = answer.headers().clone();
    for (name, h) in documented["headers"].as_object().into_iter().flatten() {
        let h = resolve(spec, h);
        if h["required"] == true && !headers.contains_key(name.to_ascii_lowercase().as_str()) {
            problems.push(format!("{what}: {status} without its {name} header"));
        }
    }
    let Some(content) = documented.get("content").and_then(Value::as_object) else {
        return;
    };
    if method == "head" {
        return;
    }
    let ct = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let Some((media, media_type)) = content.iter().find(|(m, _)| ct.starts_with(m.as_str())) else {
        problems.push(format!("{what}: {status} with content type {ct:?}"));
        return;
    };
    let text = answer.text().unwrap_or_default();
    if media == "application/json" {
        match serde_json::from_str::<Value>(&text) {
            Ok(v) => {
                let mut errs = Vec::new();
                validate(spec, &media_type["schema"], &v, "body", &mut errs);
                for e in errs {
                    problems.push(format!("{what}: {status}: {e} in {text}"));
                }
            }
            Err(e) => problems.push(format!("{what}: {status}: not JSON ({e}): {text}")),
        }
    }
}

fn assert_valid(spec: &Value, pointer: &str, v: &Value) {
    let mut errs = Vec::new();
    validate(spec, &json!({"$ref": pointer}), v, "body", &mut errs);
    assert!(errs.is_empty(), "{}: {v}", errs.join("; "));
}

fn type_matches(ty: &str, v: &Value) -> bool {
    match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        _ => panic!("unknown type {ty}"),
    }
}

/// Enough of JSON Schema for the spec's answers: `$ref`, `type`, `const`, `enum`, `anyOf`,
/// `oneOf`, `required`, `properties`, `additionalProperties: false`, `items`, `minItems`,
/// `minimum`, `exclusiveMinimum`, `maximum`, `minLength`. (Patterns are Schemathesis's job.)
fn validate(spec: &Value, schema: &Value, v: &Value, at: &str, errs: &mut Vec<String>) {
    let schema = resolve(spec, schema);
    let ok = |s: &Value| {
        let mut e = Vec::new();
        validate(spec, s, v, at, &mut e);
        e.is_empty()
    };
    if let Some(c) = schema.get("const") {
        if c != v {
            errs.push(format!("{at} is {v}, not {c}"));
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            errs.push(format!("{at} is {v}, not one of {e:?}"));
        }
    }
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
        if !any.iter().any(ok) {
            errs.push(format!("{at} matches none of anyOf"));
        }
    }
    if let Some(one) = schema.get("oneOf").and_then(Value::as_array) {
        let n = one.iter().filter(|s| ok(s)).count();
        if n != 1 {
            errs.push(format!("{at} matches {n} of oneOf"));
        }
    }
    if let Some(ty) = schema.get("type") {
        let types: Vec<&str> = match ty {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => panic!("type {ty}"),
        };
        if !types.iter().any(|t| type_matches(t, v)) {
            errs.push(format!("{at} is {v}, not of type {types:?}"));
            return;
        }
    }
    if let Some(obj) = v.as_object() {
        for r in schema["required"].as_array().into_iter().flatten() {
            if !obj.contains_key(r.as_str().unwrap()) {
                errs.push(format!("{at}.{} is missing", r.as_str().unwrap()));
            }
        }
        let props = schema.get("properties").and_then(Value::as_object);
        for (k, val) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(s) => validate(spec, s, val, &format!("{at}.{k}"), errs),
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    errs.push(format!("{at}.{k} is not in the schema"))
                }
                None => {}
            }
        }
    }
    if let Some(items) = v.as_array() {
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64) {
            if (items.len() as u64) < min {
                errs.push(format!("{at} has fewer than {min} items"));
            }
        }
        if let Some(s) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                validate(spec, s, item, &format!("{at}[{i}]"), errs);
            }
        }
    }
    if let Some(x) = v.as_f64() {
        let bound = |k: &str| schema.get(k).and_then(Value::as_f64);
        if bound("minimum").is_some_and(|m| x < m)
            || bound("exclusiveMinimum").is_some_and(|m| x <= m)
            || bound("maximum").is_some_and(|m| x > m)
        {
            errs.push(format!("{at} is {x}, out of its bounds"));
        }
    }
    if let (Some(s), Some(min)) = (v.as_str(), schema.get("minLength").and_then(Value::as_u64)) {
        if (s.chars().count() as u64) < min {
            errs.push(format!("{at} is shorter than {min}"));
        }
    }
}
