//! The status page `GET /` in a real headless Chromium: it renders the test's tenants, each chart
//! has its points, the browser logs nothing to the console; and who may see it.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{eventually, sha256_hex, Daemon};
use serde_json::{json, Value};

/// The headless Chromium the test drives (Debian's `chromium`; `CHROMIUM` names another).
fn chromium() -> String {
    std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".into())
}

/// Loads `url` in a fresh headless Chromium: (the DOM after load, the browser's console lines).
fn load(url: &str) -> (String, Vec<String>) {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new("timeout")
        .arg("120")
        .arg(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(url)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (apt-get install chromium): {e}", chromium()));
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let console = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains(":CONSOLE"))
        .map(str::to_string)
        .collect();
    (String::from_utf8_lossy(&out.stdout).into_owned(), console)
}

/// The `points` of each polyline in `html`, as (x, y) pairs.
fn polylines(html: &str) -> Vec<Vec<(f64, f64)>> {
    html.split("<polyline")
        .skip(1)
        .map(|p| {
            let at = p.find("points=\"").expect("points") + 8;
            p[at..at + p[at..].find('"').unwrap()]
                .split_whitespace()
                .map(|xy| {
                    let (x, y) = xy.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect()
        })
        .collect()
}

/// The table row of `tenant` in the DOM.
fn row<'a>(dom: &'a str, tenant: &str) -> &'a str {
    let at = dom
        .find(&format!("data-tenant=\"{tenant}\""))
        .unwrap_or_else(|| panic!("no row for {tenant} in {dom}"));
    &dom[at..at + dom[at..].find("</tr>").unwrap()]
}

fn call(d: &Daemon, tenant: &str, calls: usize, spread: bool) {
    for i in 0..calls {
        let subject = if spread {
            format!("s{i}")
        } else {
            "bot".into()
        };
        let a =
            d.admit(json!({"tenant": tenant, "subject": subject, "tool": "t", "max_wait_ms": 0}));
        assert!(a.status == 200 || a.status == 429, "{}", a.body);
    }
}

const LIMITS: &str = "[limits.subject]\nrate = \"1/min\"\nburst = 2\n[alerts]\nwindow = \"1m\"\nfor = \"0s\"\nmin_calls = 5\n";

#[test]
fn the_page_renders_in_chromium_with_the_tenants_their_charts_and_no_console_errors() {
    // The detector first: a page that logs is caught, so a clean run below means something.
    let (_, console) =
        load("data:text/html,<p>x</p><script>console.error('admitd-probe')</script>");
    assert!(
        console.iter().any(|l| l.contains("admitd-probe")),
        "{console:?}"
    );

    let d = Daemon::start(LIMITS);
    call(&d, "looping", 20, false);
    call(&d, "quiet", 3, true);
    assert!(eventually(Duration::from_secs(10), || {
        let v = d.get("/v1/tenants").body;
        v["total"] == 2 && v["tenants"][0]["shed"] == 18
    }));
    let (dom, console) = load(&d.url("/"));
    assert!(console.is_empty(), "console: {console:?}");
    assert!(dom.contains("<title>admitd status</title>"), "{dom}");
    assert!(dom.contains(r#"id="store">memory</b>"#), "{dom}");
    assert!(dom.contains("shed_ratio_high on looping"), "{dom}");
    let looping = row(&dom, "looping");
    let quiet = row(&dom, "quiet");
    assert!(
        dom.find(looping).unwrap() < dom.find(quiet).unwrap(),
        "most shed first"
    );
    assert!(
        looping.contains("<td>90.0</td>") && looping.contains("subject (18)"),
        "{looping}"
    );
    // Each chart: two lines (admitted, shed) with a point per slot of the window, and the calls
    // made above the baseline in the latest slots.
    let lines = polylines(looping);
    assert_eq!(lines.len(), 2, "{looping}");
    for l in &lines {
        assert_eq!(l.len(), 60, "{looping}");
    }
    let baseline = lines[1][0].1;
    assert!(
        lines[1].iter().any(|p| p.1 < baseline),
        "shed points above the baseline: {looping}"
    );
    let quiet_lines = polylines(quiet);
    assert!(quiet_lines[0].iter().any(|p| p.1 < baseline), "{quiet}");
    assert!(
        quiet_lines[1].iter().all(|p| p.1 == baseline),
        "quiet was never shed: {quiet}"
    );
    // Self-contained: nothing for the browser to fetch.
    for needle in ["<script", "src=", "href=", "<link"] {
        assert!(!dom.contains(needle), "{needle} in {dom}");
    }
    let page = d.client.get(d.url("/")).send().unwrap();
    let csp = page
        .headers()
        .get("content-security-policy")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
}

#[test]
fn the_page_is_guarded_like_metrics_and_shows_a_tenant_only_itself() {
    let config = format!(
        "[server]\nmetrics_token_sha256 = \"{}\"\n{LIMITS}[edge]\n[[edge.api_keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\nsubject = \"acme-bot\"\n",
        sha256_hex("page-scraper"),
        sha256_hex("acme-key")
    );
    let d = Daemon::start(&common::with_admin(&config));
    call(&d, "looping", 20, false);
    call(&d, "acme", 3, true);
    let get = |auth: Option<String>| {
        let mut r = d.client.get(d.url("/"));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let r = r.send().unwrap();
        let status = r.status().as_u16();
        let challenge = r
            .headers()
            .get("www-authenticate")
            .map(|v| v.to_str().unwrap().to_string());
        (status, challenge, r.text().unwrap())
    };
    // A browser is asked for the token (Basic: the token is the password).
    let (status, challenge, body) = get(None);
    assert_eq!(status, 401, "{body}");
    assert_eq!(challenge.as_deref(), Some("Basic realm=\"admitd\""));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"], "unauthorized");
    // "any:page-scraper" in base64.
    let basic = "Basic YW55OnBhZ2Utc2NyYXBlcg==".to_string();
    assert!(eventually(Duration::from_secs(10), || {
        let (s, _, body) = get(Some(basic.clone()));
        s == 200
            && body.contains("data-tenant=\"looping\"")
            && body.contains("data-tenant=\"acme\"")
    }));
    // acme's own key: acme's row, and no other tenant's name anywhere on the page.
    let (status, _, body) = get(Some("Bearer acme-key".into()));
    assert_eq!(status, 200);
    assert!(body.contains("data-tenant=\"acme\""), "{body}");
    assert!(!body.contains("looping"), "{body}");
    let (status, _, _) = get(Some("Bearer wrong".into()));
    assert_eq!(status, 401);

    // The latest reload, and a refused one with its reason.
    let (_, _, body) = get(Some(basic.clone()));
    assert!(
        body.contains(r#"id="reload">none since start</b>"#),
        "{body}"
    );
    assert_eq!(d.post_admin("/v1/admin/reload", json!({})).status, 200);
    let (_, _, body) = get(Some(basic.clone()));
    assert!(body.contains(r#"id="reload">ok at "#), "{body}");
    d.rewrite_config("[limits.subject]\nrate = \"5/mins\"\n");
    assert_eq!(d.post_admin("/v1/admin/reload", json!({})).status, 400);
    let (_, _, body) = get(Some(basic));
    assert!(body.contains(r#"id="reload">refused at "#), "{body}");
    assert!(body.contains("5/mins"), "{body}");
    // Its reason quotes the config, which may name any tenant: a tenant's own view gets the time.
    let (_, _, body) = get(Some("Bearer acme-key".into()));
    assert!(body.contains(r#"id="reload">refused at "#), "{body}");
    assert!(!body.contains("5/mins"), "{body}");
}
