//! An upstream's answers in the shared store, outside a decision: one reported without a lease
//! (`POST /v1/feedback`), the probe schedule admitd computes from an answer, and, on a Redis
//! Cluster, a `shared = true` upstream's answers reported on its own shard (`{u:NAME}`) without one
//! script call there per call.
//!
//! Decisions that spend a shared upstream are taken from this replica's slices
//! ([`super::slices`]), but every answer of the upstream (a release's, or `POST /v1/feedback`'s)
//! still has its effect on the upstream's state: its penalty, AIMD multiplier, adaptive window and
//! probe meter, all on the upstream's shard, where the fleet's answers would meet one script call
//! each. So:
//!
//! * An answer that changes nothing there makes no call ([`changes_nothing`]): not a 429, and the
//!   upstream has no adaptive window, no probing, and either no AIMD or an answer that does not
//!   recover it (not healthy).
//! * The other answers that are neither a 429 nor a 503 (the healthy ones, and the accepted ones
//!   that are not healthy, which only count as accepts) are gathered per upstream, each with the
//!   millisecond it arrived, and sent as one operation (the script's `answers`) every
//!   [`GATHER_EVERY`], and when the replica stops. The script counts each as the single report would
//!   have, at its own instant (its age in the operation): the same recoveries, with the same snap
//!   and cap, the same meter terms with their decay, the same adaptive slots. What moves is when the
//!   store sees them: up to [`GATHER_EVERY`] (and a round trip) later.
//! * A 429 or a 503 goes at once, as before, carrying the answers gathered before it (counted
//!   first, in the same operation), so that the store sees this replica's answers in their order. A
//!   probed upstream's 429 is the exception: admitd plans the probe from the state after each
//!   answer it sends, so the gathered answers go first as an operation of their own (their probe
//!   write with them), and then the 429.
//!
//! One server holds the upstream's state with the tenant's: the release reports it in its own
//! script call, so nothing is gathered there.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::error::StoreError;
use super::redis::{RedisStore, DEFAULT_PENALTY_US};
use super::spec::{self, strings};
use crate::engine::UpstreamReport;

/// How long this replica gathers a shared upstream's answers before it sends them, at most: a
/// tenth of a second, well under the life of a shared upstream's slice (250 ms), so the state the
/// next slices are cut from lags the answers by less than the slices themselves do.
pub const GATHER_EVERY: Duration = Duration::from_millis(100);

/// What an answer of a shared upstream does in the store, besides the lease's own release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// Nothing: no call.
    Nothing,
    /// Gathered and sent with the others.
    Gather,
    /// Sent at once (a 429 or a 503).
    Now,
}

/// Whether the script would write nothing that any read sees for this answer of the upstream `u`
/// (its report, as the script reads it): `upstream_answer` then writes no penalty (not a 429), no
/// adaptive slot (no window), no probe meter and no probe schedule's expiry (no probing), and no
/// multiplier (no AIMD, or an answer that is not healthy and so recovers nothing). Its only write
/// left is the state hash's expiry, pushed for an upstream with AIMD; that changes no read: the
/// multiplier of a hash no answer writes is read as 1 once its cut is older than `forget`, and the
/// cut that wrote it kept it that long already. (A probed upstream's schedule is read for as long
/// as the hash lives, so every answer that pushes its expiry is sent.)
pub(super) fn changes_nothing(u: &Value, limited: bool, healthy: bool) -> bool {
    let set = |k: &str| u.get(k).is_some_and(|v| !v.is_null());
    let window = u.get("aw").and_then(Value::as_f64).unwrap_or(0.0) > 0.0;
    !limited && !window && !set("pr") && (!healthy || !set("af"))
}

/// Where an answer goes (`accepted`: not a 503; `healthy`: an ok answer below 500).
pub(super) fn route(u: &Value, limited: bool, accepted: bool, healthy: bool) -> Route {
    if changes_nothing(u, limited, healthy) {
        Route::Nothing
    } else if limited || !accepted {
        Route::Now
    } else {
        Route::Gather
    }
}

/// One upstream's gathered answers: its report (the latest) and, per millisecond of this process's
/// clock, how many healthy answers and how many other accepted ones arrived in it.
#[derive(Default)]
struct Gathered {
    u: Value,
    by_ms: BTreeMap<u64, (u64, u64)>,
}

/// The answers waiting to be sent, per upstream (its state key).
#[derive(Default)]
pub(super) struct Answers {
    waiting: parking_lot::Mutex<HashMap<String, Gathered>>,
}

