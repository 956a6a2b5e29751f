//! Wiring: the runtime layout of a running daemon, start-up and shutdown.
//!
//! Layout: an actix `System` on the main thread (it runs the global actor and the signal handlers) and
//! `server.workers` arbiters (default: one per core). Every arbiter is a single-threaded runtime that both
//! hosts a share of the tenant actors and serves HTTP on the same listening socket, its connections
//! being tasks of the same queue as the actors ([`serve_http`]). A request whose tenant
//! lives on the arbiter that accepted its connection reaches the actor without crossing threads; with one
//! worker nothing ever does. Each worker also flushes its batch of telemetry events every 10 ms and
//! ticks its tenant actors once a second. The
//! telemetry actors get an arbiter of their own. docs/BENCHMARKS.md measures this layout against the
//! alternatives.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use crate::actors::{GlobalActor, Shared};
use crate::api::{self, App};
use crate::clock::{Clock, SystemClock};
use crate::config::{Config, ListenAddr};
use crate::telemetry;

/// A listening socket that hands out connections: TCP, or a Unix domain socket.
trait Acceptor {
    type Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    fn accept_io(&self) -> impl std::future::Future<Output = std::io::Result<Self::Io>>;
}

impl Acceptor for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_io(&self) -> std::io::Result<Self::Io> {
        self.accept().await.map(|(io, _)| io)
    }
}

#[cfg(unix)]
impl Acceptor for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept_io(&self) -> std::io::Result<Self::Io> {
        self.accept().await.map(|(io, _)| io)
    }
}

/// The bound socket, before each worker takes a copy.
enum Bound {
    Tcp(std::net::TcpListener),
    #[cfg(unix)]
    Unix(std::os::unix::net::UnixListener),
}

impl Bound {
    fn try_clone(&self) -> std::io::Result<Bound> {
        Ok(match self {
            Bound::Tcp(l) => Bound::Tcp(l.try_clone()?),
            #[cfg(unix)]
            Bound::Unix(l) => Bound::Unix(l.try_clone()?),
        })
    }
}

/// Binds `listen`. A Unix socket gets its file mode and group before anyone can connect.
fn bind(config: &Config) -> Result<(Bound, String), String> {
    match &config.server.listen {
        ListenAddr::Tcp(addr) => {
            let l = std::net::TcpListener::bind(addr)
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            l.set_nonblocking(true)
                .map_err(|e| format!("cannot configure the socket on {addr}: {e}"))?;
            let local = l
                .local_addr()
                .map_err(|e| format!("cannot read the bound address: {e}"))?;
            Ok((Bound::Tcp(l), local.to_string()))
        }
        #[cfg(unix)]
        ListenAddr::Unix(path) => {
            let l = crate::unix_socket::bind(path, &config.server.socket)?;
            Ok((Bound::Unix(l), config.server.listen.to_string()))
        }
        #[cfg(not(unix))]
        ListenAddr::Unix(_) => Err("Unix domain sockets need a Unix system".to_string()),
    }
}

/// Serves on this worker's copy of the bound socket until `stop`.
async fn serve_bound(bound: Bound, app: Arc<App>, stop: impl std::future::Future<Output = ()>) {
    let not_taken = |e: std::io::Error| tracing::error!(error = %e, "a worker could not take the listening socket");
    match bound {
        Bound::Tcp(l) => match tokio::net::TcpListener::from_std(l) {
            Ok(l) => serve_http(l, app, stop).await,
            Err(e) => not_taken(e),
        },
        #[cfg(unix)]
        Bound::Unix(l) => match l
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(l))
        {
            Ok(l) => serve_http(l, app, stop).await,
            Err(e) => not_taken(e),
        },
    }
}

