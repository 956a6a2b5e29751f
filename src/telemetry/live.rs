//! The live view of every tenant (`GET /v1/tenants`, `admitd top`, the status page at `GET /`),
//! read from the alert actor's per-tenant windows rather than from the tenant actors.
//!
//! The alert actor already keeps, for every tenant that made calls in the alert window, a sliding
//! window of admitted and shed calls (60 slots over `[alerts] window`), updated by one report per
//! tenant per second. This module adds what the view needs beside it, in the same entry: the sheds of
//! that window by scope ([`ScopeWindow`]) and the calls in flight from the tenant's latest report.
//! A page is then one pass over the evaluator's table on the telemetry thread: no tenant actor is
//! asked, so a read costs the same whether the tenants' actors are busy or not, and with 100 000
//! tenants it is a linear selection, not a sort of them all (see [`AlertEvaluator::page`]).
//!
//! What it shows is as of the tenants' latest reports (at most a second old), and only tenants that
//! made calls in the window, hold calls in flight or have an alert firing: a tenant at rest holds no
//! state worth listing. The per-tenant history the status page charts is the alert window's slots
//! themselves (at most 60 per tenant), so the view holds no history of its own.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use actix::prelude::*;
use serde::Serialize;

use super::alerts::{AlertActor, AlertEvaluator};
use super::names::SHED_RATIO_ALERT;
use crate::clock::Nanos;
use crate::engine::Scope;

/// Sheds of one tenant over the alert window, by scope: `(slot, scope, count)`, merged per slot
/// and scope. At most 60 slots × 10 scopes entries, and in practice a few per slot.
#[derive(Debug, Clone, Default)]
pub struct ScopeWindow {
    entries: VecDeque<(u64, Scope, u32)>,
}

impl ScopeWindow {
    pub fn record(&mut self, slot: u64, scope: Scope, window_slots: u64) {
        // Entries of the current slot are at the back.
        for e in self.entries.iter_mut().rev() {
            if e.0 != slot {
                break;
            }
            if e.1 == scope {
                e.2 = e.2.saturating_add(1);
                return;
            }
        }
        self.entries.push_back((slot, scope, 1));
        self.drop_before(slot, window_slots);
    }

    fn drop_before(&mut self, slot: u64, window_slots: u64) {
        while self
            .entries
            .front()
            .is_some_and(|e| e.0 + window_slots <= slot)
        {
            self.entries.pop_front();
        }
    }

    /// The scope that shed the most calls in the window ending at `slot`, with its count; a tie goes
    /// to the scope listed first in [`Scope::ALL`] (the narrower one), so the answer is stable.
    pub fn top(&mut self, slot: u64, window_slots: u64) -> Option<(Scope, u64)> {
        self.drop_before(slot, window_slots);
        let mut counts = [0u64; Scope::ALL.len()];
        for e in &self.entries {
            if let Some(i) = Scope::ALL.iter().position(|s| *s == e.1) {
                counts[i] += u64::from(e.2);
            }
        }
        let (i, n) =
            counts.iter().enumerate().fold(
                (0, 0),
                |best, (i, n)| if *n > best.1 { (i, *n) } else { best },
            );
        (n > 0).then(|| (Scope::ALL[i], n))
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What a page of the view is sorted by. Every field sorts largest first except `tenant`; ties go
/// by tenant name, so the order is total and a cursor names one place in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortField {
    ShedRatio,
    Shed,
    Admitted,
    Calls,
    Inflight,
    Tenant,
}

impl SortField {
    /// The `sort=` values, as documented.
    pub const ALL: [SortField; 6] = [
        SortField::ShedRatio,
        SortField::Shed,
        SortField::Admitted,
        SortField::Calls,
        SortField::Inflight,
        SortField::Tenant,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SortField::ShedRatio => "shed_ratio",
            SortField::Shed => "shed",
            SortField::Admitted => "admitted",
            SortField::Calls => "calls",
            SortField::Inflight => "inflight",
            SortField::Tenant => "tenant",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.as_str() == s)
    }
}

/// A place in the order: the sort key of the last tenant of a page and its name. Sent to the
/// client as `next`: 16 hex digits of the key's bits, a dot, and the name's bytes in hex, so any
/// tenant name survives a query string. Every string of that shape is a place in the order (the
/// name's bytes are compared as bytes, which orders UTF-8 as its text), so none is refused for
/// what it holds; the order it continues is the request's `sort`.
#[derive(Debug, Clone, PartialEq)]
pub struct Cursor {
    pub key: f64,
    pub tenant: Vec<u8>,
}

