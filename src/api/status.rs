//! `GET /`: the status page. One self-contained HTML page, drawn on the server: the tenants of the
//! live view (`GET /v1/tenants`) with a small chart each of their admitted and shed calls over the
//! alert window, the alerts firing, the store's state and the latest reload.
//!
//! No script, no framework and nothing fetched from elsewhere: the charts are inline SVG and the
//! page refreshes itself with a `<meta http-equiv="refresh">`, so it works through an SSH tunnel to
//! a machine without Internet access, and its `Content-Security-Policy` (`default-src 'none'`)
//! lets a browser load nothing else even if a tenant's name tried to smuggle markup in (names are
//! escaped as well). The history the charts draw is the alert window's 60 slots per tenant, which
//! the alert evaluator keeps anyway (`telemetry::live`): the page holds no history of its own, and
//! draws the first `limit` tenants (20 unless `?limit=` says otherwise).
//!
//! Guarded like the live view: a tenant's own credential sees its own row and alerts only.

use std::fmt::Write as _;
use std::sync::Arc;

use warp::http::{HeaderValue, StatusCode};
use warp::reply::Response;

use super::auth::Viewer;
use super::body::Head;
use super::{tenants, ApiError, App};
use crate::store::Store;
use crate::telemetry::alerts::rfc3339;
use crate::telemetry::live::{TenantRow, TenantsPage, TenantsQuery};

/// Tenants drawn unless `?limit=` says otherwise.
pub const PAGE_LIMIT: usize = 20;
/// Seconds between the page's own refreshes.
const REFRESH_S: u32 = 5;

/// Escapes text for HTML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The points of one series over the window, oldest slot on the left: `slots` values, the slots
/// without calls at zero.
fn series(row: &TenantRow, slots: usize, slot_s: f64, shed: bool) -> Vec<u64> {
    let mut v = vec![0u64; slots];
    for &(ago, admitted, sheds) in row.history.as_deref().unwrap_or_default() {
        let back = (ago / slot_s.max(1e-9)).round() as usize;
        if back < slots {
            v[slots - 1 - back] += if shed { sheds } else { admitted };
        }
    }
    v
}

const CHART_W: f64 = 240.0;
const CHART_H: f64 = 36.0;

/// A tenant's chart: admitted (above) and shed calls per slot, as two polylines on one scale.
fn chart(row: &TenantRow, slots: usize, slot_s: f64) -> String {
    let admitted = series(row, slots, slot_s, false);
    let shed = series(row, slots, slot_s, true);
    let top = admitted
        .iter()
        .chain(&shed)
        .copied()
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let step = CHART_W / (slots.max(2) - 1) as f64;
    let line = |v: &[u64]| {
        let mut pts = String::new();
        for (i, n) in v.iter().enumerate() {
            let y = CHART_H - 2.0 - (*n as f64 / top) * (CHART_H - 4.0);
            let _ = write!(pts, "{:.1},{:.1} ", i as f64 * step, y);
        }
        pts.trim_end().to_string()
    };
    format!(
        "<svg class=\"chart\" width=\"{CHART_W}\" height=\"{CHART_H}\" viewBox=\"0 0 {CHART_W} {CHART_H}\" role=\"img\" aria-label=\"admitted and shed calls per {slot_s}s\"><polyline class=\"admitted\" points=\"{}\"/><polyline class=\"shed\" points=\"{}\"/></svg>",
        line(&admitted),
        line(&shed)
    )
}

