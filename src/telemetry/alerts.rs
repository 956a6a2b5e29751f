//! Per-tenant shed-ratio alerts, evaluated inside the daemon.
//!
//! Each tenant has a sliding window (`[alerts] window`, 60 slots) of admitted and shed calls; shadow
//! sheds count as sheds, so shadow mode predicts the alerts enforce mode would raise. An alert fires when
//! the ratio shed / (admitted + shed) stays above `shed_ratio` for `for`, with at least `min_calls` calls
//! in the window, and clears only when the ratio drops below `clear_ratio` (hysteresis, so a tenant
//! hovering at the threshold does not flap). The evaluator is plain data driven by `now` and is tested
//! with a fake clock; [`AlertActor`] feeds it and publishes the result: `GET /v1/alerts`, the
//! `admitd_tenant_shed_ratio` and `admitd_alert_firing` gauges, a log line on every change, and
//! optionally an Alertmanager `POST /api/v2/alerts`.
//!
//! The counts come from the tenant actors, which count the answers they give and report them once a
//! second with their gauges ([`super::CallCounts`]): the alert actor handles one report per tenant per
//! second rather than one event per call. A count would then be up to a second late for `GET
//! /v1/alerts`; a read of it has every tenant actor report at once and the rules evaluated again
//! first ([`super::Telemetry::refresh_alerts`]), so it includes every call answered before it.

use std::collections::VecDeque;

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use parking_lot::RwLock;
use serde::Serialize;

use super::names::{ALERT_FIRING, SHED_RATIO_ALERT, TENANT_SHED_RATIO};
use super::{Batch, CallCounts, Event, TenantEvent};
use crate::clock::{Clock, Nanos};
use crate::config::AlertsConfig;

const SLOTS: u64 = 60;

/// Admitted and shed counts over a sliding window, in 60 slots. Admitted counts are signed: a report
/// may take back an admission counted in an earlier slot (see [`super::CallCounts`]).
#[derive(Debug, Clone, Default)]
pub struct ShedWindow {
    slots: VecDeque<(u64, i64, u64)>,
}

impl ShedWindow {
    pub fn record(&mut self, slot: u64, calls: CallCounts) {
        match self.slots.back_mut() {
            Some(last) if last.0 == slot => {
                last.1 += calls.admitted;
                last.2 += calls.shed;
            }
            _ => self.slots.push_back((slot, calls.admitted, calls.shed)),
        }
    }

    /// The slots held, oldest first: (slot, admitted, shed). Slots without calls are absent.
    pub fn slots(&self) -> impl Iterator<Item = (u64, i64, u64)> + '_ {
        self.slots.iter().copied()
    }

    /// (admitted, shed) in the window ending at `slot`.
    pub fn totals(&mut self, slot: u64) -> (u64, u64) {
        while self.slots.front().is_some_and(|s| s.0 + SLOTS <= slot) {
            self.slots.pop_front();
        }
        let (admitted, shed) = self
            .slots
            .iter()
            .fold((0i64, 0u64), |(a, s), x| (a + x.1, s + x.2));
        (admitted.max(0) as u64, shed)
    }
}

/// One tenant's window and alert state, and what the live view ([`super::live`]) shows beside them.
#[derive(Debug, Clone, Default)]
pub(super) struct TenantAlert {
    pub(super) window: ShedWindow,
    /// As of the latest evaluation.
    pub(super) ratio: f64,
    pub(super) calls: u64,
    pub(super) admitted: u64,
    pub(super) shed: u64,
    /// Calls in flight at the tenant's latest report.
    pub(super) inflight: u32,
    /// What each unit's tenant daily budget had left at the tenant's latest report (units with
    /// such a budget only).
    pub(super) spend_left: Vec<(Arc<str>, f64)>,
    pub(super) scopes: super::live::ScopeWindow,
    pending_since: Option<Nanos>,
    pub(super) firing_since_ms: Option<i64>,
}