impl Cursor {
    pub fn encode(&self) -> String {
        let mut s = format!("{:016x}.", self.key.to_bits());
        for b in &self.tenant {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    pub fn decode(s: &str) -> Option<Cursor> {
        let (key, hex) = s.split_once('.')?;
        let hexdigits = |t: &str| t.bytes().all(|b| b.is_ascii_hexdigit());
        if key.len() != 16 || !hexdigits(key) || hex.len() % 2 != 0 || !hexdigits(hex) {
            return None;
        }
        let key = f64::from_bits(u64::from_str_radix(key, 16).ok()?);
        let tenant = hex
            .as_bytes()
            .chunks(2)
            .map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        Some(Cursor { key, tenant })
    }
}

/// One page of the view, as asked.
#[derive(Debug, Clone, Message)]
#[rtype(result = "TenantsPage")]
pub struct TenantsQuery {
    pub sort: SortField,
    pub limit: usize,
    pub after: Option<Cursor>,
    /// Only this tenant (a caller that may see only its own).
    pub only: Option<String>,
    /// Add each tenant's admitted and shed calls per slot of the window (the status page's charts).
    pub history: bool,
}

/// One tenant in the view.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantRow {
    pub tenant: String,
    /// shed / (admitted + shed) over the alert window; shadow sheds count as sheds.
    pub shed_ratio: f64,
    pub admitted: u64,
    pub shed: u64,
    /// The scope that shed most of this tenant's calls in the window, and how many.
    pub top_scope: Option<&'static str>,
    pub top_scope_shed: u64,
    /// Calls in flight at the tenant's latest report.
    pub inflight: u32,
    /// The alerts firing for this tenant now.
    pub alerts: Vec<&'static str>,
    /// Per spend unit with a `tenant_daily` budget, what that budget has left today (UTC; below
    /// zero when overspent), as of the tenant's latest report like `inflight`. Absent when no unit
    /// has such a budget for this tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spend_left: Option<BTreeMap<String, f64>>,
    /// `(seconds before now, admitted, shed)` per slot of the window, oldest first; only when asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history: Option<Vec<(f64, u64, u64)>>,
}

/// A page of the view and where the next one starts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantsPage {
    pub tenants: Vec<TenantRow>,
    pub next: Option<Cursor>,
    /// Tenants in the view (of those the caller may see), over all pages.
    pub total: usize,
    pub window_s: f64,
    pub slot_s: f64,
}

impl<A, M> actix::dev::MessageResponse<A, M> for TenantsPage
where
    A: Actor,
    M: Message<Result = TenantsPage>,
{
    fn handle(self, _: &mut A::Context, tx: Option<actix::dev::OneshotSender<TenantsPage>>) {
        if let Some(tx) = tx {
            let _ = tx.send(self);
        }
    }
}

/// A figure without the float noise of sums (4.970000000000001 is 4.97), as admissions show spend.
fn clean(x: f64) -> f64 {
    let r = (x * 1e9).round() / 1e9;
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

/// Orders two tenants in the view: larger key first, then by name (as bytes).
fn order(a: (f64, &[u8]), b: (f64, &[u8])) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1))
}