impl Answers {
    fn put(&self, state: &str, u: Value, at_ms: u64, healthy: bool) {
        let mut w = self.waiting.lock();
        let g = w.entry(state.to_string()).or_default();
        g.u = u;
        let e = g.by_ms.entry(at_ms).or_default();
        if healthy {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }

    fn take(&self, state: &str) -> Option<Gathered> {
        self.waiting.lock().remove(state)
    }

    fn take_all(&self) -> Vec<(String, Gathered)> {
        self.waiting.lock().drain().collect()
    }
}

/// The `a` list of the script's `answers` (and `upstream`) operation: per millisecond, its age in
/// microseconds at `now_ms` and the two counts, oldest first.
fn ages(g: &Gathered, now_ms: u64) -> Value {
    Value::Array(
        g.by_ms
            .iter()
            .map(|(&ms, &(healthy, accepted))| {
                json!([now_ms.saturating_sub(ms) * 1000, healthy, accepted])
            })
            .collect(),
    )
}

impl RedisStore {
    /// This process's clock in milliseconds, as the gathered answers are stamped.
    fn mono_ms(&self) -> u64 {
        self.mono() / 1_000_000
    }

    /// Keeps a shared upstream's answer (`u`: its report as the script reads it) for the next send.
    pub(super) fn gather(&self, u: Value, healthy: bool) {
        let Some(state) = u["s"].as_str().map(str::to_string) else {
            return;
        };
        self.answers.put(&state, u, self.mono_ms(), healthy);
    }

    /// The answers gathered for the upstream whose state key is `state`, taken out to go with an
    /// answer sent at once (the `a` of its operation), or sent first on their own (`alone`: a
    /// probed upstream's 429; then `None`).
    pub(super) async fn gathered_before(
        self: &Arc<Self>,
        state: &str,
        alone: bool,
    ) -> Option<Value> {
        let g = self.answers.take(state)?;
        if alone {
            self.send_gathered(state.to_string(), g).await;
            return None;
        }
        Some(ages(&g, self.mono_ms()))
    }

    /// Sends every upstream's gathered answers (each its own operation, on its shard).
    pub async fn send_answers(self: &Arc<Self>) {
        let all = self.answers.take_all();
        let sends = all
            .into_iter()
            .map(|(state, g)| self.send_gathered(state, g));
        futures_util::future::join_all(sends).await;
    }

    async fn send_gathered(self: &Arc<Self>, state: String, g: Gathered) {
        let spec = json!({"u": g.u, "a": ages(&g, self.mono_ms())});
        // A failed send is dropped, as a failed report is: the answers after it count.
        if let Ok(v) = self
            .invoke(&state, "answers", spec.to_string(), String::new())
            .await
        {
            if let Some(probe) = strings(v).ok().and_then(|p| p.get(1).cloned()) {
                self.write_probe("", &probe, false).await;
            }
        }
    }

    /// On a cluster, for the process's life: the gathered answers go every [`GATHER_EVERY`].
    pub(super) async fn send_answers_every(self: Arc<Self>) {
        loop {
            tokio::time::sleep(GATHER_EVERY).await;
            self.send_answers().await;
        }
    }
}

/// An upstream's answers in the store: one reported outside a lease (`POST /v1/feedback`), a
/// shared upstream's on its own shard, and the probe schedule admitd computes from an answer.
impl RedisStore {
    /// An upstream's answer seen outside a lease; returns the penalty it started.
    pub async fn report(
        self: Arc<Self>,
        tenant: Arc<str>,
        report: UpstreamReport,
        status: u16,
        retry_after: Option<Duration>,
    ) -> Result<Option<Duration>, StoreError> {
        let limited = status == 429;
        let (accepted, healthy) = crate::engine::feedback_answer(status);
        let retry_after = retry_after.map_or(-1.0, |d| d.as_micros() as f64);
        let u = serde_json::to_value(spec::report_spec(&self.keys, &tenant, &report, false))
            .map_err(|e| StoreError::Script(e.to_string()))?;
        let us = if self.cfg.cluster && report.cross_tenant() {
            // A shared upstream's state is on its own shard in a cluster.
            self.report_shared(&tenant, u, limited, accepted, healthy, retry_after)
                .await?
                .unwrap_or(0.0)
        } else {
            let spec = json!({
                "u": u,
                "limited": limited,
                "ok": accepted,
                "healthy": healthy,
                "retry_after": retry_after,
                "default_penalty": DEFAULT_PENALTY_US,
            });
            let route = self.keys.tenant_base(&tenant);
            let parts = strings(
                self.invoke(&route, "upstream", spec.to_string(), String::new())
                    .await?,
            )?;
            if let Some(probe) = parts.get(2) {
                self.write_probe(&tenant, probe, limited).await;
            }
            parts.get(1).and_then(|x| x.parse().ok()).unwrap_or(0.0)
        };
        if limited && report.cross_tenant() {
            // This replica's slice of the upstream's bucket stops at once.
            self.halt_shared(&tenant, &report.name, us).await;
        }
        Ok((us > 0.0).then(|| Duration::from_micros(us as u64)))
    }