/// The page's HTML. `alerts`: (tenant, alert, shed ratio, since) of the alerts the viewer may see.
pub fn render(
    page: Option<&TenantsPage>,
    store: &str,
    ready: bool,
    reload: &str,
    alerts: &[(String, String, f64, String)],
) -> String {
    let mut h = String::with_capacity(16 << 10);
    let _ = write!(
        h,
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>admitd status</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d2330; background: #fbfbfd; }}
h1 {{ font-size: 1.3em; margin: 0 0 .3em; }} h2 {{ font-size: 1.05em; margin: 1.4em 0 .4em; }}
.facts span {{ display: inline-block; margin-right: 1.6em; }} .bad {{ color: #b3261e; font-weight: 600; }}
.ok {{ color: #1e7b34; font-weight: 600; }} table {{ border-collapse: collapse; }}
th, td {{ padding: .25em .7em; text-align: right; border-bottom: 1px solid #e3e5ea; white-space: nowrap; }}
th {{ font-weight: 600; color: #545b69; }} td.name, th.name {{ text-align: left; }}
.chart polyline {{ fill: none; stroke-width: 1.5; }} .chart .admitted {{ stroke: #2f7d4f; }}
.chart .shed {{ stroke: #c0392b; }} .key i {{ font-style: normal; font-weight: 600; }}
.key .a {{ color: #2f7d4f; }} .key .s {{ color: #c0392b; }} .muted {{ color: #6b7280; }}
</style></head><body>
<h1>admitd {}</h1>
<p class="facts"><span>store: <b class="{}" id="store">{}</b></span><span>reload: <b id="reload">{}</b></span>"#,
        env!("CARGO_PKG_VERSION"),
        if ready { "ok" } else { "bad" },
        escape(store),
        escape(reload),
    );
    match page {
        Some(p) => {
            let _ = writeln!(
        h,
        "<span>tenants with state: <b id=\"total\">{}</b></span><span>window: {}s</span></p>",
                p.total,
                p.window_s.round()
            );
        }
        None => h.push_str("</p>\n"),
    }
    h.push_str("<h2>Alerts firing</h2>\n");
    if alerts.is_empty() {
        h.push_str("<p class=\"muted\" id=\"alerts\">none</p>\n");
    } else {
        h.push_str("<ul id=\"alerts\">");
        for (tenant, alert, ratio, since) in alerts {
            let _ = write!(
                h,
                "<li class=\"bad\">{} on {}: shed ratio {:.2} since {}</li>",
                escape(alert),
                escape(tenant),
                ratio,
                escape(since)
            );
        }
        h.push_str("</ul>\n");
    }
    h.push_str("<h2>Tenants, most shed first</h2>\n");
    let Some(p) = page else {
        h.push_str("<p class=\"muted\">The live view needs telemetry, which is off ([telemetry] enabled = false).</p></body></html>\n");
        return h;
    };
    // 60 slots as the evaluator keeps them; bounded whatever the numbers say.
    let slots = if p.slot_s > 0.0 && p.window_s.is_finite() {
        (p.window_s / p.slot_s).round().clamp(2.0, 600.0) as usize
    } else {
        60
    };
    let _ = writeln!(
        h,
        "<p class=\"key muted\"><i class=\"a\">admitted</i> and <i class=\"s\">shed</i> calls per {}s over the last {}s</p>",
        p.slot_s,
        p.window_s.round()
    );
    if p.tenants.is_empty() {
        h.push_str("<p class=\"muted\" id=\"tenants\">No tenant made calls in the window.</p>\n");
    } else {
        h.push_str("<table id=\"tenants\"><thead><tr><th class=\"name\">tenant</th><th>shed %</th><th>admitted</th><th>shed</th><th class=\"name\">top shed scope</th><th>in flight</th><th class=\"name\">calls over the window</th></tr></thead><tbody>\n");
        for r in &p.tenants {
            let scope = match r.top_scope {
                Some(s) => format!("{s} ({})", r.top_scope_shed),
                None => "-".into(),
            };
            let _ = writeln!(
        h,
        "<tr class=\"tenant\" data-tenant=\"{name}\"><td class=\"name{alert}\">{name}</td><td>{:.1}</td><td>{}</td><td>{}</td><td class=\"name\">{}</td><td>{}</td><td class=\"name\">{}</td></tr>",
                r.shed_ratio * 100.0,
                r.admitted,
                r.shed,
                escape(&scope),
                r.inflight,
                chart(r, slots, p.slot_s),
                name = escape(&r.tenant),
                alert = if r.alerts.is_empty() { "" } else { " bad" },
            );
        }
        h.push_str("</tbody></table>\n");
        if p.total > p.tenants.len() {
            let _ = writeln!(
                h,
                "<p class=\"muted\">and {} more (GET /v1/tenants lists them all)</p>",
                p.total - p.tenants.len()
            );
        }
    }
    h.push_str("</body></html>\n");
    h
}

/// The store's state in words, and whether it answers.
fn store_state(app: &App) -> (String, bool) {
    match app.shared.store() {
        Store::Memory => ("memory".into(), true),
        Store::Redis(store) => {
            let (up, v) = store.readiness();
            (crate::top::store_state(&v), up)
        }
    }
}

/// The latest reload in words. `detailed`: with the reason a refused file gave, which quotes the
/// config (and so may name any tenant): not for a viewer limited to its own tenant.
fn reload_state(detailed: bool) -> String {
    match super::reload::last_reload() {
        None => "none since start".into(),
        Some(r) => match r.outcome {
            Ok(restart) if restart.is_empty() => format!("ok at {}", rfc3339(r.at_ms)),
            Ok(restart) => format!(
                "ok at {}; restart needed for {}",
                rfc3339(r.at_ms),
                restart.join(", ")
            ),
            Err(why) if detailed => format!("refused at {}: {why}", rfc3339(r.at_ms)),
            Err(_) => format!("refused at {}", rfc3339(r.at_ms)),
        },
    }
}

/// `GET /`.
pub async fn status_page(
    app: &Arc<App>,
    viewer: Viewer,
    head: &Head,
) -> Result<Response, ApiError> {
    let (sort, limit, after) = tenants::parse_query(head.query.as_deref(), PAGE_LIMIT)?;
    let only = match &viewer {
        Viewer::All => None,
        Viewer::Tenant(t) => Some(t.clone()),
    };
    let q = TenantsQuery {
        sort,
        limit,
        after,
        only: None,
        history: true,
    };
    let page = tenants::page(app, viewer, q).await.ok();
    let mut alerts = Vec::new();
    if let Some(render_alerts) = &app.alerts {
        let v = render_alerts();
        for a in v["alerts"].as_array().into_iter().flatten() {
            let tenant = a["tenant"].as_str().unwrap_or_default();
            if only.as_deref().is_some_and(|o| o != tenant) {
                continue;
            }
            alerts.push((
                tenant.to_string(),
                a["alert"].as_str().unwrap_or_default().to_string(),
                a["shed_ratio"].as_f64().unwrap_or_default(),
                a["since"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    let (store, ready) = store_state(app);
    let html = render(
        page.as_ref(),
        &store,
        ready,
        &reload_state(only.is_none()),
        &alerts,
    );
    let mut r = Response::new(html.into());
    let h = r.headers_mut();
    h.insert(
        warp::http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        warp::http::header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'; img-src data:"),
    );
    h.insert(
        warp::http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    h.insert(
        warp::http::header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    *r.status_mut() = StatusCode::OK;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, history: Vec<(f64, u64, u64)>) -> TenantRow {
        TenantRow {
            tenant: tenant.into(),
            shed_ratio: 0.5,
            admitted: 10,
            shed: 10,
            top_scope: Some("subject"),
            top_scope_shed: 10,
            inflight: 1,
            spend_left: None,
            alerts: vec!["shed_ratio_high"],
            history: Some(history),
        }
    }

    #[test]
    fn names_are_escaped() {
        assert_eq!(
            escape(r#"<script>"a" & 'b'</script>"#),
            "&lt;script&gt;&quot;a&quot; &amp; &#39;b&#39;&lt;/script&gt;"
        );
        let page = TenantsPage {
            tenants: vec![row("<img src=x>", vec![])],
            next: None,
            total: 1,
            window_s: 60.0,
            slot_s: 1.0,
        };
        let html = render(Some(&page), "memory", true, "none", &[]);
        assert!(!html.contains("<img"), "{html}");
        assert!(html.contains("&lt;img src=x&gt;"));
    }

    #[test]
    fn a_chart_has_a_point_per_slot_with_the_calls_where_they_fell() {
        // Slot 0 is the current one: 4 admitted 2 shed now, 8 admitted three slots back.
        let r = row("acme", vec![(3.0, 8, 0), (0.0, 4, 2)]);
        assert_eq!(series(&r, 5, 1.0, false), [0, 8, 0, 0, 4]);
        assert_eq!(series(&r, 5, 1.0, true), [0, 0, 0, 0, 2]);
        let svg = chart(&r, 5, 1.0);
        let points: Vec<&str> = svg
            .split("points=\"")
            .skip(1)
            .map(|s| &s[..s.find('"').unwrap()])
            .collect();
        assert_eq!(points.len(), 2);
        assert_eq!(points[0].split(' ').count(), 5);
        // The highest value touches the top margin, zero the bottom one.
        assert_eq!(points[0].split(' ').nth(1), Some("60.0,2.0"));
        assert_eq!(points[1].split(' ').next(), Some("0.0,34.0"));
        // Slots older than the window are left out rather than drawn off the chart.
        let old = row("old", vec![(9.0, 5, 5)]);
        assert_eq!(series(&old, 5, 1.0, false), [0; 5]);
    }

    #[test]
    fn the_page_shows_store_reload_alerts_and_each_tenant() {
        let page = TenantsPage {
            tenants: vec![row("looping", vec![(0.0, 1, 9)]), row("quiet", vec![])],
            next: None,
            total: 3,
            window_s: 300.0,
            slot_s: 5.0,
        };
        let alerts = vec![(
            "looping".to_string(),
            "shed_ratio_high".to_string(),
            0.9,
            "2026-10-21T07:28:00.000Z".to_string(),
        )];
        let html = render(Some(&page), "redis unreachable", false, "ok at x", &alerts);
        assert!(
            html.contains(r#"<b class="bad" id="store">redis unreachable</b>"#),
            "{html}"
        );
        assert!(html.contains("shed_ratio_high on looping"));
        assert!(
            html.contains(r#"data-tenant="looping""#) && html.contains(r#"data-tenant="quiet""#)
        );
        assert!(html.contains("and 1 more"));
        assert_eq!(html.matches("<polyline").count(), 4);
        // Nothing the page would have to fetch.
        for needle in ["<script", "src=", "href=", "url(", "@import"] {
            assert!(!html.contains(needle), "{needle}");
        }
        let off = render(None, "memory", true, "none since start", &[]);
        assert!(off.contains("telemetry, which is off"));
    }
}
