//! The Redis store: admission state shared by every replica that points at the same Redis (or Redis
//! Cluster), decided by one server-side script per call (`admitd.lua`).
//!
//! Each worker thread sends its decisions and releases on a connection of its own, driven on that
//! worker (its *lane*; in a Redis Cluster, one per node, see [`super::nodes`]): the operations
//! queued while Redis runs a batch go together in the next script call, so under load a script
//! call carries many decisions and an answer wakes the worker that waits for it with no other
//! thread between. The store's own thread (`admitd-store`, a single-threaded tokio runtime)
//! connects, probes a store that went down, and carries snapshots on `pool_size` connections (in a
//! cluster, on the cluster client, which also reads the slot map).
//!
//! Failures: every call is bounded by `[store] timeout`. A broken connection, or three failed calls
//! in a row, marks the store down: connections are dropped, calls go straight to the `on_error`
//! policy without touching the network, and a probe reconnects (at once, then every
//! [`PROBE_EVERY`]) until Redis answers a PING, when shared enforcement resumes.
//!
//! An idle replica makes no calls, so nothing of the above would notice an outage until traffic
//! came back: `/readyz` would say "connected" while Redis was gone, and the first calls after it
//! returned would find a dead connection. So while the store is up and has answered nothing for
//! [`IDLE_PING_EVERY`], the store's thread sends a PING of its own ([`RedisStore::watch_idle`]),
//! a failure of which counts like a failed call: a refused connection marks the store down within
//! about a second, a Redis that accepts and never answers within about six.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use serde_json::{json, Value};

use super::error::{connection_config, within, StoreError};
use super::keys::{hash_tag, Keys};
use super::lane::{Lanes, Queued};
use super::nodes::Nodes;
use super::slices::Slices;
use super::spec::{self, merge, parse_decide, strings, Part};
use super::StoreMode;
use crate::config::{OnError, StoreConfig};
use crate::engine::{
    ReleaseInfo, RemoteAnswer, RemoteCall, RemoteSnapshotPlan, RemoteSnapshotState, StateKey,
};
use crate::telemetry::names;
use crate::telemetry::Telemetry;

/// How often a store marked down is tried again.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);
/// How long the store may go without answering anything before the idle watch PINGs it.
pub const IDLE_PING_EVERY: Duration = Duration::from_secs(1);
/// How long the idle watch's PING may take. Longer than a call's `[store] timeout`: it asks
/// whether Redis is there, not whether it is fast (slow calls are counted by the calls themselves).
const IDLE_PING_LIMIT: Duration = Duration::from_secs(1);
/// Failed calls in a row that mark the store down (a broken connection does at once).
const FAILURES_TO_DOWN: u32 = 3;
/// The penalty of a 429 reported without a Retry-After.
pub(super) const DEFAULT_PENALTY_US: f64 = 1e6;

enum Conns {
    /// One server: the client each worker's lane connects with (`generation` counts the store's
    /// connections, so a lane made before a reconnection is made again), and `pool_size`
    /// connections of the store's thread for the rest (snapshots, probes).
    Single {
        client: Box<redis::Client>,
        pool: Vec<redis::aio::MultiplexedConnection>,
        generation: u64,
    },
    /// A Redis Cluster: the cluster client (the slot map, snapshots, probes) and the generation its
    /// lanes are made in (each worker's lane per node, see [`super::nodes`]).
    Cluster {
        client: redis::cluster_async::ClusterConnection,
        generation: u64,
    },
}

/// What a release did in the store.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreReleased {
    pub subject: String,
    pub tool: String,
    pub upstream: Option<String>,
    pub penalty: Option<Duration>,
    /// How long the lease was held after its hold ended, in microseconds of the store's clock.
    pub held_us: f64,
}

/// How a release gives back what the call took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refund {
    /// Everything (a held caller went away before the answer).
    Always,
    /// Nothing (an edge admission ends at once; what it spent stays spent).
    Never,
    /// Only when cancelled while still held (after that the call ran).
    IfHeld,
}

