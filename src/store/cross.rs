//! Decisions that spend cross-tenant buckets on a Redis Cluster (the global buckets, `shared = true`
//! upstreams' buckets) from this replica's slices of them (see [`super::slices`]): one script call
//! on the tenant's shard instead of one more per bucket's shard, where every decision of the fleet
//! that spends the bucket would meet.
//!
//! A shared upstream's slice also carries what else decides the upstream's calls, as its refill
//! read it on the upstream's shard: the slice is taken at the bucket's rate after any AIMD cut, and
//! none is taken (what the slice holds goes back) while the upstream is under a penalty or its
//! adaptive throttle refuses any share of calls; its calls are then decided on the shard, exactly.
//! A 429 reported through this replica halts the slice at once; other replicas learn of it at
//! their next refill, within [`SHARED_LIFE`] (a shared upstream's slice is spent no longer).

use std::sync::Arc;

use serde_json::json;

use super::error::StoreError;
use super::redis::RedisStore;
use super::slices::{Slice, Spent, SHARED_LIFE, SLICE_LIFE};
use super::spec::{self, parse_decide, strings, CrossLayer, Part};
use crate::engine::{RemoteAnswer, RemoteCall, StateKey};

/// A cross-tenant layer of a call spent from this replica's slice.
struct Taken {
    layer: usize,
    slice: Arc<Slice>,
    tokens: f64,
    left: u64,
    reset_us: f64,
}

impl RedisStore {
    /// Whether `call` may be decided from slices: on a cluster with slicing on, its cross-tenant
    /// state is global buckets and shared upstreams' buckets, and each shared upstream's penalty
    /// and adaptive throttle are those of an upstream whose bucket the call spends (the slice
    /// carries them). A shared upstream without a budget is decided on its shard.
    fn sliceable(&self, call: &RemoteCall) -> bool {
        let has_bucket = |u: &str| {
            call.layers
                .iter()
                .any(|l| matches!(&l.key, StateKey::SharedUpstreamBucket(b) if &**b == u))
        };
        !self.cfg.slice.is_zero()
            && call.layers.iter().all(|l| {
                !l.key.cross_tenant()
                    || matches!(
                        l.key,
                        StateKey::GlobalBucket(_) | StateKey::SharedUpstreamBucket(_)
                    )
            })
            && call.penalties.iter().all(|p| match &p.key {
                StateKey::Penalty(u, true) => has_bucket(u),
                _ => true,
            })
            && call.adaptive.iter().all(|a| match &a.key {
                StateKey::UpstreamState(u, true) => has_bucket(u),
                _ => true,
            })
    }

    /// Decides `call` with its cross-tenant layers spent from this replica's slices and the rest on
    /// the tenant's shard, in one script call. `None` when a slice does not hold the call's tokens,
    /// or knows its upstream under a penalty or throttled (the caller decides it the old way); each
    /// slice short of half its size is refilled meanwhile.
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
                let spec = spec::slice_spec(&self.keys, tenant, call, i, size);
                let life = match l.key {
                    StateKey::SharedUpstreamBucket(_) => SHARED_LIFE,
                    _ => SLICE_LIFE,
                };
                self.refill(key, slice, spec, (l.t_us, l.burst), life);
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
        // The cross-tenant layers' figures are the slices', whatever the tenant's shard answered.
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

    /// Takes the next slice of the bucket `key` (`spec`: the script's `slice` operation, see
    /// [`spec::slice_spec`]; the bucket's configured microseconds per token and burst) on the
    /// store's thread, giving back first what is left of an expired one. The slice may be spent
    /// for `life` after it arrives. A shared upstream found under a
    /// penalty halts the slice until the penalty ends; one whose adaptive throttle refuses calls,
    /// for `life`.
    fn refill(
        self: &Arc<Self>,
        key: String,
        slice: Arc<Slice>,
        spec: String,
        (configured_t_us, burst): (f64, f64),
        life: u64,
    ) {
        let me = Arc::clone(self);
        self.runtime.spawn(async move {
            let back = slice.take_expired(me.mono());
            if back > 0.0 {
                let t_us = slice.t_us();
                me.give_back(&key, back, t_us).await;
            }
            let asked = slice.epoch();
            let got = me.invoke(&key, "slice", spec, String::new()).await;
            let parsed = got.and_then(strings).ok().and_then(|v| {
                let num = |i: usize| v.get(i).and_then(|s| s.parse::<f64>().ok());
                (v.first().map(String::as_str) == Some("ok"))
                    .then(|| Some((num(1)?, num(2)?, num(3)?, num(4), num(5), num(6))))
                    .flatten()
            });
            let Some((granted, left, reset_us, penalty_us, throttle, t_us)) = parsed else {
                slice.refill_failed();
                return;
            };
            // The microseconds per token the slice was taken at (a shared upstream's after its
            // AIMD multiplier): what a token of it is worth when it goes back.
            let t_us = t_us.unwrap_or(configured_t_us);
            let now = me.mono();
            let mut back = slice.refilled(
                granted,
                (t_us, burst),
                (left as u64, reset_us),
                now,
                life,
                asked,
            );
            let penalty_us = penalty_us.unwrap_or(0.0);
            if penalty_us > 0.0 || throttle.unwrap_or(0.0) > 0.0 {
                let until = if penalty_us > 0.0 {
                    now.saturating_add((penalty_us * 1e3) as u64)
                } else {
                    now.saturating_add(life)
                };
                back += slice.halt(until).0;
            }
            if back > 0.0 {
                me.give_back(&key, back, t_us).await;
            }
        });
    }

    /// A 429 of the shared upstream `upstream` reported through this replica (its penalty
    /// `penalty_us` long): its slice is halted at once and what it held goes back to the bucket.
    pub(super) async fn halt_shared(
        self: &Arc<Self>,
        tenant: &str,
        upstream: &str,
        penalty_us: f64,
    ) {
        if !self.cfg.cluster || self.cfg.slice.is_zero() {
            return;
        }
        let key = self
            .keys
            .key(tenant, &StateKey::SharedUpstreamBucket(Arc::from(upstream)));
        let Some(slice) = self.slices.peek(&key) else {
            return;
        };
        let until = self
            .mono()
            .saturating_add((penalty_us.max(0.0) * 1e3) as u64);
        let (back, t_us) = slice.halt(until);
        if back > 0.0 {
            self.give_back(&key, back, t_us).await;
        }
    }

    /// Gives `tokens` back to the bucket `key` (whose token is `t_us` microseconds).
    async fn give_back(self: &Arc<Self>, key: &str, tokens: f64, t_us: f64) {
        self.give_back_us(key, (tokens * t_us).floor()).await;
    }

    /// Gives `us` microseconds of tokens back to the cross-tenant bucket `key`.
    pub(super) async fn give_back_us(self: &Arc<Self>, key: &str, us: f64) {
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
    /// bucket's configured rate. A bucket spent from slices settles in this replica's slice
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
        for CrossLayer(key, tokens, t_us, sliced) in &layers {
            let tokens = tokens * share.abs();
            if *sliced && !self.cfg.slice.is_zero() {
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
