//! `deploy/envoy/envoy.yaml`, checked for structure (Envoy itself does not run in the tests): the
//! ext_authz filter asks admitd's edge check before the router, forwards every header the check
//! reads and the body, passes a refusal's headers to the client, turns a refused call's JSON-RPC
//! answer into the 200 a server gives, and names only clusters that exist.

use serde_norway::Value;

fn envoy() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/envoy/envoy.yaml"
    ))
    .unwrap();
    serde_norway::from_str(&text).expect("envoy.yaml is YAML")
}

fn patterns(v: &Value) -> Vec<String> {
    v["patterns"]
        .as_sequence()
        .expect("a list of patterns")
        .iter()
        .map(|p| p["exact"].as_str().expect("exact patterns").to_string())
        .collect()
}

#[test]
fn the_envoy_example_asks_the_edge_check_first_and_passes_its_headers() {
    let e = envoy();
    let clusters: Vec<&str> = e["static_resources"]["clusters"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap();
            assert_eq!(c["load_assignment"]["cluster_name"].as_str(), Some(name));
            name
        })
        .collect();
    let listeners = e["static_resources"]["listeners"].as_sequence().unwrap();
    assert_eq!(listeners.len(), 1);
    let hcm = &listeners[0]["filter_chains"][0]["filters"][0];
    assert_eq!(
        hcm["name"].as_str(),
        Some("envoy.filters.network.http_connection_manager")
    );
    let cfg = &hcm["typed_config"];
    assert!(cfg["@type"]
        .as_str()
        .unwrap()
        .ends_with("v3.HttpConnectionManager"));
    // Envoy sets X-Envoy-External-Address from the peer only with use_remote_address.
    assert_eq!(cfg["use_remote_address"].as_bool(), Some(true));
    for host in cfg["route_config"]["virtual_hosts"].as_sequence().unwrap() {
        for route in host["routes"].as_sequence().unwrap() {
            let c = route["route"]["cluster"].as_str().unwrap();
            assert!(clusters.contains(&c), "route to unknown cluster {c}");
        }
    }
    let filters = cfg["http_filters"].as_sequence().unwrap();
    let names: Vec<&str> = filters
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["envoy.filters.http.ext_authz", "envoy.filters.http.router"],
        "ext_authz must run before the router"
    );
    let authz = &filters[0]["typed_config"];
    assert!(authz["@type"]
        .as_str()
        .unwrap()
        .ends_with("ext_authz.v3.ExtAuthz"));
    assert_eq!(authz["transport_api_version"].as_str(), Some("V3"));
    assert_eq!(authz["failure_mode_allow"].as_bool(), Some(false));
    let http = &authz["http_service"];
    assert_eq!(http["path_prefix"].as_str(), Some("/v1/edge/check"));
    let admitd = http["server_uri"]["cluster"].as_str().unwrap();
    assert!(clusters.contains(&admitd));
    let sent = patterns(&http["authorization_request"]["allowed_headers"]);
    for h in [
        "x-api-key",
        "mcp-method",
        "mcp-name",
        "mcp-protocol-version",
        "x-envoy-external-address",
    ] {
        assert!(
            sent.iter().any(|s| s == h),
            "{h} is not forwarded to admitd"
        );
    }
    let response = &http["authorization_response"];
    let to_client = patterns(&response["allowed_client_headers"]);
    for h in ["retry-after", "ratelimit", "ratelimit-policy"] {
        assert!(
            to_client.iter().any(|s| s == h),
            "{h} is not passed to the client"
        );
    }
    let on_success = patterns(&response["allowed_client_headers_on_success"]);
    assert!(on_success.iter().any(|s| s == "ratelimit"));
    let upstream = patterns(&response["allowed_upstream_headers"]);
    assert!(upstream.iter().any(|s| s == "x-admitd-tenant"));

    // The body goes to the check, within what admitd reads (64 KiB), so a refusal is answered in
    // JSON-RPC under the request's id; a larger one is cut, not refused.
    let body = &authz["with_request_body"];
    let max = body["max_request_bytes"]
        .as_u64()
        .expect("max_request_bytes");
    assert!((1024..=65536).contains(&max), "{max}");
    assert_eq!(body["allow_partial_message"].as_bool(), Some(true));
    assert!(to_client.iter().any(|s| s == "content-type"));

    // The check's 429 with the JSON-RPC answer reaches the client as a server's 200, and only
    // the check's own refusals (UAEX) are rewritten.
    let mappers = cfg["local_reply_config"]["mappers"]
        .as_sequence()
        .expect("local_reply_config.mappers");
    let refusal = mappers
        .iter()
        .find(|m| m["status_code"].as_u64() == Some(200))
        .expect("a mapper to 200");
    let filters = refusal["filter"]["and_filter"]["filters"]
        .as_sequence()
        .expect("and_filter");
    let status = filters
        .iter()
        .find_map(|f| f.get("status_code_filter"))
        .expect("a status_code_filter");
    assert_eq!(status["comparison"]["op"].as_str(), Some("EQ"));
    assert_eq!(
        status["comparison"]["value"]["default_value"].as_u64(),
        Some(429)
    );
    let flags = filters
        .iter()
        .find_map(|f| f.get("response_flag_filter"))
        .expect("a response_flag_filter")["flags"]
        .as_sequence()
        .unwrap();
    assert_eq!(flags.len(), 1);
    assert_eq!(flags[0].as_str(), Some("UAEX"));
}