impl TenantAlert {
    /// Whether the tenant has anything to show in the live view.
    fn live(&self) -> bool {
        self.calls > 0 || self.inflight > 0 || self.firing_since_ms.is_some()
    }
}

/// A firing alert, as `GET /v1/alerts` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FiringAlert {
    pub tenant: String,
    pub alert: &'static str,
    pub shed_ratio: f64,
    /// RFC 3339, UTC.
    pub since: String,
}

/// A change of alert state.
#[derive(Debug, Clone, PartialEq)]
pub enum AlertChange {
    Fired {
        tenant: Arc<str>,
        ratio: f64,
        since_ms: i64,
    },
    Cleared {
        tenant: Arc<str>,
        ratio: f64,
    },
}

/// The alert rules, as plain data.
#[derive(Debug)]
pub struct AlertEvaluator {
    cfg: AlertsConfig,
    tenants: HashMap<Arc<str>, TenantAlert>,
}

impl AlertEvaluator {
    pub fn new(cfg: AlertsConfig) -> Self {
        AlertEvaluator {
            cfg,
            tenants: HashMap::default(),
        }
    }

    pub fn set_config(&mut self, cfg: AlertsConfig) {
        self.cfg = cfg;
    }

    fn slot(&self, now: Nanos) -> u64 {
        now / self.slot_ns()
    }

    fn slot_ns(&self) -> u64 {
        (self.cfg.window.as_nanos() as u64 / SLOTS).max(1)
    }

    pub(super) fn slot_of(&self, now: Nanos) -> u64 {
        self.slot(now)
    }

    pub(super) fn slot_seconds(&self) -> f64 {
        self.slot_ns() as f64 / 1e9
    }

    pub(super) fn window_slots(&self) -> u64 {
        SLOTS
    }

    /// The tenants the live view shows.
    pub(super) fn live_entries(&self) -> impl Iterator<Item = (&Arc<str>, &TenantAlert)> {
        self.tenants.iter().filter(|(_, t)| t.live())
    }

    pub(super) fn live_entry_mut(&mut self, tenant: &str) -> Option<&mut TenantAlert> {
        self.tenants.get_mut(tenant)
    }

    /// Notes a tenant's calls in flight from its report (a tenant with calls in flight and none
    /// answered in the window is still shown).
    pub fn set_inflight(&mut self, tenant: &Arc<str>, inflight: u32) {
        match self.tenants.get_mut(tenant) {
            Some(t) => t.inflight = inflight,
            None if inflight == 0 => {}
            None => {
                self.tenants.insert(
                    tenant.clone(),
                    TenantAlert {
                        inflight,
                        ..TenantAlert::default()
                    },
                );
            }
        }
    }