impl AlertEvaluator {
    /// One page of the view at monotonic time `now`. Cost: one pass over the tenants to pick those
    /// after the cursor with their sort key, a linear selection of the `limit` first, and a sort of
    /// those only: O(tenants + limit log limit).
    pub fn page(&mut self, q: &TenantsQuery, now: Nanos) -> TenantsPage {
        let slot = self.slot_of(now);
        let window_slots = self.window_slots();
        let slot_s = self.slot_seconds();
        let only = q.only.as_deref();
        let after = q.after.as_ref();
        let mut total = 0usize;
        let mut picked: Vec<(f64, &Arc<str>)> = self
            .live_entries()
            .filter(|(name, _)| only.is_none_or(|o| o == &***name))
            .inspect(|_| total += 1)
            .map(|(name, t)| {
                let key = match q.sort {
                    SortField::ShedRatio => t.ratio,
                    SortField::Shed => t.shed as f64,
                    SortField::Admitted => t.admitted as f64,
                    SortField::Calls => t.calls as f64,
                    SortField::Inflight => f64::from(t.inflight),
                    SortField::Tenant => 0.0,
                };
                (key, name)
            })
            .filter(|(key, name)| {
                after.is_none_or(|c| {
                    order((*key, name.as_bytes()), (c.key, &c.tenant))
                        == std::cmp::Ordering::Greater
                })
            })
            .collect();
        let limit = q.limit.max(1);
        let more = picked.len() > limit;
        if more {
            picked.select_nth_unstable_by(limit - 1, |a, b| {
                order((a.0, a.1.as_bytes()), (b.0, b.1.as_bytes()))
            });
            picked.truncate(limit);
        }
        picked.sort_unstable_by(|a, b| order((a.0, a.1.as_bytes()), (b.0, b.1.as_bytes())));
        let next = more
            .then(|| picked.last())
            .flatten()
            .map(|(key, name)| Cursor {
                key: *key,
                tenant: name.as_bytes().to_vec(),
            });
        let names: Vec<Arc<str>> = picked.into_iter().map(|(_, n)| n.clone()).collect();
        let tenants = names
            .iter()
            .filter_map(|name| {
                let t = self.live_entry_mut(name)?;
                let top = t.scopes.top(slot, window_slots);
                let history = q.history.then(|| {
                    t.window
                        .slots()
                        .map(|(s, a, sh)| {
                            let ago = slot.saturating_sub(s) as f64 * slot_s;
                            (ago, a.max(0) as u64, sh)
                        })
                        .collect()
                });
                Some(TenantRow {
                    tenant: name.to_string(),
                    shed_ratio: (t.ratio * 1000.0).round() / 1000.0,
                    admitted: t.admitted,
                    shed: t.shed,
                    top_scope: top.map(|(s, _)| s.as_str()),
                    top_scope_shed: top.map_or(0, |(_, n)| n),
                    inflight: t.inflight,
                    spend_left: (!t.spend_left.is_empty()).then(|| {
                        t.spend_left
                            .iter()
                            .map(|(u, x)| (u.to_string(), clean(*x)))
                            .collect()
                    }),
                    alerts: if t.firing_since_ms.is_some() {
                        vec![SHED_RATIO_ALERT]
                    } else {
                        Vec::new()
                    },
                    history,
                })
            })
            .collect();
        TenantsPage {
            tenants,
            next,
            total,
            window_s: slot_s * window_slots as f64,
            slot_s,
        }
    }
}

impl Handler<TenantsQuery> for AlertActor {
    type Result = TenantsPage;