    /// A shared upstream's answer on a cluster (`u`: its report as the script reads it), on the
    /// upstream's shard: at once (a 429, a 503), gathered with the others, or not sent when it
    /// changes nothing there ([`super::answers`]). Returns the penalty it started, when it went at
    /// once.
    pub(super) async fn report_shared(
        self: &Arc<Self>,
        tenant: &str,
        u: Value,
        limited: bool,
        accepted: bool,
        healthy: bool,
        retry_after: f64,
    ) -> Result<Option<f64>, StoreError> {
        use super::answers::{route, Route};
        match route(&u, limited, accepted, healthy) {
            Route::Nothing => return Ok(None),
            Route::Gather => {
                self.gather(u, healthy);
                return Ok(None);
            }
            Route::Now => {}
        }
        // The upstream's state key routes the report to the upstream's shard.
        let state = u["s"].as_str().unwrap_or_default().to_string();
        let probed = u.get("pr").is_some_and(|p| !p.is_null());
        let before = self.gathered_before(&state, limited && probed).await;
        let mut spec = json!({"u": u, "limited": limited, "ok": accepted, "healthy": healthy,
                              "retry_after": retry_after, "default_penalty": DEFAULT_PENALTY_US});
        if let Some(a) = before {
            spec["a"] = a;
        }
        let v = self
            .invoke(&state, "upstream", spec.to_string(), String::new())
            .await?;
        let p = strings(v)?;
        if let Some(probe) = p.get(2) {
            self.write_probe(tenant, probe, limited).await;
        }
        Ok(p.get(1).and_then(|x| x.parse().ok()))
    }

    /// After an answer the script counted towards a probed upstream (`answer`: the probe part of
    /// its reply), writes the schedule admitd computed from it, when it moved. The write applies
    /// only if no other replica moved the schedule since the script read it; a lost write is
    /// dropped (the other replica's change already answers the same evidence), and so is a failed
    /// one: the next answer tries again.
    pub(super) async fn write_probe(self: &Arc<Self>, tenant: &str, answer: &str, limited: bool) {
        if answer.is_empty() {
            return;
        }
        let Some((state, spec)) = spec::probe_write(answer, limited) else {
            return;
        };
        // Probed upstreams are shared ones: in a cluster, the state key routes to its shard.
        let route = if self.cfg.cluster {
            state
        } else {
            self.keys.tenant_base(tenant)
        };
        let _ = self.invoke(&route, "probe", spec, String::new()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(extra: Value) -> Value {
        let mut u = json!({"n": "api", "p": "P", "s": "S", "aw": 0, "forget": 1e6, "x": true});
        for (k, v) in extra.as_object().unwrap() {
            u[k] = v.clone();
        }
        u
    }

    #[test]
    fn an_answer_that_writes_nothing_makes_no_call() {
        let bare = report(json!({}));
        let aimd = report(json!({"af": 0.5, "afl": 0.1, "ar": 0.05}));
        let window = report(json!({"aw": 3e7}));
        let probed = report(json!({"af": 0.5, "afl": 0.1, "ar": 0.05, "q": 0.1, "pr": {}}));
        // (limited, accepted, healthy)
        let answers = [
            (false, true, true),
            (false, true, false),
            (false, false, false),
            (true, true, false),
        ];
        let routes = |u: &Value| answers.map(|(l, a, h)| route(u, l, a, h));
        use Route::*;
        // Nothing configured: only a 429 writes (the penalty).
        assert_eq!(routes(&bare), [Nothing, Nothing, Nothing, Now]);
        // AIMD alone: a healthy answer recovers, the others recover nothing.
        assert_eq!(routes(&aimd), [Gather, Nothing, Nothing, Now]);
        // A window counts every answer; a 503 as a request without an accept, at once.
        assert_eq!(routes(&window), [Gather, Gather, Now, Now]);
        // Probing (and AIMD): a healthy answer goes into the meter; every answer keeps the
        // schedule's hash.
        assert_eq!(routes(&probed), [Gather, Gather, Now, Now]);
        let both = report(json!({"af": 0.5, "ar": 0.05, "aw": 3e7}));
        assert_eq!(routes(&both), [Gather, Gather, Now, Now]);
        // A report read back from a lease encodes an absent window as 0 and absent keys as nothing.
        assert!(changes_nothing(&report(json!({"af": null})), false, true));
    }

    #[test]
    fn gathered_answers_are_counted_per_millisecond_oldest_first() {
        let a = Answers::default();
        let u = report(json!({"af": 0.5}));
        a.put("S", u.clone(), 10, true);
        a.put("S", u.clone(), 10, true);
        a.put("S", u.clone(), 12, false);
        a.put("S", u.clone(), 11, true);
        a.put("T", u, 11, true);
        let g = a.take("S").unwrap();
        assert_eq!(
            ages(&g, 20),
            json!([[10000, 2, 0], [9000, 1, 0], [8000, 0, 1]])
        );
        assert!(a.take("S").is_none());
        assert_eq!(a.take_all().len(), 1);
    }
}