    /// Notes what each unit's tenant daily budget has left, from the tenant's report. Only a tenant
    /// the view holds keeps it: spend left alone does not put a tenant at rest in the view.
    pub fn set_spend_left<'a>(
        &mut self,
        tenant: &Arc<str>,
        left: impl Iterator<Item = (&'a Arc<str>, f64)>,
    ) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.spend_left.clear();
            t.spend_left.extend(left.map(|(u, x)| (u.clone(), x)));
        }
    }

    /// Counts one shed (or shadow-shed) call of `tenant` by its scope, for the live view.
    pub fn record_shed(&mut self, tenant: &Arc<str>, scope: crate::engine::Scope, now: Nanos) {
        let slot = self.slot(now);
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.scopes.record(slot, scope, SLOTS);
        } else {
            let mut t = TenantAlert::default();
            t.scopes.record(slot, scope, SLOTS);
            self.tenants.insert(tenant.clone(), t);
        }
    }

    /// Adds a tenant's calls answered since its previous report.
    pub fn record(&mut self, tenant: &Arc<str>, calls: CallCounts, now: Nanos) {
        let slot = self.slot(now);
        match self.tenants.get_mut(tenant) {
            Some(t) => t.window.record(slot, calls),
            None if calls == CallCounts::default() => {}
            None => {
                let mut t = TenantAlert::default();
                t.window.record(slot, calls);
                self.tenants.insert(tenant.clone(), t);
            }
        }
    }

    /// Re-evaluates every tenant; returns what changed.
    pub fn evaluate(&mut self, now: Nanos, wall_ms: i64) -> Vec<AlertChange> {
        let slot = self.slot(now);
        let cfg = &self.cfg;
        let hold = cfg.for_.as_nanos() as u64;
        let mut changes = Vec::new();
        for (name, t) in &mut self.tenants {
            let (admitted, shed) = t.window.totals(slot);
            (t.admitted, t.shed) = (admitted, shed);
            t.calls = admitted + shed;
            t.ratio = if t.calls == 0 {
                0.0
            } else {
                shed as f64 / t.calls as f64
            };
            if t.firing_since_ms.is_some() {
                if t.ratio < cfg.clear_ratio {
                    t.firing_since_ms = None;
                    t.pending_since = None;
                    changes.push(AlertChange::Cleared {
                        tenant: name.clone(),
                        ratio: t.ratio,
                    });
                }
            } else if t.calls >= cfg.min_calls && t.ratio > cfg.shed_ratio {
                let since = *t.pending_since.get_or_insert(now);
                if now.saturating_sub(since) >= hold {
                    t.firing_since_ms = Some(wall_ms);
                    changes.push(AlertChange::Fired {
                        tenant: name.clone(),
                        ratio: t.ratio,
                        since_ms: wall_ms,
                    });
                }
            } else {
                t.pending_since = None;
            }
        }
        changes
    }

    /// Forgets tenants with an empty window and no alert.
    pub fn prune(&mut self) {
        self.tenants
            .retain(|_, t| t.calls > 0 || t.firing_since_ms.is_some() || t.inflight > 0);
    }

    pub fn firing(&self) -> Vec<FiringAlert> {
        let mut v: Vec<_> = self
            .tenants
            .iter()
            .filter_map(|(name, t)| {
                t.firing_since_ms.map(|since| FiringAlert {
                    tenant: name.to_string(),
                    alert: SHED_RATIO_ALERT,
                    shed_ratio: (t.ratio * 1000.0).round() / 1000.0,
                    since: rfc3339(since),
                })
            })
            .collect();
        v.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        v
    }

    /// (tenant, shed ratio over the window, calls in the window, firing).
    pub fn ratios(&self) -> Vec<(Arc<str>, f64, u64, bool)> {
        self.tenants
            .iter()
            .map(|(n, t)| (n.clone(), t.ratio, t.calls, t.firing_since_ms.is_some()))
            .collect()
    }
}

/// Formats Unix milliseconds as RFC 3339 UTC (`2026-10-21T07:28:00.000Z`).
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

/// The alerts firing now, shared with the HTTP layer.
pub type FiringList = Arc<RwLock<Vec<FiringAlert>>>;

/// One tenant's alert gauges.
struct AlertGauges {
    shed_ratio: metrics::Gauge,
    firing: metrics::Gauge,
}

impl AlertGauges {
    fn of(tenant: &str) -> Self {
        AlertGauges {
            shed_ratio: metrics::gauge!(TENANT_SHED_RATIO, "tenant" => tenant.to_string()),
            firing: metrics::gauge!(ALERT_FIRING, "tenant" => tenant.to_string(), "alert" => SHED_RATIO_ALERT),
        }
    }
}

/// Feeds decisions to the evaluator and publishes its results.
pub struct AlertActor {
    evaluator: AlertEvaluator,
    clock: Arc<dyn Clock>,
    firing: FiringList,
    alertmanager: Option<String>,
    /// Tenants whose gauges were set, with their handles (a registry lookup builds and hashes the
    /// labels; a handle is one store). A tenant stays in the evaluator, and its gauges are set every
    /// tick (the shed ratio to 0 once its window is empty), until [`AlertEvaluator::prune`] forgets
    /// it; its gauges are then set to zero once more and not touched again.
    exported: HashMap<Arc<str>, AlertGauges>,
    ticks: u64,
}

