//! Decisions that spend the global bucket on a Redis Cluster, from this replica's slice of it (see
//! [`super::slices`]): one script call on the tenant's shard instead of two, the second on the one
//! shard every decision of the fleet would meet on.

use std::sync::Arc;

use serde_json::json;

use super::error::StoreError;
use super::redis::RedisStore;
use super::slices::{Slice, Spent};
use super::spec::{self, parse_decide, strings, CrossLayer, Part};
use crate::engine::{RemoteAnswer, RemoteCall, StateKey};

/// A global layer of a call spent from this replica's slice.
struct Taken {
    layer: usize,
    slice: Arc<Slice>,
    tokens: f64,
    left: u64,
    reset_us: f64,
}

impl RedisStore {
    /// Whether `call` may be decided from slices: on a cluster with slicing on, its cross-tenant
    /// state is global buckets only (a shared upstream's bucket, penalty and adaptive window are
    /// still decided on their shard).
    fn sliceable(&self, call: &RemoteCall) -> bool {
        !self.cfg.slice.is_zero()
            && call
                .layers
                .iter()
                .all(|l| !l.key.cross_tenant() || matches!(l.key, StateKey::GlobalBucket(_)))
            && call.penalties.iter().all(|p| !p.key.cross_tenant())
            && call.adaptive.iter().all(|a| !a.key.cross_tenant())
    }

    /// Decides `call` with its global layers spent from this replica's slices and the rest on the
    /// tenant's shard, in one script call. `None` when a slice does not hold the call's tokens (the
    /// caller decides it the old way); each slice short of half its size is refilled meanwhile.
    pub(super) async fn decide_sliced(
        self: &Arc<Self>,
        tenant: &Arc<str>,
        call: &RemoteCall,
    ) -> Option<Result<RemoteAnswer, StoreError>> {
        if !self.sliceable(call) {
            return None;
        }
        let now = self.mono();
        let span = self.cfg.slice.as_nanos() as u64;
        let mut taken: Vec<Taken> = Vec::new();
        let mut short = false;
        for (i, l) in call.layers.iter().enumerate() {
            if !l.key.cross_tenant() {
                continue;
            }
            let key = self.keys.key(tenant, &l.key);
            let slice = self.slices.get(&key);
            if !short {
                match slice.spend(l.tokens, now) {
                    Spent::Local { left, reset_us } => taken.push(Taken {
                        layer: i,
                        slice: Arc::clone(&slice),
                        tokens: l.tokens,
                        left,
                        reset_us,
                    }),
                    Spent::Empty => short = true,
                }
            }
            if let Some(size) = slice.wants_refill(l.tokens, l.burst, span, now) {
                self.refill(key, slice, size, l.t_us, l.burst);
            }
        }
        let way = if short { "shard" } else { "slice" };
        metrics::counter!(crate::telemetry::names::STORE_GLOBAL, "way" => way).increment(1);
        if short {
            for t in &taken {
                t.slice.unspend(t.tokens);
            }
            return None;
        }
        let n = call.layers.len();
        let p = spec::decide_spec(&self.keys, tenant, call, Part::Tenant);
        let mut answer = parse_decide(
            self.invoke(&p.route, "decide", p.spec, p.data).await,
            &p.map,
            n,
        );
        // The global layers' figures are the slices', whatever the tenant's shard answered.
        if let Ok(RemoteAnswer::Admitted { layers, .. } | RemoteAnswer::Refused { layers, .. }) =
            &mut answer
        {
            for t in &taken {
                if let Some(slot) = layers.get_mut(t.layer) {
                    *slot = (t.left, t.reset_us);
                }
            }
        }
        if !matches!(answer, Ok(RemoteAnswer::Admitted { .. })) {
            // Not admitted: what the slices gave goes back to them.
            for t in &taken {
                t.slice.unspend(t.tokens);
            }
        }
        Some(answer)
    }

