//! The Redis store: admission state shared by every replica that points at the same Redis (or Redis
//! Cluster), decided by one server-side script per call (`admitd.lua`).
//!
//! On one server, each worker thread sends its decisions and releases on a connection of its own,
//! driven on that worker (its *lane*): the operations queued while Redis runs a batch go together
//! in the next script call, so under load a script call carries many decisions and an answer wakes
//! the worker that waits for it with no other thread between. The store's own thread
//! (`admitd-store`, a single-threaded tokio runtime) connects, probes a store that went down, and
//! carries snapshots on `pool_size` connections; in a Redis Cluster it carries every call (one
//! script call per operation, routed to the shard of its keys), pipelined on the cluster
//! connection.
//!
//! Failures: every call is bounded by `[store] timeout`. A broken connection, or three failed calls
//! in a row, marks the store down: connections are dropped, calls go straight to the `on_error`
//! policy without touching the network, and a probe reconnects every [`PROBE_EVERY`] until Redis
//! answers a PING, when shared enforcement resumes.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use serde::Serialize;
use serde_json::{json, Value};

use super::keys::{hash_tag, Keys};
use super::StoreMode;
use crate::config::{OnError, StoreConfig};
use crate::engine::{
    ReleaseInfo, RemoteAnswer, RemoteCall, RemoteScope, RemoteSnapshotPlan, RemoteSnapshotState,
    StateKey, UpstreamReport,
};
use crate::telemetry::names;
use crate::telemetry::Telemetry;

/// How often a store marked down is tried again.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);
/// Failed calls in a row that mark the store down (a broken connection does at once).
const FAILURES_TO_DOWN: u32 = 3;
/// The penalty of a 429 reported without a Retry-After.
const DEFAULT_PENALTY_US: f64 = 1e6;

/// How long an upstream's AIMD cut is remembered when the call does not say (microseconds).
const FORGET_US: f64 = 120e6;
/// The most operations one script call carries (see [`RedisStore::batcher`]): a batch keeps Redis
/// busy for about this many decisions, so this also bounds how long one batch delays others.
const MAX_BATCH: usize = 32;

const SCRIPT: &str = include_str!("admitd.lua");

/// Why a call to the store did not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// No answer within `[store] timeout`.
    Timeout,
    /// Not connected, or the connection broke.
    Connection(String),
    /// Redis answered with an error.
    Script(String),
}

impl StoreError {
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::Script(_) => "script",
        }
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Timeout => write!(f, "no answer within the store timeout"),
            StoreError::Connection(e) => write!(f, "not connected: {e}"),
            StoreError::Script(e) => write!(f, "the store answered an error: {e}"),
        }
    }
}

enum Conns {
    /// One server: the client each worker's lane connects with (`generation` counts the store's
    /// connections, so a lane made before a reconnection is made again), and `pool_size`
    /// connections of the store's thread for the rest (snapshots, probes).
    Single {
        client: Box<redis::Client>,
        pool: Vec<redis::aio::MultiplexedConnection>,
        generation: u64,
    },
    Cluster(redis::cluster_async::ClusterConnection),
}

/// A worker thread's way to one server: a connection of its own, driven on that thread, and the
/// queue of its batcher (see [`RedisStore::lane`]).
struct Lane {
    /// The store it belongs to (its address) and the connection generation it was made in.
    store: usize,
    generation: u64,
    queue: tokio::sync::mpsc::UnboundedSender<Queued>,
}

thread_local! {
    static LANES: std::cell::RefCell<Vec<Lane>> = const { std::cell::RefCell::new(Vec::new()) };
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
    cfg: StoreConfig,
    keys: Keys,
    script: redis::Script,
    conns: ArcSwapOption<Conns>,
    up: AtomicBool,
    failures: AtomicU32,
    probing: AtomicBool,
    next: AtomicUsize,
    runtime: tokio::runtime::Handle,
    telemetry: Telemetry,
    last_error: parking_lot::Mutex<String>,
    /// Connections made so far (see [`Conns::Single`]).
    generation: std::sync::atomic::AtomicU64,
}