impl AlertActor {
    pub fn new(cfg: AlertsConfig, clock: Arc<dyn Clock>, firing: FiringList) -> Self {
        let alertmanager = cfg.alertmanager_url.clone();
        AlertActor {
            evaluator: AlertEvaluator::new(cfg),
            clock,
            firing,
            alertmanager,
            exported: HashMap::default(),
            ticks: 0,
        }
    }

    /// Adds the call counts of the tenant reports among `events`.
    fn record_batch(&mut self, events: &[Event]) {
        let now = self.clock.mono();
        for ev in events {
            match ev {
                Event::Tenant(t) => match &**t {
                    TenantEvent::Gauges {
                        tenant,
                        calls,
                        gauges,
                    } => {
                        self.evaluator.record(tenant, *calls, now);
                        self.evaluator.set_inflight(tenant, gauges.inflight);
                        self.evaluator.set_spend_left(
                            tenant,
                            gauges.spend_daily_left().map(|(u, left, _)| (u, left)),
                        );
                    }
                    TenantEvent::Calls { tenant, calls } => {
                        self.evaluator.record(tenant, *calls, now);
                    }
                    _ => {}
                },
                Event::Decision(d) => {
                    if let Some(scope) = d.scope {
                        self.evaluator.record_shed(&d.tenant, scope, now);
                    }
                }
                _ => {}
            }
        }
    }

    /// Evaluates the rules and publishes the result (gauges, firing list, log lines and pushes of
    /// changes). Also run on demand, between ticks: the rules depend on the time a ratio has held,
    /// not on how often they are evaluated.
    fn evaluate(&mut self) -> i64 {
        let now = self.clock.mono();
        let wall = self.clock.wall_ms();
        for change in self.evaluator.evaluate(now, wall) {
            match &change {
                AlertChange::Fired { tenant, ratio, .. } => {
                    tracing::warn!(target: "admitd::alerts", alert = SHED_RATIO_ALERT, tenant = %tenant, shed_ratio = ratio, "alert firing");
                }
                AlertChange::Cleared { tenant, ratio } => {
                    tracing::info!(target: "admitd::alerts", alert = SHED_RATIO_ALERT, tenant = %tenant, shed_ratio = ratio, "alert cleared");
                }
            }
            if let Some(url) = &self.alertmanager {
                push_alertmanager(url.clone(), &change, wall);
            }
        }
        let mut seen = HashMap::with_capacity_and_hasher(self.exported.len(), Default::default());
        for (tenant, ratio, _, firing) in self.evaluator.ratios() {
            let gauges = self
                .exported
                .remove(&tenant)
                .unwrap_or_else(|| AlertGauges::of(&tenant));
            // Every tick, also once the window is empty (ratio 0): the gauge is the ratio over the
            // window, not the last one seen with calls in it.
            gauges.shed_ratio.set(ratio);
            gauges.firing.set(if firing { 1.0 } else { 0.0 });
            seen.insert(tenant, gauges);
        }
        for gone in self.exported.values() {
            gone.firing.set(0.0);
            gone.shed_ratio.set(0.0);
        }
        self.exported = seen;
        *self.firing.write() = self.evaluator.firing();
        wall
    }

    /// One page of the live view, now.
    pub(super) fn page(&mut self, q: &super::live::TenantsQuery) -> super::live::TenantsPage {
        let now = self.clock.mono();
        self.evaluator.page(q, now)
    }