/// Accepts connections on `listener` and serves the API on each until `stop` completes, then lets the
/// open connections finish the request in hand and close.
///
/// This is what `warp::serve` does, with two differences. Each socket is wrapped in
/// [`api::unparsed::JsonErrors`], so that hyper's own answers to requests it cannot parse carry the
/// API's JSON error body like every other error. And, for speed, every connection is
/// a task of this arbiter's `LocalSet` (`spawn_local`), like the tenant actors, instead of a task of
/// the runtime underneath (`tokio::spawn`). A request that goes from its connection to its tenant
/// actor and back then runs within one pass of the same queue. With the connection in the runtime's
/// queue and the actor in the `LocalSet`'s, each request would go through the scheduler twice, and
/// the worker would poll the socket driver in between (`epoll_wait` calls per request at 20 000/s:
/// 0.8 this way, 1.6 the other; docs/BENCHMARKS.md).
async fn serve_http<L: Acceptor>(
    listener: L,
    app: Arc<App>,
    stop: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto;
    use hyper_util::server::graceful::GracefulShutdown;

    let header_timeout = app.shared.started.overload.header_timeout;
    let service = api::service(app);
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // An answer is a few hundred bytes: copying the body behind the head and writing both with one
    // `write` costs less than hyper's default of queueing them as two buffers for `writev` (5-7% less
    // CPU per request, for admitd and the floor alike; docs/BENCHMARKS.md).
    builder.http1().writev(false);
    // A connection that has not sent a whole request head this long after it began one (or after
    // the last answer, when it is kept alive) is closed: a slowloris flood of half-sent requests
    // cannot pin connections, descriptors and memory for ever.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    let mut stop = std::pin::pin!(stop);
    loop {
        let io = tokio::select! {
            accepted = listener.accept_io() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let service = service.clone();
        let connection = graceful.watch(
            builder
                .serve_connection_with_upgrades(
                    TokioIo::new(api::unparsed::JsonErrors::new(io)),
                    service,
                )
                .into_owned(),
        );
        tokio::task::spawn_local(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// What to do when `accept` fails. Errors of the connection being accepted (reset before it was
/// taken) concern only that client; anything else (most likely too many open files) is logged and
/// accepting pauses for a second, so a process at its descriptor limit does not spin.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "cannot accept a connection; pausing for a second");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Runs the daemon until SIGTERM or SIGINT. Errors are start-up failures, worded for the operator.
pub fn serve(config: Config) -> Result<(), String> {
    let system = actix::System::new();
    let result = system.block_on(run(config));
    System::current().stop();
    result
}

async fn run(config: Config) -> Result<(), String> {
    let addr = config.server.listen.clone();
    let (listener, local) = bind(&config)?;
    crate::api::auth::warn_if_exposed(&config);

    telemetry::set_identity_key(config.telemetry.identity_key.as_ref());
    let workers = config.worker_count();
    let arbiters: Vec<Arbiter> = (0..workers)
        .map(|_| Arbiter::try_new().map_err(|e| format!("cannot start a worker thread: {e}")))
        .collect::<Result<_, _>>()?;
    let handles = arbiters.iter().map(actix::Arbiter::handle).collect();

    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    let telemetry = if config.telemetry.enabled {
        Some(telemetry::start(&config, clock.clone())?)
    } else {
        None
    };
    let events = telemetry
        .as_ref()
        .map(|t| t.telemetry.clone())
        .unwrap_or_default();
    let store_cfg = config.store.clone();
    let shared = Shared::new(config, clock, events.clone(), handles);
    match store_cfg.kind {
        crate::config::StoreKind::Redis => {
            let store = crate::store::RedisStore::start(&store_cfg, events).await?;
            shared.set_store(crate::store::Store::Redis(store));
        }
        crate::config::StoreKind::Memory => {
            ::metrics::gauge!(crate::telemetry::names::STORE_MODE, "mode" => "memory").set(1.0);
        }
    }
    let global = GlobalActor::new(shared.clone()).start();
    let app = Arc::new(App {
        shared: shared.clone(),
        global: global.clone(),
        metrics: telemetry.as_ref().map(|t| t.render_metrics.clone()),
        alerts: telemetry.as_ref().map(|t| t.render_alerts.clone()),
        edge: Default::default(),
    });

    // Kept state goes back in before the first call is taken.
    let state_path = shared.started.state.path.clone();
    if let Some(path) = &state_path {
        if let Some(file) = crate::state::load(path)? {
            let tenants = crate::state::restore(&shared, file).await;
            tracing::info!(path = %path.display(), tenants, "state restored");
        }
        // Written once now, so that a directory admitd cannot write stops the start, not a later
        // write.
        let file = crate::state::collect(&shared).await;
        crate::state::write(path, &file)
            .map_err(|e| format!("cannot write the state file {}: {e}", path.display()))?;
        spawn_state_writer(shared.clone(), path.clone());
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(workers);
    for (index, arbiter) in arbiters.iter().enumerate() {
        // The tenant actors living here tick once a second, one registry shard at a time.
        let ticked = shared.clone();
        arbiter.spawn(async move {
            let every = crate::actors::TICK / crate::actors::TICK_SLOTS as u32;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for slot in 0u64.. {
                tick.tick().await;
                ticked.tick_arbiter(index, slot);
            }
        });
        // Telemetry events leave a worker in batches (see `Telemetry::batch_this_thread`).
        let events = shared.telemetry.clone();
        arbiter.spawn(async move {
            events.batch_this_thread();
            let mut flush = tokio::time::interval(telemetry::FLUSH_EVERY);
            loop {
                flush.tick().await;
                telemetry::Telemetry::flush_this_thread();
            }
        });
        let listener = listener
            .try_clone()
            .map_err(|e| format!("cannot share the socket on {addr}: {e}"))?;
        let app = app.clone();
        let mut stop = stop_rx.clone();
        let done = done_tx.clone();
        arbiter.spawn(async move {
            serve_bound(listener, app, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
            let _ = done.send(()).await;
        });
    }
    drop(done_tx);
    drop(listener);
    tracing::info!(listen = %local, workers, mode = shared.config.load().server.mode.as_str(), "admitd listening");
    eprintln!("admitd listening on {local}");

    wait_for_signals(&shared, &global).await;

    // Shutdown has to be over within `max_wait` + 1 s: held admissions end by their wait (at most
    // `max_wait`), the rest of that second is for the answers to go out and the state to be written.
    let signalled = tokio::time::Instant::now();
    let max_wait = shared.config.load().server.max_wait;
    shared.start_stopping();
    tracing::info!(
        admitting = api::inflight::admitting(),
        "shutting down: refusing new admissions, answering the held ones"
    );
    // The listeners keep serving meanwhile: releases free capacity for the held calls, and a load
    // balancer's `/readyz` sees 503 instead of a refused connection.
    let drained = signalled + max_wait + Duration::from_millis(300);
    while api::inflight::admitting() > 0 && tokio::time::Instant::now() < drained {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop_tx.send(true);
    // Let in-flight answers go out; keep-alive connections are closed by the graceful shutdown.
    let closed = (signalled + max_wait + Duration::from_millis(600))
        .max(tokio::time::Instant::now() + Duration::from_millis(100));
    let _ =
        tokio::time::timeout_at(closed, async { while done_rx.recv().await.is_some() {} }).await;
    // The tenant actors still run: their last state goes to disk now.
    if let Some(path) = &state_path {
        write_state(&shared, path, true).await;
    }
    // What this replica holds of cross-tenant buckets and did not spend is the fleet's again, and
    // the shared upstreams' answers it gathered go to their shards.
    if let crate::store::Store::Redis(store) = shared.store() {
        let _ = tokio::time::timeout(Duration::from_secs(1), store.send_answers()).await;
        let _ = tokio::time::timeout(Duration::from_secs(1), store.give_back_slices()).await;
    }
    for arbiter in arbiters {
        arbiter.stop();
    }
    #[cfg(unix)]
    if let ListenAddr::Unix(path) = &addr {
        crate::unix_socket::remove(path);
    }
    if let Some(telemetry) = telemetry {
        telemetry.arbiter.stop();
        if let Some(exporter) = telemetry.span_exporter {
            // The span actor hands over its finished spans as it stops; wait for their export.
            exporter.shutdown(Duration::from_secs(3));
        }
    }
    Ok(())
}

/// Collects the kept state and writes it off the main thread; a failure is logged, and the next
/// write tries again.
/// The last write at shutdown must not be overtaken by a periodic one collected earlier: writes
/// take turns, and a periodic write that finds shutdown started gives way.
async fn write_state(shared: &Arc<Shared>, path: &std::path::Path, last: bool) {
    static TURN: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    let file = crate::state::collect(shared).await;
    let tenants = file.tenants.len();
    let p = path.to_path_buf();
    let s = shared.clone();
    let written = tokio::task::spawn_blocking(move || {
        let _turn = TURN.lock();
        if !last && s.stopping() {
            Ok(())
        } else {
            crate::state::write(&p, &file)
        }
    })
    .await;
    match written {
        Ok(Ok(())) => tracing::debug!(tenants, "state file written"),
        Ok(Err(e)) => {
            tracing::error!(path = %path.display(), error = %e, "cannot write the state file");
        }
        Err(e) => tracing::error!(error = %e, "the state file writer failed"),
    }
}

/// Writes the state file every `[state] interval` until the process ends (shutdown writes it once
/// more, after the last answer).
fn spawn_state_writer(shared: Arc<Shared>, path: std::path::PathBuf) {
    let every = shared.started.state.interval;
    actix::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if shared.stopping() {
                return;
            }
            write_state(&shared, &path, false).await;
        }
    });
}

#[cfg(unix)]
async fn wait_for_signals(shared: &Arc<Shared>, global: &Addr<GlobalActor>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut hup), Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::hangup()),
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the daemon with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    loop {
        tokio::select! {
            _ = hup.recv() => match api::reload(shared, global).await {
                Ok(restart) => tracing::info!(?restart, "SIGHUP: config reloaded"),
                Err(e) => tracing::error!(error = %e.message, "SIGHUP: reload refused"),
            },
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signals(_: &Arc<Shared>, _: &Addr<GlobalActor>) {
    let _ = tokio::signal::ctrl_c().await;
}