    fn handle(&mut self, q: TenantsQuery, _: &mut Context<Self>) -> TenantsPage {
        self.page(&q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AlertsConfig;
    use crate::telemetry::CallCounts;
    use std::time::Duration;

    const SEC: Nanos = 1_000_000_000;

    fn evaluator() -> AlertEvaluator {
        AlertEvaluator::new(AlertsConfig {
            shed_ratio: 0.5,
            window: Duration::from_secs(60),
            for_: Duration::from_secs(0),
            min_calls: 10,
            clear_ratio: 0.4,
            alertmanager_url: None,
        })
    }

    fn feed(e: &mut AlertEvaluator, tenant: &str, admitted: i64, shed: u64, now: Nanos) {
        e.record(&Arc::from(tenant), CallCounts { admitted, shed }, now);
    }

    fn query(sort: SortField, limit: usize, after: Option<Cursor>) -> TenantsQuery {
        TenantsQuery {
            sort,
            limit,
            after,
            only: None,
            history: false,
        }
    }

    fn names(p: &TenantsPage) -> Vec<&str> {
        p.tenants.iter().map(|r| r.tenant.as_str()).collect()
    }

    /// Four tenants: quiet (no sheds), half (50%), looping (90%, an alert), busy (10% of many).
    fn four() -> AlertEvaluator {
        let mut e = evaluator();
        let now = 10 * SEC;
        feed(&mut e, "quiet", 5, 0, now);
        feed(&mut e, "half", 10, 10, now);
        feed(&mut e, "looping", 10, 90, now);
        feed(&mut e, "busy", 900, 100, now);
        e.set_inflight(&Arc::from("busy"), 7);
        e.evaluate(now, 0);
        e
    }

    #[test]
    fn most_shed_first_by_default_and_by_any_documented_field() {
        let mut e = four();
        let p = e.page(&query(SortField::ShedRatio, 10, None), 10 * SEC);
        assert_eq!(names(&p), ["looping", "half", "busy", "quiet"]);
        assert_eq!(p.total, 4);
        assert_eq!(p.next, None);
        let looping = &p.tenants[0];
        assert_eq!(
            (looping.admitted, looping.shed, looping.shed_ratio),
            (10, 90, 0.9)
        );
        assert_eq!(looping.alerts, vec![SHED_RATIO_ALERT]);
        assert!(p.tenants[3].alerts.is_empty());
        let order =
            |e: &mut AlertEvaluator, f| names(&e.page(&query(f, 10, None), 10 * SEC)).join(",");
        assert_eq!(order(&mut e, SortField::Shed), "busy,looping,half,quiet");
        assert_eq!(
            order(&mut e, SortField::Admitted),
            "busy,half,looping,quiet"
        );
        assert_eq!(order(&mut e, SortField::Calls), "busy,looping,half,quiet");
        // Ties (no calls in flight) go by name.
        assert_eq!(
            order(&mut e, SortField::Inflight),
            "busy,half,looping,quiet"
        );
        assert_eq!(order(&mut e, SortField::Tenant), "busy,half,looping,quiet");
        let busy = e.page(&query(SortField::Inflight, 1, None), 10 * SEC);
        assert_eq!(busy.tenants[0].inflight, 7);
    }

    /// Spend left comes from the tenant's report, the same figures as the
    /// `admitd_spend_daily_remaining` gauge: units with a `tenant_daily` budget only, and no field
    /// at all for a tenant without one.
    #[test]
    fn spend_left_is_each_daily_budgets_rest_from_the_report() {
        let mut e = four();
        let gauges = crate::engine::TenantGauges {
            spend: vec![
                (Arc::from("usd"), 0.01 + 0.01 + 0.01, Some(5.0)),
                (Arc::from("tokens"), 900.0, None),
                (Arc::from("rows"), 12.0, Some(10.0)),
            ],
            ..Default::default()
        };
        e.set_spend_left(
            &Arc::from("half"),
            gauges.spend_daily_left().map(|(u, left, _)| (u, left)),
        );
        // A tenant the view does not hold is not added for its spend alone.
        e.set_spend_left(
            &Arc::from("absent"),
            gauges.spend_daily_left().map(|(u, left, _)| (u, left)),
        );
        let p = e.page(&query(SortField::Tenant, 10, None), 10 * SEC);
        assert_eq!(names(&p), ["busy", "half", "looping", "quiet"]);
        let half = &p.tenants[1];
        let want: BTreeMap<String, f64> = [("rows".to_string(), -2.0), ("usd".to_string(), 4.97)]
            .into_iter()
            .collect();
        assert_eq!(half.spend_left, Some(want));
        let json = serde_json::to_value(half).unwrap();
        assert_eq!(
            json["spend_left"],
            serde_json::json!({"rows": -2.0, "usd": 4.97})
        );
        assert_eq!(p.tenants[0].spend_left, None);
        let json = serde_json::to_value(&p.tenants[0]).unwrap();
        assert!(json.get("spend_left").is_none(), "{json}");
        // A later report without budgets (a reload removed them) takes the field away.
        e.set_spend_left(&Arc::from("half"), std::iter::empty());
        let p = e.page(&query(SortField::Tenant, 10, None), 10 * SEC);
        assert_eq!(p.tenants[1].spend_left, None);
    }

    #[test]
    fn pages_follow_the_cursor_and_cover_every_tenant_once() {
        let mut e = evaluator();
        // Equal ratios in groups, so the cursor must break ties by name.
        for i in 0..250 {
            feed(&mut e, &format!("t{i:03}"), 10, (i % 5) as u64, SEC);
        }
        e.evaluate(SEC, 0);
        let mut seen = Vec::new();
        let mut after = None;
        let mut pages = 0;
        loop {
            let p = e.page(&query(SortField::ShedRatio, 40, after), SEC);
            assert!(p.tenants.len() <= 40);
            assert_eq!(p.total, 250);
            seen.extend(p.tenants.iter().map(|r| (r.shed_ratio, r.tenant.clone())));
            pages += 1;
            // Through the wire form, as a client hands it back.
            after = p.next.map(|c| Cursor::decode(&c.encode()).unwrap());
            if after.is_none() {
                break;
            }
        }
        assert_eq!(pages, 7);
        assert_eq!(seen.len(), 250);
        let mut sorted = seen.clone();
        sorted.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        assert_eq!(seen, sorted);
        sorted.dedup_by(|a, b| a.1 == b.1);
        assert_eq!(sorted.len(), 250);
    }

    #[test]
    fn a_caller_limited_to_its_tenant_sees_only_that_one() {
        let mut e = four();
        let q = TenantsQuery {
            only: Some("half".into()),
            ..query(SortField::ShedRatio, 10, None)
        };
        let p = e.page(&q, 10 * SEC);
        assert_eq!(names(&p), ["half"]);
        assert_eq!(p.total, 1);
        let q = TenantsQuery {
            only: Some("nobody".into()),
            ..q
        };
        assert_eq!(e.page(&q, 10 * SEC).tenants, vec![]);
    }

    #[test]
    fn the_top_scope_and_history_come_from_the_window() {
        let mut e = four();
        let looping: Arc<str> = Arc::from("looping");
        for _ in 0..3 {
            e.record_shed(&looping, Scope::Subject, 10 * SEC);
        }
        e.record_shed(&looping, Scope::Tenant, 10 * SEC);
        e.record_shed(&looping, Scope::Tenant, 11 * SEC);
        let q = TenantsQuery {
            history: true,
            ..query(SortField::ShedRatio, 1, None)
        };
        let row = &e.page(&q, 11 * SEC).tenants[0];
        assert_eq!((row.top_scope, row.top_scope_shed), (Some("subject"), 3));
        // One slot of a 60 s window is a second: the calls fed at 10 s are one slot back at 11 s.
        assert_eq!(row.history, Some(vec![(1.0, 10, 90)]));
        // A window later the sheds by scope are gone with the slots.
        let row = &e.page(&q, 80 * SEC).tenants[0];
        assert_eq!(row.top_scope, None);
        e.evaluate(80 * SEC, 0);
        // ... and a tenant with nothing left in the window and no alert (looping's cleared with
        // its ratio) leaves the view; one with calls in flight stays.
        let p = e.page(&query(SortField::Tenant, 10, None), 80 * SEC);
        assert_eq!(names(&p), ["busy"]);
    }

    #[test]
    fn scope_window_merges_per_slot_and_ages_out() {
        let mut w = ScopeWindow::default();
        w.record(1, Scope::Global, 60);
        w.record(1, Scope::Tenant, 60);
        w.record(1, Scope::Global, 60);
        w.record(2, Scope::Tenant, 60);
        assert_eq!(w.entries.len(), 3);
        // Two each: the tie goes to the scope listed first.
        assert_eq!(w.top(2, 60), Some((Scope::Tenant, 2)));
        w.record(3, Scope::Tenant, 60);
        assert_eq!(w.top(3, 60), Some((Scope::Tenant, 3)));
        assert_eq!(w.top(61, 60), Some((Scope::Tenant, 2)));
        assert_eq!(w.top(70, 60), None);
        assert!(w.is_empty());
    }

    #[test]
    fn cursors_survive_the_wire_and_only_their_shape_is_checked() {
        let c = Cursor {
            key: 0.25,
            tenant: "ü tenant/1".as_bytes().to_vec(),
        };
        assert_eq!(Cursor::decode(&c.encode()), Some(c));
        // Any bytes and any key bits are a place in the order.
        let odd = Cursor::decode("7FF8000000000000.ff00").unwrap();
        assert_eq!(odd.tenant, vec![0xff, 0x00]);
        assert!(odd.key.is_nan());
        for bad in [
            "",
            "0000000000000000",
            "000000000000000.00",
            "+000000000000000.00",
            "0000000000000000.0",
            "0000000000000000.zz",
            "shed.0000000000000000.61",
        ] {
            assert_eq!(Cursor::decode(bad), None, "{bad}");
        }
    }

    /// The cost of a page over 100 000 tenants, with the page's rows sorted out of them. Printed:
    /// `cargo test --release --lib live::tests::a_page_over_100_000_tenants -- --nocapture`.
    #[test]
    fn a_page_over_100_000_tenants() {
        let mut e = evaluator();
        for i in 0..100_000u64 {
            feed(&mut e, &format!("tenant-{i}"), 100, i % 997, SEC);
        }
        e.evaluate(SEC, 0);
        let q = query(SortField::ShedRatio, 100, None);
        let started = std::time::Instant::now();
        let p = e.page(&q, SEC);
        let first = started.elapsed();
        let p2 = e.page(&query(SortField::ShedRatio, 100, p.next.clone()), SEC);
        println!(
            "a page of 100 over 100 000 tenants: {first:?} (the next page: {:?})",
            started.elapsed() - first
        );
        assert_eq!(p.total, 100_000);
        assert_eq!(p.tenants.len(), 100);
        assert_eq!(p.tenants[0].shed, 996);
        assert!(p2.tenants[0].shed_ratio <= p.tenants[99].shed_ratio);
    }
}