    fn tick(&mut self) {
        let wall = self.evaluate();
        // Alertmanager forgets alerts that are not re-sent; repeat firing ones every minute.
        self.ticks += 1;
        if self.ticks % 60 == 0 {
            if let Some(url) = &self.alertmanager {
                for a in self.firing.read().iter() {
                    let change = AlertChange::Fired {
                        tenant: Arc::from(a.tenant.as_str()),
                        ratio: a.shed_ratio,
                        since_ms: wall,
                    };
                    push_alertmanager(url.clone(), &change, wall);
                }
            }
            self.evaluator.prune();
        }
    }
}

impl Actor for AlertActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(super::MAILBOX);
        ctx.run_interval(Duration::from_secs(1), |act, _| act.tick());
    }
}

impl Handler<Batch> for AlertActor {
    type Result = ();

    fn handle(&mut self, batch: Batch, _: &mut Context<Self>) {
        self.record_batch(&batch.0);
    }
}

impl Handler<super::Settle> for AlertActor {
    type Result = ();

    fn handle(&mut self, _: super::Settle, _: &mut Context<Self>) {}
}

/// Evaluate the rules now, with every report received so far (a read of `GET /v1/alerts`).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Evaluate;

impl Handler<Evaluate> for AlertActor {
    type Result = ();

    fn handle(&mut self, _: Evaluate, _: &mut Context<Self>) {
        self.evaluate();
    }
}

/// Reconfigure the alert rules (reload).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetAlerts(pub AlertsConfig);

impl Handler<SetAlerts> for AlertActor {
    type Result = ();
    fn handle(&mut self, msg: SetAlerts, _: &mut Context<Self>) {
        self.alertmanager = msg.0.alertmanager_url.clone();
        self.evaluator.set_config(msg.0);
    }
}

/// The Alertmanager v2 body for one change.
pub fn alertmanager_body(change: &AlertChange, wall_ms: i64) -> serde_json::Value {
    let (tenant, ratio, starts, ends) = match change {
        AlertChange::Fired {
            tenant,
            ratio,
            since_ms,
        } => (tenant, *ratio, *since_ms, None),
        AlertChange::Cleared { tenant, ratio } => (tenant, *ratio, wall_ms, Some(wall_ms)),
    };
    let mut alert = serde_json::json!({
        "labels": {"alertname": "AdmitdTenantShedRatioHigh", "alert": SHED_RATIO_ALERT, "tenant": &**tenant, "severity": "warning", "source": "admitd"},
        "annotations": {
            "summary": format!("admitd is shedding {:.0}% of tenant {tenant}'s calls", ratio * 100.0),
            "description": "The tenant's shed ratio over the alert window is above the configured threshold; see docs/operations.md.",
        },
        "startsAt": rfc3339(starts),
    });
    if let Some(end) = ends {
        alert["endsAt"] = serde_json::Value::String(rfc3339(end));
    }
    serde_json::Value::Array(vec![alert])
}

/// Posts one change to `{url}/api/v2/alerts` on a short-lived thread (plain HTTP/1.1, 2 s timeouts), so a
/// slow or absent Alertmanager never holds up the actor.
fn push_alertmanager(url: String, change: &AlertChange, wall_ms: i64) {
    let body = alertmanager_body(change, wall_ms).to_string();
    std::thread::spawn(move || {
        if let Err(e) = post_json(&url, "/api/v2/alerts", &body) {
            tracing::warn!(target: "admitd::alerts", error = %e, url = %url, "could not push the alert to Alertmanager");
        }
    });
}