/// A Redis store shared by several replicas.
pub struct RedisStore {
    pub(super) cfg: StoreConfig,
    pub(super) keys: Keys,
    pub(super) script: redis::Script,
    /// Each worker's lane to the server, or to each node of a cluster.
    pub(super) lanes: Arc<Lanes>,
    /// Which node of a cluster serves which slot.
    pub(super) nodes: Nodes,
    conns: ArcSwapOption<Conns>,
    up: AtomicBool,
    failures: AtomicU32,
    probing: AtomicBool,
    next: AtomicUsize,
    pub(super) runtime: tokio::runtime::Handle,
    telemetry: Telemetry,
    /// This replica's slices of cross-tenant buckets (a cluster with `[store] slice`).
    pub(super) slices: Slices,
    /// Shared upstreams' answers waiting to go to their shards (a cluster; see [`super::answers`]).
    pub(super) answers: super::answers::Answers,
    last_error: parking_lot::Mutex<String>,
    /// Connections made so far (see [`Conns::Single`]).
    generation: std::sync::atomic::AtomicU64,
    /// When the store last answered anything, in milliseconds since `started` (the idle watch).
    answered_ms: std::sync::atomic::AtomicU64,
    started: Instant,
}

impl RedisStore {
    /// Starts the store's thread and connects. A Redis that is not reachable yet is not an error:
    /// the store starts down (admissions follow `on_error`) and connects when Redis answers.
    pub async fn start(cfg: &StoreConfig, telemetry: Telemetry) -> Result<Arc<Self>, String> {
        // The script with the engine's constants written in (an error only if it names one the
        // engine has no value for: see `script`).
        let script = super::script::text()?;
        if cfg.urls().iter().any(|u| u.starts_with("rediss://")) {
            // TLS (`rediss://`) verifies the server against the system's roots (or the file named by
            // SSL_CERT_FILE). Installing fails only when a provider is installed already: fine.
            // ring is deprecated by rustls for lacking post-quantum key exchange; its alternative
            // (aws-lc-rs) builds C with cmake, which the build would then need. A Redis link inside
            // one network is what this protects.
            #[allow(deprecated)]
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("admitd-store".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(format!("cannot start the store thread: {e}")));
                        return;
                    }
                };
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(std::future::pending::<()>());
            })
            .map_err(|e| format!("cannot start the store thread: {e}"))?;
        let runtime = rx
            .recv()
            .map_err(|_| "the store thread ended at start".to_string())??;
        let store = Arc::new(RedisStore {
            keys: Keys::new(&cfg.key_prefix),
            cfg: cfg.clone(),
            script: redis::Script::new(script),
            lanes: Arc::new(Lanes::new(script, cfg.pool_size, cfg.timeout, cfg.cluster)),
            nodes: Nodes::default(),
            conns: ArcSwapOption::empty(),
            up: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            runtime,
            telemetry,
            slices: Slices::default(),
            answers: Default::default(),
            last_error: parking_lot::Mutex::new("not connected yet".into()),
            generation: std::sync::atomic::AtomicU64::new(0),
            answered_ms: std::sync::atomic::AtomicU64::new(0),
            started: Instant::now(),
        });
        let first = Arc::clone(&store);
        let (tx, rx) = tokio::sync::oneshot::channel();
        store.runtime.spawn(async move {
            let _ = tx.send(first.connect().await);
        });
        let connected = rx
            .await
            .unwrap_or_else(|_| Err("the store thread ended at start".into()));
        match connected {
            Ok(()) => tracing::info!(store = "redis", "connected to the shared store"),
            Err(e) => {
                tracing::warn!(
                    store = "redis",
                    error = %e,
                    on_error = store.cfg.on_error.as_str(),
                    "the shared store is not reachable; admissions follow on_error until it is"
                );
                store.mark_down(e);
            }
        }
        store.publish_mode();
        let watch = Arc::clone(&store);
        store.runtime.spawn(async move { watch.watch_idle().await });
        if store.cfg.cluster {
            let sender = Arc::clone(&store);
            store.runtime.spawn(sender.send_answers_every());
        }
        Ok(store)
    }

    /// This process's monotonic clock, in nanoseconds since the store started (slices' ages).
    pub(super) fn mono(&self) -> crate::clock::Nanos {
        self.started.elapsed().as_nanos() as crate::clock::Nanos + 1
    }

    /// Notes that the store answered (a call, or the idle watch's PING).
    fn answered(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.answered_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether the store has answered nothing for `quiet`.
    fn quiet_for(&self, quiet: Duration) -> bool {
        let last = self.answered_ms.load(Ordering::Relaxed);
        let now = self.started.elapsed().as_millis() as u64;
        now.saturating_sub(last) >= quiet.as_millis() as u64
    }

    /// The idle watch, on the store's thread for the process's life: while the store is up and
    /// quiet, a PING every [`IDLE_PING_EVERY`], whose failure counts as a failed call (see the
    /// module's doc). A busy store is never PINGed: its calls tell.
    async fn watch_idle(self: Arc<Self>) {
        loop {
            tokio::time::sleep(IDLE_PING_EVERY).await;
            if !self.is_up() || !self.quiet_for(IDLE_PING_EVERY) {
                continue;
            }
            let Some(conns) = self.conns.load_full() else {
                continue;
            };
            let ping = redis::cmd("PING");
            let answer = match &*conns {
                Conns::Single { pool, .. } => {
                    within(IDLE_PING_LIMIT, ping.query_async(&mut pool[0].clone())).await
                }
                Conns::Cluster { client, .. } => {
                    within(IDLE_PING_LIMIT, ping.query_async(&mut client.clone())).await
                }
            };
            drop(conns);
            match answer {
                Ok(_) => {
                    self.answered();
                    self.failures.store(0, Ordering::Release);
                }
                Err(e) => self.failed(&e),
            }
        }
    }

    /// Opens the connections (within a second per node) and loads the script.
    async fn connect(self: &Arc<Self>) -> Result<(), String> {
        let limit = Duration::from_secs(1).max(self.cfg.timeout);
        let urls = self.cfg.urls();
        let conns = if self.cfg.cluster {
            let client = redis::cluster::ClusterClient::builder(urls)
                .connection_timeout(limit)
                .response_timeout(limit.max(Duration::from_secs(1)))
                .build()
                .map_err(|e| e.to_string())?;
            let c = tokio::time::timeout(limit, client.get_async_connection())
                .await
                .map_err(|_| "connecting timed out".to_string())?
                .map_err(|e| e.to_string())?;
            // Where each slot is, for the lanes: known before the store counts as up.
            let seen = self.nodes.map().map_or(0, |m| m.epoch());
            self.read_map(&c, seen).await?;
            Conns::Cluster {
                client: c,
                generation: self.generation.fetch_add(1, Ordering::AcqRel) + 1,
            }
        } else {
            let url = urls.first().cloned().unwrap_or_default();
            let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
            let mut v = Vec::with_capacity(self.cfg.pool_size);
            for _ in 0..self.cfg.pool_size {
                let c = tokio::time::timeout(
                    limit,
                    client.get_multiplexed_async_connection_with_config(&connection_config(limit)),
                )
                .await
                .map_err(|_| "connecting timed out".to_string())?
                .map_err(|e| e.to_string())?;
                v.push(c);
            }
            Conns::Single {
                client: Box::new(client),
                pool: v,
                generation: self.generation.fetch_add(1, Ordering::AcqRel) + 1,
            }
        };
        let conns = Arc::new(conns);
        // A PING proves the connection (and the credentials in the URL).
        let ping = redis::cmd("PING");
        let pong: Result<String, redis::RedisError> = match &*conns {
            Conns::Single { pool, .. } => ping.query_async(&mut pool[0].clone()).await,
            Conns::Cluster { client, .. } => ping.query_async(&mut client.clone()).await,
        };
        pong.map_err(|e| e.to_string())?;
        self.answered();
        self.conns.store(Some(conns));
        self.failures.store(0, Ordering::Release);
        self.up.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether admissions are decided on the shared state now.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// How admissions are decided now.
    pub fn mode(&self) -> StoreMode {
        if self.is_up() {
            return StoreMode::Shared;
        }
        match self.cfg.on_error {
            OnError::FailClosed => StoreMode::FailClosed,
            OnError::FailOpen => StoreMode::FailOpen,
            OnError::LocalFallback => StoreMode::LocalFallback,
        }
    }

    pub fn on_error(&self) -> OnError {
        self.cfg.on_error
    }

    /// The replicas `local_fallback` divides every limit by.
    pub fn replicas(&self) -> u32 {
        self.cfg.replicas
    }

    /// For `/readyz`: whether the store answers, and what is known about it.
    pub fn readiness(&self) -> (bool, Value) {
        let up = self.is_up();
        let mut v = json!({
            "kind": "redis",
            "cluster": self.cfg.cluster,
            "state": if up { "connected" } else { "unreachable" },
            "mode": self.mode().as_str(),
            "on_error": self.cfg.on_error.as_str(),
        });
        if !up {
            v["error"] = Value::String(self.last_error.lock().clone());
        }
        (up, v)
    }

    fn publish_mode(&self) {
        let now = self.mode();
        for m in StoreMode::ALL {
            if m != StoreMode::Memory {
                metrics::gauge!(names::STORE_MODE, "mode" => m.as_str()).set(if m == now {
                    1.0
                } else {
                    0.0
                });
            }
        }
    }

    fn mark_down(self: &Arc<Self>, why: String) {
        *self.last_error.lock() = why;
        self.conns.store(None);
        // Slices of a store that may come back without its state (a restart) are not spent on it:
        // forgotten, as a killed replica's would be.
        self.slices.drain();
        let was_up = self.up.swap(false, Ordering::AcqRel);
        if was_up {
            tracing::warn!(
                store = "redis",
                error = %self.last_error.lock(),
                on_error = self.cfg.on_error.as_str(),
                "the shared store stopped answering; admissions follow on_error until it is back"
            );
        }
        self.publish_mode();
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = Arc::clone(self);
        self.runtime.spawn(async move {
            // The first try at once: a connection found dead may be one Redis dropped when it
            // restarted, and Redis may answer already; then the sheds of `fail_closed` last one
            // reconnection, not a probe interval.
            let mut first = true;
            loop {
                if !first {
                    tokio::time::sleep(PROBE_EVERY).await;
                }
                first = false;
                match me.connect().await {
                    Ok(()) => {
                        tracing::info!(
                            store = "redis",
                            "the shared store answers again; shared enforcement resumes"
                        );
                        break;
                    }
                    Err(e) => *me.last_error.lock() = e,
                }
            }
            me.probing.store(false, Ordering::Release);
            me.publish_mode();
        });
    }

    fn failed(self: &Arc<Self>, e: &StoreError) {
        metrics::counter!(names::STORE_ERRORS, "kind" => e.kind()).increment(1);
        let in_a_row = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let broken = matches!(e, StoreError::Connection(_));
        if broken || in_a_row >= FAILURES_TO_DOWN {
            self.mark_down(e.to_string());
        } else {
            *self.last_error.lock() = e.to_string();
        }
    }

    /// One operation of the script, bounded by the timeout. It goes on the calling worker's lane
    /// ([`super::lane`]), batched with the worker's other operations: on one server its only lane,
    /// on a cluster its lane to the node that serves `route`'s slot ([`super::nodes`]). Snapshots
    /// go on the store's own connections (on a cluster, the cluster client, routed by `route`).
    pub(super) async fn invoke(
        self: &Arc<Self>,
        route: &str,
        op: &'static str,
        spec: impl Into<Vec<u8>>,
        data: impl Into<Vec<u8>>,
    ) -> Result<redis::Value, StoreError> {
        let (spec, data) = (spec.into(), data.into());
        let Some(conns) = self.conns.load_full() else {
            return Err(StoreError::Connection(self.last_error.lock().clone()));
        };
        let started = Instant::now();
        let out = match &*conns {
            Conns::Single {
                client, generation, ..
            } if op != "snapshot" => {
                let (answer, answered) = tokio::sync::oneshot::channel();
                let queued = Queued {
                    route: route.to_string(),
                    op,
                    spec,
                    data,
                    answer,
                };
                let sent = self.lanes.enqueue(client, *generation, "", queued);
                drop(conns);
                if sent {
                    match tokio::time::timeout(self.cfg.timeout, answered).await {
                        Err(_) => Err(StoreError::Timeout),
                        Ok(Err(_)) => Err(StoreError::Connection(
                            "the connection ended with the call".into(),
                        )),
                        Ok(Ok(r)) => r.answer(),
                    }
                } else {
                    Err(StoreError::Connection("the connection has ended".into()))
                }
            }
            Conns::Cluster { client, generation } if op != "snapshot" => {
                let (client, generation) = (client.clone(), *generation);
                drop(conns);
                self.routed(&client, generation, route, op, spec, data)
                    .await
            }
            _ => {
                let mut inv = self.script.key(route);
                inv.arg(op).arg(spec).arg(data);
                let call = async {
                    match &*conns {
                        Conns::Single { pool, .. } => {
                            let i = self.next.fetch_add(1, Ordering::Relaxed) % pool.len();
                            inv.invoke_async::<redis::Value>(&mut pool[i].clone()).await
                        }
                        Conns::Cluster { client, .. } => {
                            inv.invoke_async::<redis::Value>(&mut client.clone()).await
                        }
                    }
                };
                within(self.cfg.timeout, call).await
            }
        };
        self.telemetry
            .store_round_trip(started.elapsed().as_secs_f64());
        match &out {
            Ok(_) => {
                self.failures.store(0, Ordering::Release);
                self.answered();
            }
            Err(e) => self.failed(e),
        }
        out
    }

    fn key(&self, tenant: &str, k: &StateKey) -> String {
        self.keys.key(tenant, k)
    }

    /// Decides a call: one round trip, or in a cluster one more per hash tag of the cross-tenant
    /// state the call spends (its tenant's shard first, then each shared upstream's and the global
    /// buckets'; when a part refuses, those before it are given back) that this replica's slices
    /// do not cover (see [`super::slices`]).
    pub async fn decide(
        self: Arc<Self>,
        tenant: Arc<str>,
        call: Arc<RemoteCall>,
    ) -> Result<RemoteAnswer, StoreError> {
        let n = call.layers.len();
        let cross = self.cfg.cluster
            && (call.layers.iter().any(|l| l.key.cross_tenant())
                || call.penalties.iter().any(|p| p.key.cross_tenant())
                || call.adaptive.iter().any(|a| a.key.cross_tenant()));
        if !cross {
            let p = spec::decide_spec(&self.keys, &tenant, &call, Part::All);
            let v = self.invoke(&p.route, "decide", p.spec, p.data).await;
            return parse_decide(v, &p.map, n);
        }
        if let Some(answer) = self.decide_sliced(&tenant, &call).await {
            return answer;
        }
        let p = spec::decide_spec(&self.keys, &tenant, &call, Part::Tenant);
        let first = parse_decide(
            self.invoke(&p.route, "decide", p.spec, p.data).await,
            &p.map,
            n,
        )?;
        let RemoteAnswer::Admitted {
            hold_us: mut hold,
            mut layers,
            spend,
        } = first
        else {
            return Ok(first);
        };
        // Then the part of each cross-tenant hash tag (each shared upstream's, the global buckets'),
        // on its own shard: the call is admitted when every part admits it.
        let mut taken: Vec<(String, f64)> = Vec::new();
        for tag in spec::cross_tags(&self.keys, &tenant, &call) {
            let p = spec::decide_spec(&self.keys, &tenant, &call, Part::Cross(&tag));
            let answer = parse_decide(
                self.invoke(&p.route, "decide", p.spec, p.data).await,
                &p.map,
                n,
            );
            match answer {
                // A cross part answers what each of its layers took after their figures.
                Ok(RemoteAnswer::Admitted {
                    hold_us,
                    layers: part,
                    spend: took,
                }) => {
                    hold = hold.max(hold_us);
                    layers = merge(layers, part);
                    for (j, &g) in p.map.iter().enumerate() {
                        let key = self.key(&tenant, &call.layers[g].key);
                        taken.push((key, took.get(j).copied().unwrap_or(0.0)));
                    }
                }
                mut other => {
                    // What the call took is given back: it is refused (or not decided) as a whole.
                    let _ = self
                        .clone()
                        .release(tenant.clone(), call.lease, None, Refund::Always)
                        .await;
                    for (key, us) in &taken {
                        self.give_back_us(key, *us).await;
                    }
                    if let Ok(RemoteAnswer::Refused { layers: part, .. }) = &mut other {
                        *part = merge(layers, std::mem::take(part));
                    }
                    return other;
                }
            }
        }
        // Spend budgets are the tenant's: the first part answered them.
        Ok(RemoteAnswer::Admitted {
            hold_us: hold,
            layers,
            spend,
        })
    }

    /// Ends a lease; `None` when the store holds no such lease.
    pub async fn release(
        self: Arc<Self>,
        tenant: Arc<str>,
        lease: u64,
        info: Option<ReleaseInfo>,
        refund: Refund,
    ) -> Result<Option<StoreReleased>, StoreError> {
        self.release_settled(tenant, lease, info, refund, None)
            .await
    }

    /// [`RedisStore::release`] with what the call actually spent per spend unit and in cost units
    /// (`settle`; without it each estimate and the admission's cost stand, and a cancellation gives
    /// the estimates back).
    pub async fn release_settled(
        self: Arc<Self>,
        tenant: Arc<str>,
        lease: u64,
        info: Option<ReleaseInfo>,
        refund: Refund,
        settle: Option<crate::engine::Settlement>,
    ) -> Result<Option<StoreReleased>, StoreError> {
        let cancel = info
            .as_ref()
            .is_some_and(|i| i.outcome == crate::engine::Outcome::Cancelled);
        let limited = info.as_ref().is_some_and(ReleaseInfo::rate_limited);
        // How the answer counts besides a 429, as in memory (`ReleaseInfo`): a cancelled call's not
        // at all, a 503 as no accept, only an ok answer below 500 as healthy.
        let report = info.as_ref().is_some_and(|i| limited || i.reports_answer());
        let accepted = info.as_ref().is_none_or(ReleaseInfo::accepted);
        let healthy = info.as_ref().is_some_and(ReleaseInfo::healthy);
        let retry_after = info
            .as_ref()
            .and_then(|i| i.retry_after)
            .map_or(-1.0, |d| d.as_micros() as f64);
        let duration = info
            .as_ref()
            .and_then(|i| i.duration_ms)
            .map_or(-1.0, |ms| ms as f64 * 1e3);
        let refund = match refund {
            Refund::Always => "always",
            Refund::Never => "never",
            Refund::IfHeld => match info.as_ref().map(|i| i.outcome) {
                Some(crate::engine::Outcome::Cancelled) => "hold",
                _ => "never",
            },
        };
        let spec = spec::release_spec(
            &self.keys,
            &tenant,
            lease,
            spec::ReleaseSpec {
                refund,
                report,
                limited,
                retry_after,
                default_penalty: DEFAULT_PENALTY_US,
                duration,
                cancel,
                ok: accepted,
                healthy,
                settle: settle.as_ref(),
            },
        );
        let route = self.keys.tenant_base(&tenant);
        let v = self.invoke(&route, "release", spec, String::new()).await?;
        let parts = strings(v)?;
        if parts.first().map(String::as_str) != Some("released") || parts.len() < 8 {
            return Ok(None);
        }
        // A cluster's cross-tenant layers, which the script could not reach, settle their cost here.
        if let (Some(admitted), Some(layers), Some(cost)) = (
            parts.get(9),
            parts.get(10),
            settle.as_ref().and_then(|s| s.cost),
        ) {
            self.settle_cross(admitted, layers, cost).await;
        }
        let mut penalty_us: f64 = parts[1].parse().unwrap_or(0.0);
        if let Some(probe) = parts.get(8) {
            self.write_probe(&tenant, probe, limited).await;
        }
        // A shared upstream in a cluster: its state lives on another shard, where the answer goes
        // at once, with the others this replica gathers, or not at all (see `super::answers`).
        if !parts[5].is_empty() && report {
            if let Ok(u) = serde_json::from_str::<Value>(&parts[5]) {
                if let Ok(Some(p)) = self
                    .report_shared(&tenant, u, limited, accepted, healthy, retry_after)
                    .await
                {
                    penalty_us = p;
                }
                if limited {
                    // This replica's slice of the upstream's bucket stops at once.
                    self.halt_shared(&tenant, &parts[4], penalty_us).await;
                }
            }
        }
        let hold_until: f64 = parts[6].parse().unwrap_or(0.0);
        let now: f64 = parts[7].parse().unwrap_or(0.0);
        Ok(Some(StoreReleased {
            subject: parts[2].clone(),
            tool: parts[3].clone(),
            upstream: (!parts[4].is_empty()).then(|| parts[4].clone()),
            penalty: (penalty_us > 0.0).then(|| Duration::from_micros(penalty_us as u64)),
            held_us: (now - hold_until).max(0.0),
        }))
    }

    /// Reads a tenant's state for its snapshot.
    pub async fn snapshot(
        self: Arc<Self>,
        plan: RemoteSnapshotPlan,
    ) -> Result<RemoteSnapshotState, StoreError> {
        let tenant = plan.tenant.clone();
        let base = self.keys.tenant_base(&tenant);
        // Cross-tenant upstream state is read from its own shard in a cluster; in one server the
        // same script reads it.
        let up_keys = |shared_ok: bool| -> (Vec<String>, Vec<String>) {
            plan.upstreams
                .iter()
                .map(|(u, shared, _)| {
                    let shared = *shared && shared_ok;
                    (
                        self.key(&tenant, &StateKey::Penalty(u.clone(), shared)),
                        self.key(&tenant, &StateKey::UpstreamState(u.clone(), shared)),
                    )
                })
                .unzip()
        };
        let (pens, ups) = up_keys(true);
        // The tenant's day figure of each spend unit (under the tenant's hash tag).
        let spend: Vec<String> = plan
            .spend
            .iter()
            .map(|(unit, _)| self.key(&tenant, &StateKey::SpendTenant(unit.clone())))
            .collect();
        let spec = json!({
            "h": self.keys.hash(&tenant),
            "z": self.keys.leases(&tenant),
            "tenant_quota": format!("{base}:q:t"),
            "subject_quota": format!("{base}:q:s:"),
            "index": format!("{base}:subjects"),
            "max_subjects": 100,
            "pens": if self.cfg.cluster { up_keys(false).0 } else { pens.clone() },
            "ups": if self.cfg.cluster { up_keys(false).1 } else { ups.clone() },
            "forget": 120e6, "pl": spec::PROBE_LEN_US,
            "spend": spend,
        });
        let v = self
            .invoke(&base, "snapshot", spec.to_string(), String::new())
            .await?;
        let text: String =
            redis::from_redis_value(v).map_err(|e| StoreError::Script(e.to_string()))?;
        let raw: Value =
            serde_json::from_str(&text).map_err(|e| StoreError::Script(e.to_string()))?;
        let f = |v: &Value| v.as_f64().unwrap_or(0.0);
        let mut upstreams: Vec<(f64, f64)> = raw["ups"]
            .as_array()
            .map(|a| {
                raw["pens"]
                    .as_array()
                    .unwrap_or(&Vec::new())
                    .iter()
                    .zip(a)
                    .map(|(p, m)| (f(p), f(m)))
                    .collect()
            })
            .unwrap_or_default();
        // In a cluster each shared upstream's penalty and multiplier are read on its own shard.
        for (i, (_, shared, _)) in plan.upstreams.iter().enumerate() {
            if !self.cfg.cluster || !*shared {
                continue;
            }
            let spec = json!({
                "h": "", "z": "", "tenant_quota": "", "subject_quota": "", "index": "",
                "max_subjects": 0,
                "pens": [pens[i]], "ups": [ups[i]], "forget": 120e6, "pl": spec::PROBE_LEN_US,
            });
            let v = self
                .invoke(&ups[i], "snapshot", spec.to_string(), String::new())
                .await?;
            let text: String =
                redis::from_redis_value(v).map_err(|e| StoreError::Script(e.to_string()))?;
            let cross: Value =
                serde_json::from_str(&text).map_err(|e| StoreError::Script(e.to_string()))?;
            if let (Some(p), Some(m), Some(slot)) = (
                cross["pens"].get(0),
                cross["ups"].get(0),
                upstreams.get_mut(i),
            ) {
                *slot = (f(p), f(m));
            }
        }
        let subjects = raw["subjects"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| {
                        (
                            s["name"].as_str().unwrap_or_default().to_string(),
                            f(&s["tat"]),
                            s["inflight"].as_u64().unwrap_or(0) as u32,
                            f(&s["quota"]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        // An empty Lua table is encoded as an object: no figure, nothing spent.
        let spend = (0..plan.spend.len())
            .map(|i| raw["spend"].get(i).map_or(0.0, f))
            .collect();
        Ok(RemoteSnapshotState {
            now_us: f(&raw["now"]),
            tenant_tat_us: f(&raw["tenant_tat"]),
            tenant_inflight: raw["tenant_inflight"].as_u64().unwrap_or(0) as u32,
            tenant_quota_used: f(&raw["tenant_quota"]),
            day_ends_us: f(&raw["day_ends"]),
            subjects,
            upstreams,
            spend,
        })
    }

    /// Gives back a hash tag's worth of what [`RedisStore::decide`] reports it took, for tests of the
    /// key layout.
    pub fn tag_of(&self, tenant: &str, k: &StateKey) -> String {
        hash_tag(&self.key(tenant, k)).to_string()
    }
}