impl RedisStore {
    /// Starts the store's thread and connects. A Redis that is not reachable yet is not an error:
    /// the store starts down (admissions follow `on_error`) and connects when Redis answers.
    pub async fn start(cfg: &StoreConfig, telemetry: Telemetry) -> Result<Arc<Self>, String> {
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
            script: redis::Script::new(SCRIPT),
            conns: ArcSwapOption::empty(),
            up: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            runtime,
            telemetry,
            last_error: parking_lot::Mutex::new("not connected yet".into()),
            generation: std::sync::atomic::AtomicU64::new(0),
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
        Ok(store)
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
            Conns::Cluster(c)
        } else {
            let url = urls.first().cloned().unwrap_or_default();
            let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
            let mut v = Vec::with_capacity(self.cfg.pool_size);
            for _ in 0..self.cfg.pool_size {
                let c = tokio::time::timeout(limit, client.get_multiplexed_async_connection())
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
            Conns::Cluster(c) => ping.query_async(&mut c.clone()).await,
        };
        pong.map_err(|e| e.to_string())?;
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
            loop {
                tokio::time::sleep(PROBE_EVERY).await;
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

    /// One operation of the script, bounded by the timeout. On one server it goes on the calling
    /// worker's lane ([`RedisStore::lane`]), batched with the worker's other operations; a cluster
    /// gets one script call per operation, routed by `route` to the shard of its keys.
    async fn invoke(
        self: &Arc<Self>,
        route: &str,
        op: &'static str,
        spec: String,
        data: String,
    ) -> Result<redis::Value, StoreError> {
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
                let sent = self.enqueue(client, *generation, queued);
                drop(conns);
                if sent {
                    match tokio::time::timeout(self.cfg.timeout, answered).await {
                        Err(_) => Err(StoreError::Timeout),
                        Ok(Err(_)) => Err(StoreError::Connection(
                            "the connection ended with the call".into(),
                        )),
                        Ok(Ok(r)) => r,
                    }
                } else {
                    Err(StoreError::Connection("the connection has ended".into()))
                }
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
                        Conns::Cluster(c) => inv.invoke_async::<redis::Value>(&mut c.clone()).await,
                    }
                };
                self.bounded(call).await
            }
        };
        self.telemetry
            .store_round_trip(started.elapsed().as_secs_f64());
        match &out {
            Ok(_) => self.failures.store(0, Ordering::Release),
            Err(e) => self.failed(e),
        }
        out
    }

    /// Queues an operation on this worker's lane, making the lane first if the worker has none for
    /// this connection generation (or its lane ended). False when the lane cannot take it.
    fn enqueue(self: &Arc<Self>, client: &redis::Client, generation: u64, q: Queued) -> bool {
        let id = Arc::as_ptr(self) as usize;
        LANES.with(|lanes| {
            let mut lanes = lanes.borrow_mut();
            lanes.retain(|l| l.store != id || (l.generation == generation && !l.queue.is_closed()));
            let i = match lanes.iter().position(|l| l.store == id) {
                Some(i) => i,
                None => {
                    let (queue, rx) = tokio::sync::mpsc::unbounded_channel();
                    tokio::spawn(Arc::clone(self).lane(client.clone(), rx));
                    lanes.push(Lane {
                        store: id,
                        generation,
                        queue,
                    });
                    lanes.len() - 1
                }
            };
            lanes[i].queue.send(q).is_ok()
        })
    }

    /// A worker's lane: its own connection, driven on the worker's thread (so an answer wakes the
    /// worker directly, with no other thread between), and its batcher. One script call carries
    /// every operation queued since the last one left, up to [`MAX_BATCH`], with at most
    /// `pool_size` (at least two) batches in flight. Under light load a batch is one operation and
    /// leaves at once; under load the operations that arrive while Redis runs a batch go together
    /// in the next, so the per-call costs on both sides (the script call, a command's framing, the
    /// wake-ups) are paid once per batch. Each operation in a batch is still decided on its own,
    /// all or nothing, and answered in order. The lane ends when the worker drops its queue (a new
    /// connection generation) or its connection cannot be made.
    async fn lane(
        self: Arc<Self>,
        client: redis::Client,
        mut queue: tokio::sync::mpsc::UnboundedReceiver<Queued>,
    ) {
        let limit = Duration::from_secs(1).max(self.cfg.timeout);
        let con = match tokio::time::timeout(limit, client.get_multiplexed_async_connection()).await
        {
            Ok(Ok(con)) => con,
            failed => {
                let e = match failed {
                    Ok(Err(e)) => StoreError::Connection(e.to_string()),
                    _ => StoreError::Connection("connecting timed out".into()),
                };
                queue.close();
                while let Ok(q) = queue.try_recv() {
                    let _ = q.answer.send(Err(e.clone()));
                }
                return;
            }
        };
        let in_flight = Arc::new(tokio::sync::Semaphore::new(self.cfg.pool_size.max(2)));
        while let Some(first) = queue.recv().await {
            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(q) => batch.push(q),
                    Err(_) => break,
                }
            }
            // A caller that stopped waiting (its timeout passed, and `on_error` answered it) gets no
            // decision behind its back: nothing is spent and no lease is left for nobody.
            batch.retain(|q| !q.answer.is_closed());
            if batch.is_empty() {
                continue;
            }
            let me = Arc::clone(&self);
            let con = con.clone();
            tokio::spawn(async move {
                me.send_batch(con, batch).await;
                drop(permit);
            });
        }
    }

    /// A call to Redis bounded by `[store] timeout`.
    async fn bounded(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<redis::Value>>,
    ) -> Result<redis::Value, StoreError> {
        match tokio::time::timeout(self.cfg.timeout, call).await {
            Err(_) => Err(StoreError::Timeout),
            Ok(r) => r.map_err(store_error),
        }
    }

    async fn send_batch(&self, mut con: redis::aio::MultiplexedConnection, mut batch: Vec<Queued>) {
        if batch.len() == 1 {
            let q = batch.remove(0);
            let mut inv = self.script.key(&q.route);
            inv.arg(q.op).arg(q.spec).arg(q.data);
            let _ = q
                .answer
                .send(in_flight_bound(inv.invoke_async(&mut con)).await);
            return;
        }
        let mut inv = self.script.key(&batch[0].route);
        inv.arg("batch");
        for q in &batch {
            inv.arg(q.op).arg(&q.spec).arg(&q.data);
        }
        match in_flight_bound(inv.invoke_async(&mut con)).await {
            Ok(redis::Value::Array(items)) if items.len() == batch.len() => {
                for (q, item) in batch.into_iter().zip(items) {
                    let _ = q.answer.send(batch_item(item));
                }
            }
            other => {
                let e = match other {
                    Err(e) => e,
                    Ok(v) => StoreError::Script(format!("unexpected answer to a batch: {v:?}")),
                };
                for q in batch {
                    let _ = q.answer.send(Err(e.clone()));
                }
            }
        }
    }

    fn key(&self, tenant: &str, k: &StateKey) -> String {
        self.keys.key(tenant, k)
    }

    /// The spec of the part of `call` whose keys are cross-tenant (`cross`) or the tenant's own, and
    /// what its lease keeps for the release. `split`: whether the call is split in two parts (a
    /// cluster); otherwise one part has it all. Returns the spec, the lease data, the key that routes
    /// them and, per layer of the part, its index in the call.
    fn decide_spec(&self, tenant: &str, call: &RemoteCall, part: Part) -> DecideParts {
        let keep = |k: &StateKey| match part {
            Part::All => true,
            Part::Tenant => !k.cross_tenant(),
            Part::Cross => k.cross_tenant(),
        };
        let mut map = Vec::new();
        let mut layers = Vec::new();
        for (i, l) in call.layers.iter().enumerate() {
            if !keep(&l.key) {
                continue;
            }
            map.push(i);
            layers.push(LayerSpec {
                k: self.key(tenant, &l.key),
                t: l.t_us,
                b: l.burst,
                n: l.tokens,
                hold: l.hold,
                m: l.aimd
                    .as_ref()
                    .map_or(String::new(), |m| self.key(tenant, m)),
                f: l.forget_us,
            });
        }
        let local_index = |global: usize| {
            // 1-based in the part, 0 when the layer is in the other part.
            if global == 0 {
                return 0;
            }
            map.iter()
                .position(|&g| g + 1 == global)
                .map_or(0, |p| p + 1)
        };
        let pen: Vec<PenaltySpec> = call
            .penalties
            .iter()
            .filter(|p| keep(&p.key))
            .map(|p| PenaltySpec {
                k: self.key(tenant, &p.key),
                layer: local_index(p.layer),
                step: p.step_us,
            })
            .collect();
        let ad: Vec<AdaptiveSpec> = call
            .adaptive
            .iter()
            .filter(|a| keep(&a.key))
            .map(|a| AdaptiveSpec {
                k: self.key(tenant, &a.key),
                w: a.window_us,
                big_k: a.k,
                min: a.min_requests,
                step: a.step_us,
            })
            .collect();
        let own = part != Part::Cross;
        let conc: Vec<SlotsSpec> = if own {
            call.slots
                .iter()
                .map(|c| SlotsSpec {
                    k: self.key(tenant, &c.key),
                    cap: c.cap,
                    sub: c.subject,
                    x: tied_layer(call, &map, c.subject),
                    // The hint cursor of the scope, in the tenant's run-times hash.
                    cursor: if c.subject {
                        format!("cs:{}", call.subject)
                    } else {
                        "ct".to_string()
                    },
                })
                .collect()
        } else {
            Vec::new()
        };
        let quota: Vec<QuotaSpec> = if own {
            call.quotas
                .iter()
                .map(|q| QuotaSpec {
                    k: self.key(tenant, &q.key),
                    q: q.quota,
                    sub: q.subject,
                })
                .collect()
        } else {
            Vec::new()
        };
        let split = part != Part::All;
        let lease = if own {
            self.key(tenant, &StateKey::Lease(call.lease))
        } else {
            String::new()
        };
        let data = LeaseData {
            subject: &call.subject,
            tool: &call.tool,
            cost: call.cost,
            keys: layers.iter().map(|l| l.k.as_str()).collect(),
            quotas: quota.iter().map(|q| q.k.as_str()).collect(),
            zsets: conc.iter().map(|c| c.k.as_str()).collect(),
            up: call
                .upstreams
                .iter()
                .map(|u| self.report_spec(tenant, u, split && u.cross_tenant()))
                .collect(),
        };
        let data = serde_json::to_string(&data).unwrap_or_default();
        let spec = DecideSpec {
            lease,
            id: format!("{:016x}", call.lease),
            subject: &call.subject,
            max_wait: call.max_wait_us,
            ttl: call.ttl_us,
            shadow: call.shadow && own,
            returning: call.returning,
            rand: call.rand,
            floor: call.floor_us,
            forget: FORGET_US,
            cost: call.cost,
            pen,
            ad,
            conc,
            quota,
            layers,
            rt: RunTimesSpec {
                k: self.key(tenant, &StateKey::RunTimes),
                f: &call.tool,
            },
            index: if own && call.index {
                self.key(tenant, &StateKey::SubjectIndex)
            } else {
                String::new()
            },
        };
        let route = match part {
            Part::Cross => format!("{}:route", self.keys.cross_base()),
            _ => self.keys.tenant_base(tenant),
        };
        DecideParts {
            spec: serde_json::to_string(&spec).unwrap_or_default(),
            data,
            route,
            map,
        }
    }

    fn report_spec<'a>(
        &self,
        tenant: &str,
        u: &'a UpstreamReport,
        cross_part: bool,
    ) -> ReportSpec<'a> {
        ReportSpec {
            n: &u.name,
            p: self.key(tenant, &u.penalty),
            s: self.key(tenant, &u.state),
            aw: u.adaptive_window_us,
            forget: u.forget_us,
            x: cross_part,
            af: u.aimd.map(|a| a.0),
            afl: u.aimd.map(|a| a.1),
            ar: u.aimd.map(|a| a.2),
        }
    }

    /// Decides a call: one round trip, or in a cluster two when the call spends cross-tenant state
    /// (its tenant's shard first; if the second part refuses, the first is given back).
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
            let p = self.decide_spec(&tenant, &call, Part::All);
            let v = self.invoke(&p.route, "decide", p.spec, p.data).await;
            return parse_decide(v, &p.map, n);
        }
        let p = self.decide_spec(&tenant, &call, Part::Tenant);
        let first = parse_decide(
            self.invoke(&p.route, "decide", p.spec, p.data).await,
            &p.map,
            n,
        )?;
        let RemoteAnswer::Admitted {
            hold_us: hold_a,
            layers: layers_a,
        } = first
        else {
            return Ok(first);
        };
        let p = self.decide_spec(&tenant, &call, Part::Cross);
        let second = parse_decide(
            self.invoke(&p.route, "decide", p.spec, p.data).await,
            &p.map,
            n,
        );
        match second {
            Ok(RemoteAnswer::Admitted { hold_us, layers }) => Ok(RemoteAnswer::Admitted {
                hold_us: hold_us.max(hold_a),
                layers: merge(layers_a, layers),
            }),
            other => {
                // The tenant's part is given back: the call is refused (or not decided) as a whole.
                let _ = self
                    .clone()
                    .release(tenant.clone(), call.lease, None, Refund::Always)
                    .await;
                match other {
                    Ok(RemoteAnswer::Refused {
                        scope,
                        wait_us,
                        booked,
                        account_wide,
                        layers,
                        multiplier,
                    }) => Ok(RemoteAnswer::Refused {
                        scope,
                        wait_us,
                        booked,
                        account_wide,
                        layers: merge(layers_a, layers),
                        multiplier,
                    }),
                    other => other,
                }
            }
        }
    }

    /// Ends a lease; `None` when the store holds no such lease.
    pub async fn release(
        self: Arc<Self>,
        tenant: Arc<str>,
        lease: u64,
        info: Option<ReleaseInfo>,
        refund: Refund,
    ) -> Result<Option<StoreReleased>, StoreError> {
        let limited = info.as_ref().is_some_and(|i| {
            i.outcome == crate::engine::Outcome::UpstreamRateLimited
                || i.upstream_status == Some(429)
        });
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
        let spec = json!({
            "lease": self.key(&tenant, &StateKey::Lease(lease)),
            "id": format!("{lease:016x}"),
            "refund": refund,
            "report": info.is_some(),
            "limited": limited,
            "retry_after": retry_after,
            "default_penalty": DEFAULT_PENALTY_US,
            "duration": duration,
            "rt_key": self.key(&tenant, &StateKey::RunTimes),
        });
        let route = self.keys.tenant_base(&tenant);
        let v = self
            .invoke(&route, "release", spec.to_string(), String::new())
            .await?;
        let parts = strings(v)?;
        if parts.first().map(String::as_str) != Some("released") || parts.len() < 8 {
            return Ok(None);
        }
        let mut penalty_us: f64 = parts[1].parse().unwrap_or(0.0);
        // A shared upstream in a cluster: its state lives on another shard.
        if !parts[5].is_empty() && info.is_some() {
            if let Ok(u) = serde_json::from_str::<Value>(&parts[5]) {
                let spec = json!({"u": u, "limited": limited, "retry_after": retry_after,
                                  "default_penalty": DEFAULT_PENALTY_US});
                let route = format!("{}:route", self.keys.cross_base());
                if let Ok(v) = self
                    .invoke(&route, "upstream", spec.to_string(), String::new())
                    .await
                {
                    if let Ok(p) = strings(v) {
                        penalty_us = p.get(1).and_then(|x| x.parse().ok()).unwrap_or(penalty_us);
                    }
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

    /// An upstream's answer seen outside a lease; returns the penalty it started.
    pub async fn report(
        self: Arc<Self>,
        tenant: Arc<str>,
        report: UpstreamReport,
        status: u16,
        retry_after: Option<Duration>,
    ) -> Result<Option<Duration>, StoreError> {
        let limited = status == 429;
        let spec = json!({
            "u": self.report_spec(&tenant, &report, false),
            "limited": limited,
            "retry_after": retry_after.map_or(-1.0, |d| d.as_micros() as f64),
            "default_penalty": DEFAULT_PENALTY_US,
        });
        let route = if report.cross_tenant() {
            format!("{}:route", self.keys.cross_base())
        } else {
            self.keys.tenant_base(&tenant)
        };
        let route = if self.cfg.cluster {
            route
        } else {
            self.keys.tenant_base(&tenant)
        };
        let parts = strings(
            self.invoke(&route, "upstream", spec.to_string(), String::new())
                .await?,
        )?;
        let us: f64 = parts.get(1).and_then(|x| x.parse().ok()).unwrap_or(0.0);
        Ok((us > 0.0).then(|| Duration::from_micros(us as u64)))
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
        let spec = json!({
            "tenant": format!("{base}:b:t"),
            "tenant_slots": format!("{base}:c:t"),
            "tenant_quota": format!("{base}:q:t"),
            "subject_bucket": format!("{base}:b:s:"),
            "subject_slots": format!("{base}:c:s:"),
            "subject_quota": format!("{base}:q:s:"),
            "index": format!("{base}:subjects"),
            "max_subjects": 100,
            "pens": if self.cfg.cluster { up_keys(false).0 } else { pens.clone() },
            "ups": if self.cfg.cluster { up_keys(false).1 } else { ups.clone() },
            "forget": 120e6,
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
        if self.cfg.cluster && plan.upstreams.iter().any(|u| u.1) {
            let spec = json!({
                "tenant": "", "tenant_slots": "", "tenant_quota": "", "subject_bucket": "",
                "subject_slots": "", "subject_quota": "", "index": "", "max_subjects": 0,
                "pens": pens, "ups": ups, "forget": 120e6,
            });
            let route = format!("{}:route", self.keys.cross_base());
            let v = self
                .invoke(&route, "snapshot", spec.to_string(), String::new())
                .await?;
            let text: String =
                redis::from_redis_value(v).map_err(|e| StoreError::Script(e.to_string()))?;
            let cross: Value =
                serde_json::from_str(&text).map_err(|e| StoreError::Script(e.to_string()))?;
            for (i, (_, shared, _)) in plan.upstreams.iter().enumerate() {
                if *shared {
                    if let (Some(p), Some(m)) = (cross["pens"].get(i), cross["ups"].get(i)) {
                        upstreams[i] = (f(p), f(m));
                    }
                }
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
        Ok(RemoteSnapshotState {
            now_us: f(&raw["now"]),
            tenant_tat_us: f(&raw["tenant_tat"]),
            tenant_inflight: raw["tenant_inflight"].as_u64().unwrap_or(0) as u32,
            tenant_quota_used: f(&raw["tenant_quota"]),
            day_ends_us: f(&raw["day_ends"]),
            subjects,
            upstreams,
        })
    }

    /// Gives back a hash tag's worth of what [`RedisStore::decide`] reports it took, for tests of the
    /// key layout.
    pub fn tag_of(&self, tenant: &str, k: &StateKey) -> String {
        hash_tag(&self.key(tenant, k)).to_string()
    }
}

/// An operation waiting for its lane's batcher.
struct Queued {
    route: String,
    op: &'static str,
    spec: String,
    data: String,
    answer: tokio::sync::oneshot::Sender<Result<redis::Value, StoreError>>,
}

/// A decision's part, as the script gets it.
struct DecideParts {
    spec: String,
    data: String,
    route: String,
    /// Per layer of the part, its index in the call.
    map: Vec<usize>,
}

// The script's `decide` spec, written straight from the call (the names are the script's).
#[derive(Serialize)]
struct DecideSpec<'a> {
    lease: String,
    id: String,
    subject: &'a str,
    cost: f64,
    max_wait: f64,
    ttl: f64,
    shadow: bool,
    returning: bool,
    rand: f64,
    floor: f64,
    forget: f64,
    pen: Vec<PenaltySpec>,
    ad: Vec<AdaptiveSpec>,
    conc: Vec<SlotsSpec>,
    quota: Vec<QuotaSpec>,
    layers: Vec<LayerSpec>,
    rt: RunTimesSpec<'a>,
    index: String,
}

#[derive(Serialize)]
struct LayerSpec {
    k: String,
    #[serde(rename = "T")]
    t: f64,
    b: f64,
    n: f64,
    hold: bool,
    m: String,
    f: f64,
}

#[derive(Serialize)]
struct PenaltySpec {
    k: String,
    layer: usize,
    step: f64,
}

#[derive(Serialize)]
struct AdaptiveSpec {
    k: String,
    w: f64,
    #[serde(rename = "K")]
    big_k: f64,
    min: u64,
    step: f64,
}

#[derive(Serialize)]
struct SlotsSpec {
    k: String,
    cap: u32,
    sub: bool,
    /// The layer (1-based in the part, 0: none) whose bucket hash keeps this set's expiry cursor.
    x: usize,
    cursor: String,
}

/// The layer of a part (`map`: the call's index of each) whose bucket hash keeps the expiry cursor
/// of a concurrency set: the subject's bucket for the subject's set, the tenant's for the tenant's.
/// 1-based; 0 when the part has no such layer (the script then pushes the set's expiry every time).
fn tied_layer(call: &RemoteCall, map: &[usize], subject: bool) -> usize {
    map.iter()
        .position(|&i| match &call.layers[i].key {
            StateKey::SubjectBucket(s) => subject && *s == call.subject,
            StateKey::TenantBucket => !subject,
            _ => false,
        })
        .map_or(0, |p| p + 1)
}

#[derive(Serialize)]
struct QuotaSpec {
    k: String,
    q: f64,
    sub: bool,
}

#[derive(Serialize)]
struct RunTimesSpec<'a> {
    k: String,
    f: &'a str,
}

/// What a lease keeps for its release (the hash field `d`), stored as admitd writes it.
#[derive(Serialize)]
struct LeaseData<'a> {
    subject: &'a str,
    tool: &'a str,
    cost: f64,
    /// The bucket layers' keys, in the order of the tokens the script records beside them.
    keys: Vec<&'a str>,
    quotas: Vec<&'a str>,
    zsets: Vec<&'a str>,
    up: Vec<ReportSpec<'a>>,
}

/// An upstream as the script reads it to take its answer (penalty, AIMD, adaptive window).
#[derive(Serialize)]
struct ReportSpec<'a> {
    n: &'a str,
    p: String,
    s: String,
    aw: f64,
    forget: f64,
    x: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    af: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    afl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ar: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    All,
    Tenant,
    Cross,
}

/// Layer reports of two parts, in the call's order (a layer is in exactly one of them).
fn merge(a: Vec<(u64, f64)>, b: Vec<(u64, f64)>) -> Vec<(u64, f64)> {
    a.into_iter()
        .zip(b)
        .map(|(x, y)| if x.1 < 0.0 { y } else { x })
        .collect()
}

/// How long a lane's script call keeps its place in flight without an answer. Not the store's
/// `timeout`: each caller stops waiting at that (and `on_error` answers it), but a call already
/// sent runs whenever Redis gets to it, so a slow Redis holds the lane's places and the operations
/// behind them wait in the lane, where those whose callers gave up are dropped unsent. Past this
/// bound (a Redis that never answers), the lane sends again.
const IN_FLIGHT_LIMIT: Duration = Duration::from_secs(10);

async fn in_flight_bound(
    call: impl std::future::Future<Output = redis::RedisResult<redis::Value>>,
) -> Result<redis::Value, StoreError> {
    match tokio::time::timeout(IN_FLIGHT_LIMIT, call).await {
        Err(_) => Err(StoreError::Timeout),
        Ok(r) => r.map_err(store_error),
    }
}

/// A Redis client error as the store's.
fn store_error(e: redis::RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreError::Connection(e.to_string())
    } else if e.is_timeout() {
        StoreError::Timeout
    } else {
        StoreError::Script(e.to_string())
    }
}

/// One operation's answer in a batch: what it returned, or `{'error', message}` when it failed.
fn batch_item(v: redis::Value) -> Result<redis::Value, StoreError> {
    if let redis::Value::Array(parts) = &v {
        if let [redis::Value::BulkString(tag), rest @ ..] = parts.as_slice() {
            if tag == b"error" {
                let why = rest
                    .first()
                    .and_then(|m| redis::from_redis_value::<String>(m.clone()).ok())
                    .unwrap_or_default();
                return Err(StoreError::Script(why));
            }
        }
    }
    Ok(v)
}

fn strings(v: redis::Value) -> Result<Vec<String>, StoreError> {
    redis::from_redis_value(v).map_err(|e| StoreError::Script(e.to_string()))
}

/// Parses the script's answer to `decide`. Layer reports are placed at their index in the call
/// (`map`); the layers of the other part are marked with a negative reset.
fn parse_decide(
    v: Result<redis::Value, StoreError>,
    map: &[usize],
    n: usize,
) -> Result<RemoteAnswer, StoreError> {
    let parts = strings(v?)?;
    let bad = || StoreError::Script(format!("unexpected answer {parts:?}"));
    let num = |i: usize| -> Result<f64, StoreError> {
        parts.get(i).and_then(|s| s.parse().ok()).ok_or_else(bad)
    };
    let layers_from = |start: usize| -> Result<Vec<(u64, f64)>, StoreError> {
        let mut out = vec![(0u64, -1.0f64); n];
        for (j, &g) in map.iter().enumerate() {
            let left = num(start + 2 * j)? as u64;
            let reset = num(start + 2 * j + 1)?;
            if let Some(slot) = out.get_mut(g) {
                *slot = (left, reset);
            }
        }
        Ok(out)
    };
    match parts.first().map(String::as_str) {
        Some("ok") => Ok(RemoteAnswer::Admitted {
            hold_us: num(1)?,
            layers: layers_from(2)?,
        }),
        Some("busy") => Ok(RemoteAnswer::Busy { wait_us: num(1)? }),
        Some("shed") => {
            let scope = match parts.get(1).map(String::as_str) {
                Some("upstream_penalty") => RemoteScope::Penalty,
                Some("adaptive") => RemoteScope::Adaptive,
                Some("concurrency") => RemoteScope::Concurrency,
                Some("daily_quota") => RemoteScope::DailyQuota,
                Some("layer") => {
                    let local = num(5)? as usize;
                    let global = local
                        .checked_sub(1)
                        .and_then(|l| map.get(l).copied())
                        .ok_or_else(bad)?;
                    RemoteScope::Layer(global)
                }
                _ => return Err(bad()),
            };
            let layers = layers_from(6)?;
            let multiplier =
                if scope == RemoteScope::Penalty || !matches!(scope, RemoteScope::Layer(_)) {
                    1.0
                } else {
                    num(6 + 2 * map.len()).unwrap_or(1.0)
                };
            Ok(RemoteAnswer::Refused {
                scope,
                wait_us: num(2)?,
                booked: num(3)? > 0.0,
                account_wide: num(4)? > 0.0,
                layers,
                multiplier,
            })
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(items: &[&str]) -> Result<redis::Value, StoreError> {
        Ok(redis::Value::Array(
            items
                .iter()
                .map(|s| redis::Value::BulkString(s.as_bytes().to_vec()))
                .collect(),
        ))
    }

    #[test]
    fn answers_are_placed_at_their_layers_in_the_call() {
        // Two of three layers in this part: the call's 0 and 2.
        let a = parse_decide(v(&["ok", "250", "19", "500", "4", "100"]), &[0, 2], 3).unwrap();
        assert_eq!(
            a,
            RemoteAnswer::Admitted {
                hold_us: 250.0,
                layers: vec![(19, 500.0), (0, -1.0), (4, 100.0)]
            }
        );
        let s = parse_decide(
            v(&[
                "shed", "layer", "1000", "0", "0", "2", "19", "500", "0", "900", "0.5",
            ]),
            &[0, 2],
            3,
        )
        .unwrap();
        assert_eq!(
            s,
            RemoteAnswer::Refused {
                scope: RemoteScope::Layer(2),
                wait_us: 1000.0,
                booked: false,
                account_wide: false,
                layers: vec![(19, 500.0), (0, -1.0), (0, 900.0)],
                multiplier: 0.5,
            }
        );
        assert_eq!(
            parse_decide(v(&["busy", "1500"]), &[], 0).unwrap(),
            RemoteAnswer::Busy { wait_us: 1500.0 }
        );
        assert!(matches!(
            parse_decide(v(&["what"]), &[], 0),
            Err(StoreError::Script(_))
        ));
        assert!(matches!(
            parse_decide(v(&["shed", "layer", "1", "0", "0", "9"]), &[0], 1),
            Err(StoreError::Script(_))
        ));
    }

    #[test]
    fn merged_reports_take_each_layer_from_the_part_that_has_it() {
        let a = vec![(3, 10.0), (0, -1.0)];
        let b = vec![(0, -1.0), (7, 20.0)];
        assert_eq!(merge(a, b), vec![(3, 10.0), (7, 20.0)]);
    }
}