fn post_json(base: &str, path: &str, body: &str) -> Result<u16, String> {
    let rest = base
        .strip_prefix("http://")
        .ok_or("only http:// Alertmanager URLs are supported")?;
    let (hostport, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    use std::net::ToSocketAddrs;
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or("no address")?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "POST {prefix}{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut head = [0u8; 64];
    let n = s.read(&mut head).map_err(|e| e.to_string())?;
    let line = String::from_utf8_lossy(&head[..n]);
    let code = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no HTTP status in the answer")?;
    if (200..300).contains(&code) {
        Ok(code)
    } else {
        Err(format!("Alertmanager answered {code}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{FakeClock, NS_PER_SEC};
    use crate::telemetry::series_value as value;

    fn cfg() -> AlertsConfig {
        AlertsConfig {
            shed_ratio: 0.5,
            window: Duration::from_secs(300),
            for_: Duration::from_secs(60),
            min_calls: 100,
            clear_ratio: 0.4,
            alertmanager_url: None,
        }
    }

    fn feed(e: &mut AlertEvaluator, t: &Arc<str>, now: Nanos, admitted: u64, shed: u64) {
        // In several reports, as tenant actors send them.
        for (a, s) in [
            (admitted / 2, shed / 2),
            (admitted - admitted / 2, shed - shed / 2),
        ] {
            let calls = CallCounts {
                admitted: a as i64,
                shed: s,
            };
            e.record(t, calls, now);
        }
    }

    const WALL: i64 = 1_792_567_650_000;

    #[test]
    fn fires_after_for_and_clears_with_hysteresis() {
        let mut e = AlertEvaluator::new(cfg());
        let t: Arc<str> = Arc::from("initech");
        let quiet: Arc<str> = Arc::from("acme");
        feed(&mut e, &t, 0, 20, 80);
        feed(&mut e, &quiet, 0, 100, 0);
        assert!(e.evaluate(0, WALL).is_empty(), "pending, not firing yet");
        assert!(e.evaluate(59 * NS_PER_SEC, WALL).is_empty());
        let fired = e.evaluate(60 * NS_PER_SEC, WALL + 60_000);
        assert_eq!(
            fired,
            vec![AlertChange::Fired {
                tenant: t.clone(),
                ratio: 0.8,
                since_ms: WALL + 60_000
            }]
        );
        let firing = e.firing();
        assert_eq!(firing.len(), 1);
        assert_eq!(firing[0].tenant, "initech");
        assert_eq!(firing[0].shed_ratio, 0.8);
        assert_eq!(firing[0].since, "2026-10-21T07:28:30.000Z");
        // 45% is below the threshold but above clear_ratio: still firing
        feed(&mut e, &t, 61 * NS_PER_SEC, 78, 0);
        assert!(e.evaluate(61 * NS_PER_SEC, WALL).is_empty());
        assert_eq!(e.firing().len(), 1);
        // below clear_ratio: cleared
        feed(&mut e, &t, 62 * NS_PER_SEC, 100, 0);
        let cleared = e.evaluate(62 * NS_PER_SEC, WALL);
        assert!(
            matches!(&cleared[..], [AlertChange::Cleared { .. }]),
            "{cleared:?}"
        );
        assert!(e.firing().is_empty());
    }

    #[test]
    fn needs_min_calls_and_a_sustained_ratio() {
        let mut e = AlertEvaluator::new(cfg());
        let t: Arc<str> = Arc::from("t");
        feed(&mut e, &t, 0, 0, 99);
        assert!(e.evaluate(0, WALL).is_empty());
        assert!(
            e.evaluate(120 * NS_PER_SEC, WALL).is_empty(),
            "99 calls < min_calls"
        );
        // a spike that does not last `for` does not fire
        let mut e = AlertEvaluator::new(cfg());
        feed(&mut e, &t, 0, 0, 200);
        e.evaluate(0, WALL);
        feed(&mut e, &t, 30 * NS_PER_SEC, 500, 0);
        assert!(e.evaluate(30 * NS_PER_SEC, WALL).is_empty());
        assert!(e.evaluate(90 * NS_PER_SEC, WALL).is_empty());
    }

    #[test]
    fn the_window_slides() {
        let mut e = AlertEvaluator::new(AlertsConfig {
            for_: Duration::ZERO,
            ..cfg()
        });
        let t: Arc<str> = Arc::from("t");
        feed(&mut e, &t, 0, 0, 200);
        assert_eq!(e.evaluate(0, WALL).len(), 1);
        // five minutes later the sheds have left the window: ratio 0, cleared
        let later = 301 * NS_PER_SEC;
        let c = e.evaluate(later, WALL);
        assert!(
            matches!(&c[..], [AlertChange::Cleared { ratio, .. }] if *ratio == 0.0),
            "{c:?}"
        );
        e.prune();
        assert!(e.ratios().is_empty());
    }

    /// A tenant actor's report of the calls it answered since its previous one.
    fn report(tenant: &str, admitted: i64, shed: u64) -> Event {
        Event::Tenant(Arc::new(TenantEvent::Gauges {
            tenant: Arc::from(tenant),
            gauges: Default::default(),
            calls: CallCounts { admitted, shed },
        }))
    }

    #[test]
    fn the_shed_ratio_gauge_goes_to_zero_when_the_calls_leave_the_window() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let clock = FakeClock::new(WALL);
        let cfg = AlertsConfig {
            window: Duration::from_secs(10),
            for_: Duration::from_secs(1),
            min_calls: 5,
            ..cfg()
        };
        let ratio = |text: &str, tenant: &str| {
            value(
                text,
                &format!("admitd_tenant_shed_ratio{{tenant=\"{tenant}\"}}"),
            )
        };
        let firing = |text: &str, tenant: &str| {
            value(
                text,
                &format!("admitd_alert_firing{{tenant=\"{tenant}\",alert=\"shed_ratio_high\"}}"),
            )
        };
        metrics::with_local_recorder(&recorder, || {
            let mut a = AlertActor::new(cfg, Arc::new(clock.clone()), FiringList::default());
            // initech: 20 calls, 17 shed, then nothing; acme: too few calls to fire, two seconds later.
            a.record_batch(&[report("initech", 3, 17)]);
            a.tick();
            clock.advance(Duration::from_secs(2));
            a.record_batch(&[report("acme", 3, 1)]);
            for s in 2..=14 {
                a.tick();
                let text = handle.render();
                let (initech, acme) = if s < 10 {
                    (0.85, 0.25)
                } else if s < 12 {
                    (0.0, 0.25)
                } else {
                    (0.0, 0.0)
                };
                assert_eq!(ratio(&text, "initech"), Some(initech), "at {s} s:\n{text}");
                assert_eq!(ratio(&text, "acme"), Some(acme), "at {s} s:\n{text}");
                let fires = if s < 10 { 1.0 } else { 0.0 };
                assert_eq!(firing(&text, "initech"), Some(fires), "at {s} s:\n{text}");
                assert_eq!(firing(&text, "acme"), Some(0.0), "at {s} s:\n{text}");
                // The gauge says what the evaluation saw at the same tick.
                for (tenant, r, calls, _) in a.evaluator.ratios() {
                    assert_eq!(ratio(&text, &tenant), Some(r), "{tenant} at {s} s");
                    assert_eq!(calls == 0, r == 0.0, "{tenant} at {s} s");
                }
                clock.advance(Duration::from_secs(1));
            }
        });
    }

    #[test]
    fn rfc3339_formatting() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(WALL), "2026-10-21T07:27:30.000Z");
    }

    #[test]
    fn alertmanager_bodies() {
        let t: Arc<str> = Arc::from("initech");
        let fired = alertmanager_body(
            &AlertChange::Fired {
                tenant: t.clone(),
                ratio: 0.93,
                since_ms: WALL,
            },
            WALL,
        );
        assert_eq!(fired[0]["labels"]["tenant"], "initech");
        assert_eq!(fired[0]["startsAt"], "2026-10-21T07:27:30.000Z");
        assert!(fired[0].get("endsAt").is_none());
        let cleared = alertmanager_body(
            &AlertChange::Cleared {
                tenant: t,
                ratio: 0.1,
            },
            WALL,
        );
        assert_eq!(cleared[0]["endsAt"], "2026-10-21T07:27:30.000Z");
    }
}