    /// Takes the next slice of the bucket `key` (`size` whole tokens at most) on the store's
    /// thread, giving back first what is left of an expired one.
    fn refill(self: &Arc<Self>, key: String, slice: Arc<Slice>, size: f64, t_us: f64, burst: f64) {
        let me = Arc::clone(self);
        self.runtime.spawn(async move {
            let back = slice.take_expired(me.mono());
            if back > 0.0 {
                me.give_back(&key, back, t_us).await;
            }
            let spec = json!({"k": key, "T": t_us, "b": burst, "n": size}).to_string();
            let got = me.invoke(&key, "slice", spec, String::new()).await;
            let parsed = got.and_then(strings).ok().and_then(|v| {
                let num = |i: usize| v.get(i).and_then(|s| s.parse::<f64>().ok());
                (v.first().map(String::as_str) == Some("ok"))
                    .then(|| Some((num(1)?, num(2)?, num(3)?)))
                    .flatten()
            });
            match parsed {
                Some((granted, left, reset_us)) => {
                    slice.refilled(granted, (t_us, burst), (left as u64, reset_us), me.mono());
                }
                None => slice.refill_failed(),
            }
        });
    }

    /// Gives `tokens` back to the bucket `key` (whose token is `t_us` microseconds).
    async fn give_back(self: &Arc<Self>, key: &str, tokens: f64, t_us: f64) {
        let us = (tokens * t_us).floor();
        if us <= 0.0 {
            return;
        }
        // A cross-tenant bucket is a hash of its own: its fields carry no prefix.
        let spec = json!({"incs": [[key, "", us]]}).to_string();
        let _ = self.invoke(key, "refund", spec, String::new()).await;
    }

    /// Settles a released call's cross-tenant bucket layers to its actual `cost` (the script's
    /// release settled its tenant's layers and answered `admitted`, the admission's cost, and
    /// `layers`, those it could not reach: on shards of their own). As there, the difference goes
    /// back to each bucket, or is charged on top, in proportion to what the call took, at the
    /// bucket's configured rate. A global bucket spent from slices settles in this replica's slice
    /// when it can, without a script call: a give-back while the slice may still be spent (the
    /// tokens are the bucket's either way; what the slice holds goes back when it expires), a charge
    /// while the slice holds it (spent capacity as any call's); else on the bucket's shard.
    pub(super) async fn settle_cross(self: &Arc<Self>, admitted: &str, layers: &str, cost: f64) {
        let (Ok(admitted), Ok(layers)) = (
            admitted.parse::<f64>(),
            serde_json::from_str::<Vec<CrossLayer>>(layers),
        ) else {
            return;
        };
        let share = (cost - admitted) / admitted;
        if !share.is_finite() || share == 0.0 {
            return;
        }
        let now = self.mono();
        for CrossLayer(key, tokens, t_us, global) in &layers {
            let tokens = tokens * share.abs();
            if *global && !self.cfg.slice.is_zero() {
                let slice = self.slices.get(key);
                let settled = if share < 0.0 {
                    slice.give_back(tokens, now)
                } else {
                    matches!(slice.spend(tokens, now), Spent::Local { .. })
                };
                if settled {
                    continue;
                }
            }
            let us = (tokens * t_us).floor();
            if us <= 0.0 {
                continue;
            }
            let op = if share < 0.0 { "refund" } else { "charge" };
            // A cross-tenant bucket is a hash of its own: its fields carry no prefix.
            let spec = json!({"incs": [[key, "", us]]}).to_string();
            let _ = self.invoke(key, op, spec, String::new()).await;
        }
    }

    /// Gives back every slice this replica holds (it stops): what its callers did not spend is the
    /// fleet's again at once rather than at the bucket's pace.
    pub async fn give_back_slices(self: &Arc<Self>) {
        for (key, tokens, t_us) in self.slices.drain() {
            self.give_back(&key, tokens, t_us).await;
        }
    }
}
