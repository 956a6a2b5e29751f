//! A worker's lane to one Redis server (on a Redis Cluster, one per node): a connection of the
//! worker's own, driven on its thread, and the batcher that sends the worker's operations on it.
//! One script call carries every operation the worker queued while the previous calls ran (up to
//! [`MAX_BATCH`]), so under load the per-call costs on both sides are paid once per batch, and an
//! answer wakes the worker that waits for it with no other thread between.

use std::sync::Arc;
use std::time::Duration;

use super::error::{connection_config, store_error, StoreError};
use super::wire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The most operations one script call carries (see [`Lanes::lane`]): a batch keeps Redis
/// busy for about this many decisions, so this also bounds how long one batch delays others.
const MAX_BATCH: usize = 32;

/// An operation waiting for its lane's batcher.
pub(super) struct Queued {
    /// On one server, the key the script call declares (the first operation's); on a cluster, the
    /// key the script looks up first to check that the node serves the operation's slot
    /// ([`super::keys::Keys::probe`]).
    pub(super) route: String,
    pub(super) op: &'static str,
    /// JSON, or MessagePack for `decide` and `release` (see `spec::decide_spec`).
    pub(super) spec: Vec<u8>,
    /// What a lease keeps (MessagePack; empty for other operations).
    pub(super) data: Vec<u8>,
    pub(super) answer: tokio::sync::oneshot::Sender<Reply>,
}

/// What became of a queued operation.
pub(super) enum Reply {
    /// It ran (or failed) on the node: its answer.
    Done(Result<redis::Value, StoreError>),
    /// On a cluster, it did not run: the node does not serve its slot now (`why`, Redis's word).
    /// Its spec and data come back to be sent where the slot is.
    Elsewhere {
        why: String,
        spec: Vec<u8>,
        data: Vec<u8>,
    },
    /// It was not sent: the lane could not connect.
    Unsent {
        error: StoreError,
        spec: Vec<u8>,
        data: Vec<u8>,
    },
}

impl Reply {
    /// The answer, where a lane that could not connect is a connection error (one server).
    pub(super) fn answer(self) -> Result<redis::Value, StoreError> {
        match self {
            Reply::Done(r) => r,
            Reply::Unsent { error, .. } => Err(error),
            Reply::Elsewhere { why, .. } => Err(StoreError::Script(why)),
        }
    }
}

/// The lanes of one store: how each worker's lane connects and sends. The store owns one
/// (`Arc<Lanes>`); each worker thread makes its own lane to it on its first operation.
pub(super) struct Lanes {
    /// The script every batch calls (its `batch` operation).
    script: redis::Script,
    /// Its source, for `SCRIPT LOAD` on a lane's own connection.
    source: Arc<str>,
    /// How many batches one lane keeps in flight (`pool_size`, at least one).
    in_flight: usize,
    /// How long a lane's connection may take to open.
    connect_limit: Duration,
    /// A Redis Cluster: each batch is the script's `routed` one, declaring no key, each operation
    /// with the key that proves its node serves its slot ([`super::nodes`]).
    routed: bool,
}

/// A worker thread's way to one server: a connection of its own, driven on that thread, and the
/// queue of its batcher (see [`Lanes::lane`]).
struct Lane {
    /// The lanes it belongs to (their address), the node it goes to (`""` on one server) and the
    /// connection generation it was made in.
    store: usize,
    node: Arc<str>,
    generation: u64,
    queue: tokio::sync::mpsc::UnboundedSender<Queued>,
}

thread_local! {
    static LANES: std::cell::RefCell<Vec<Lane>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Lanes {
    pub(super) fn new(source: &str, pool_size: usize, timeout: Duration, routed: bool) -> Self {
        Lanes {
            script: redis::Script::new(source),
            source: Arc::from(source),
            in_flight: pool_size.max(1),
            connect_limit: Duration::from_secs(1).max(timeout),
            routed,
        }
    }

    /// Queues an operation on this worker's lane to `node` (`""` on one server), making the lane
    /// first if the worker has none for this connection generation (or its lane ended). False when
    /// the lane cannot take it.
    pub(super) fn enqueue(
        self: &Arc<Self>,
        client: &redis::Client,
        generation: u64,
        node: &str,
        q: Queued,
    ) -> bool {
        let id = Arc::as_ptr(self) as usize;
        LANES.with(|lanes| {
            let mut lanes = lanes.borrow_mut();
            lanes.retain(|l| l.store != id || (l.generation == generation && !l.queue.is_closed()));
            let i = match lanes.iter().position(|l| l.store == id && &*l.node == node) {
                Some(i) => i,
                None => {
                    let (queue, rx) = tokio::sync::mpsc::unbounded_channel();
                    tokio::spawn(Arc::clone(self).lane(client.clone(), rx));
                    lanes.push(Lane {
                        store: id,
                        node: Arc::from(node),
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
    /// `pool_size` batches in flight. Under light load a batch is one operation and
    /// leaves at once; under load the operations that arrive while Redis runs a batch go together
    /// in the next, so the per-call costs on both sides (the script call, a command's framing, the
    /// wake-ups) are paid once per batch. Each operation in a batch is still decided on its own,
    /// all or nothing, and answered in order. The lane ends when the worker drops its queue (a new
    /// connection generation) or its connection cannot be made.
    async fn lane(
        self: Arc<Self>,
        client: redis::Client,
        queue: tokio::sync::mpsc::UnboundedReceiver<Queued>,
    ) {
        let info = client.get_connection_info();
        if let redis::ConnectionAddr::Tcp(host, port) = info.addr() {
            let (host, port, settings) = (host.clone(), *port, info.redis_settings().clone());
            return self.direct(host, port, settings, queue).await;
        }
        self.through_library(client, queue).await
    }

    /// A lane on a connection made and driven by the client library (`rediss://`).
    async fn through_library(
        self: Arc<Self>,
        client: redis::Client,
        mut queue: tokio::sync::mpsc::UnboundedReceiver<Queued>,
    ) {
        let limit = self.connect_limit;
        let con = match tokio::time::timeout(
            limit,
            client.get_multiplexed_async_connection_with_config(&connection_config(limit)),
        )
        .await
        {
            Ok(Ok(con)) => con,
            failed => {
                let e = match failed {
                    Ok(Err(e)) => StoreError::Connection(e.to_string()),
                    _ => StoreError::Connection("connecting timed out".into()),
                };
                return unsent(queue, e);
            }
        };
        let in_flight = Arc::new(tokio::sync::Semaphore::new(self.in_flight));
        while let Some(first) = queue.recv().await {
            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
                return;
            };
            let batch = gather(first, &mut queue);
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

    /// A lane on a connection of its own, speaking RESP itself ([`super::wire`]): each batch is
    /// written as one `EVALSHA` and its reply read in order, by this one task, with at most
    /// `in_flight` batches sent and not yet answered. The lane ends when its connection fails
    /// (every operation sent is answered with the error, every one queued is handed back unsent,
    /// and the worker's next operation makes a new lane), or when the worker drops its queue and
    /// every batch sent has its answer.
    async fn direct(
        self: Arc<Self>,
        host: String,
        port: u16,
        settings: redis::RedisConnectionInfo,
        mut queue: tokio::sync::mpsc::UnboundedReceiver<Queued>,
    ) {
        let con = match wire::connect(&host, port, &settings, self.connect_limit).await {
            Ok(con) => con,
            Err(e) => return unsent(queue, e),
        };
        let (mut rd, mut wr) = con.into_split();
        let mut sent: std::collections::VecDeque<Sent> = std::collections::VecDeque::new();
        let mut batches = 0;
        let (mut rbuf, mut start) = (Vec::with_capacity(16 * 1024), 0);
        let mut wbuf = Vec::new();
        let mut open = true;
        // Sent batches are checked against IN_FLIGHT_LIMIT once a second: no timer per batch.
        let mut check = tokio::time::interval(Duration::from_secs(1));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let failure = loop {
            if !open && sent.is_empty() {
                return;
            }
            tokio::select! {
                biased;
                read = rd.read_buf(&mut rbuf) => {
                    match read {
                        Ok(0) => break StoreError::Connection("the server closed the connection".into()),
                        Err(e) => break StoreError::Connection(e.to_string()),
                        Ok(_) => {}
                    }
                    let mut broken = None;
                    loop {
                        match wire::parse(&rbuf[start..]) {
                            Ok(Some((frame, used))) => {
                                start += used;
                                let Some(s) = sent.pop_front() else {
                                    broken = Some(StoreError::Connection("a reply to nothing sent".into()));
                                    break;
                                };
                                if matches!(s, Sent::Batch { .. }) {
                                    batches -= 1;
                                }
                                if let Some(again) = self.answer(s, frame) {
                                    wbuf.clear();
                                    wire::command(&mut wbuf, &[b"SCRIPT", b"LOAD", self.source.as_bytes()]);
                                    self.batch_wire(&mut wbuf, &again);
                                    if let Err(e) = wr.write_all(&wbuf).await {
                                        fail(again, &StoreError::Connection(e.to_string()));
                                        broken = Some(StoreError::Connection(e.to_string()));
                                        break;
                                    }
                                    sent.push_back(Sent::Load);
                                    sent.push_back(Sent::Batch { batch: again, at: tokio::time::Instant::now(), reloaded: true });
                                    batches += 1;
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                broken = Some(StoreError::Connection(e));
                                break;
                            }
                        }
                    }
                    if let Some(e) = broken {
                        break e;
                    }
                    if start == rbuf.len() {
                        rbuf.clear();
                        start = 0;
                    } else if start > 64 * 1024 {
                        rbuf.drain(..start);
                        start = 0;
                    }
                }
                next = queue.recv(), if open && batches < self.in_flight => {
                    let Some(first) = next else {
                        open = false;
                        continue;
                    };
                    let batch = gather(first, &mut queue);
                    if batch.is_empty() {
                        continue;
                    }
                    wbuf.clear();
                    self.batch_wire(&mut wbuf, &batch);
                    if let Err(e) = wr.write_all(&wbuf).await {
                        let e = StoreError::Connection(e.to_string());
                        fail(batch, &e);
                        break e;
                    }
                    sent.push_back(Sent::Batch { batch, at: tokio::time::Instant::now(), reloaded: false });
                    batches += 1;
                }
                _ = check.tick(), if !sent.is_empty() => {
                    let oldest = sent.iter().find_map(|s| match s {
                        Sent::Batch { at, .. } => Some(*at),
                        Sent::Load => None,
                    });
                    if oldest.is_some_and(|at| at.elapsed() >= IN_FLIGHT_LIMIT) {
                        break StoreError::Timeout;
                    }
                }
            }
        };
        for s in sent {
            if let Sent::Batch { batch, .. } = s {
                fail(batch, &failure);
            }
        }
        unsent(queue, failure);
    }

    /// Hands each operation of a sent batch its part of `frame`; a batch that met a Redis without
    /// the script (restarted, `SCRIPT FLUSH`) comes back to be sent again after `SCRIPT LOAD`, once.
    fn answer(&self, sent: Sent, frame: wire::Frame) -> Option<Vec<Queued>> {
        let Sent::Batch {
            batch, reloaded, ..
        } = sent
        else {
            // `SCRIPT LOAD`: a failure shows in the batch sent after it.
            return None;
        };
        match frame {
            wire::Frame::Error(e) if e.starts_with("NOSCRIPT") && !reloaded => Some(batch),
            wire::Frame::Error(e) if self.routed && refused_code(&e) => {
                for q in batch {
                    let _ = q.answer.send(Reply::Elsewhere {
                        why: e.clone(),
                        spec: q.spec,
                        data: q.data,
                    });
                }
                None
            }
            wire::Frame::Error(e) => {
                fail(batch, &StoreError::Script(e));
                None
            }
            wire::Frame::Value(v) => {
                deliver(batch, Ok(v));
                None
            }
        }
    }

    /// A batch's script call, written as RESP into `out`.
    fn batch_wire(&self, out: &mut Vec<u8>, batch: &[Queued]) {
        let args = self.batch_args(batch);
        out.reserve(args.iter().map(|a| wire::arg_len(a)).sum::<usize>() + 16);
        wire::command(out, &args);
    }

    /// A batch's script call, as its arguments: `EVALSHA`, the script, one declared key (the first
    /// operation's) and `batch`, then each operation's name, spec and data; on a cluster no key and
    /// `routed`, each operation led by the key that proves its node ([`super::nodes`]).
    fn batch_args<'a>(&'a self, batch: &'a [Queued]) -> Vec<&'a [u8]> {
        let mut args: Vec<&[u8]> = Vec::with_capacity(5 + 4 * batch.len());
        args.extend([b"EVALSHA" as &[u8], self.script.get_hash().as_bytes()]);
        if self.routed {
            args.extend([b"0" as &[u8], b"routed"]);
            for q in batch {
                args.extend([q.route.as_bytes(), q.op.as_bytes(), &q.spec, &q.data]);
            }
        } else {
            args.extend([b"1" as &[u8], batch[0].route.as_bytes(), b"batch"]);
            for q in batch {
                args.extend([q.op.as_bytes(), &q.spec[..], &q.data[..]]);
            }
        }
        args
    }

    /// Sends a batch as one script call (`batch`, even of one operation: an error then answers for
    /// its own operation only, as in a larger batch; on a cluster `routed`) and hands each operation
    /// its answer.
    async fn send_batch(&self, mut con: redis::aio::MultiplexedConnection, batch: Vec<Queued>) {
        let cmd = self.batch_cmd(&batch);
        let sent = match tokio::time::timeout(IN_FLIGHT_LIMIT, self.call(&mut con, &cmd)).await {
            Err(_) => Err(StoreError::Timeout),
            Ok(Err(e)) if self.routed && refused_here(&e) => {
                // Refused whole before it ran (a node that became a replica, say): every operation
                // goes where the map says.
                let why = e.to_string();
                for q in batch {
                    let _ = q.answer.send(Reply::Elsewhere {
                        why: why.clone(),
                        spec: q.spec,
                        data: q.data,
                    });
                }
                return;
            }
            Ok(r) => r.map_err(store_error),
        };
        deliver(batch, sent);
    }

    /// A batch's script call as the client library sends it (`rediss://`), in one command sized
    /// for the whole batch.
    fn batch_cmd(&self, batch: &[Queued]) -> redis::Cmd {
        let args = self.batch_args(batch);
        let bytes = args.iter().map(|a| a.len()).sum();
        let mut cmd = redis::Cmd::with_capacity(args.len(), bytes);
        for a in args {
            cmd.arg(a);
        }
        cmd
    }

    /// Sends a script call; a Redis that does not know the script (restarted, `SCRIPT FLUSH`) is
    /// sent it and asked again.
    async fn call(
        &self,
        con: &mut redis::aio::MultiplexedConnection,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<redis::Value> {
        match cmd.query_async(con).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                self.script.load_async(con).await?;
                cmd.query_async(con).await
            }
            r => r,
        }
    }
}

/// Whether Redis refused a whole script call before running it because the node does not serve
/// what it was sent (on a cluster).
fn refused_here(e: &redis::RedisError) -> bool {
    matches!(
        e.code(),
        Some("MOVED" | "ASK" | "TRYAGAIN" | "CROSSSLOT" | "CLUSTERDOWN" | "READONLY")
    )
}

/// [`refused_here`] for an error reply read off the wire (`CODE message`).
fn refused_code(e: &str) -> bool {
    matches!(
        e.split(' ').next(),
        Some("MOVED" | "ASK" | "TRYAGAIN" | "CROSSSLOT" | "CLUSTERDOWN" | "READONLY")
    )
}

/// A batch sent on a lane's own connection, or the `SCRIPT LOAD` sent before one again.
enum Sent {
    Batch {
        batch: Vec<Queued>,
        at: tokio::time::Instant,
        /// Sent again after `SCRIPT LOAD`: a second NOSCRIPT is an error.
        reloaded: bool,
    },
    Load,
}

/// The operations queued now, from `first` on, up to [`MAX_BATCH`]. A caller that stopped waiting
/// (its timeout passed, and `on_error` answered it) gets no decision behind its back: nothing is
/// spent and no lease is left for nobody.
fn gather(first: Queued, queue: &mut tokio::sync::mpsc::UnboundedReceiver<Queued>) -> Vec<Queued> {
    let mut batch = Vec::with_capacity(MAX_BATCH.min(queue.len() + 1));
    batch.push(first);
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(q) => batch.push(q),
            Err(_) => break,
        }
    }
    batch.retain(|q| !q.answer.is_closed());
    batch
}

/// Hands each operation of a batch its answer: its item of the script's list.
fn deliver(batch: Vec<Queued>, answer: Result<redis::Value, StoreError>) {
    match answer {
        Ok(redis::Value::Array(items)) if items.len() == batch.len() => {
            for (q, item) in batch.into_iter().zip(items) {
                let reply = match batch_item(item) {
                    Item::Done(r) => Reply::Done(r),
                    Item::Elsewhere(why) => Reply::Elsewhere {
                        why,
                        spec: q.spec,
                        data: q.data,
                    },
                };
                let _ = q.answer.send(reply);
            }
        }
        other => {
            let e = match other {
                Err(e) => e,
                Ok(v) => StoreError::Script(format!("unexpected answer to a batch: {v:?}")),
            };
            fail(batch, &e);
        }
    }
}

/// Answers every operation of a batch with `e`.
fn fail(batch: Vec<Queued>, e: &StoreError) {
    for q in batch {
        let _ = q.answer.send(Reply::Done(Err(e.clone())));
    }
}

/// Ends a lane's queue: every operation in it goes back unsent, with `e`, to be sent on the
/// worker's next lane (or, on a cluster, where the slot map says).
fn unsent(mut queue: tokio::sync::mpsc::UnboundedReceiver<Queued>, e: StoreError) {
    queue.close();
    while let Ok(q) = queue.try_recv() {
        let _ = q.answer.send(Reply::Unsent {
            error: e.clone(),
            spec: q.spec,
            data: q.data,
        });
    }
}

/// How long a lane's script call keeps its place in flight without an answer. Not the store's
/// `timeout`: each caller stops waiting at that (and `on_error` answers it), but a call already
/// sent runs whenever Redis gets to it, so a slow Redis holds the lane's places and the operations
/// behind them wait in the lane, where those whose callers gave up are dropped unsent. Past this
/// bound (a Redis that never answers), the lane sends again.
const IN_FLIGHT_LIMIT: Duration = Duration::from_secs(10);

/// One operation's answer in a batch.
enum Item {
    Done(Result<redis::Value, StoreError>),
    /// `{'elsewhere', why}`: on a cluster, the node does not serve its slot now; it did not run.
    Elsewhere(String),
}

/// One operation's answer in a batch: what it returned, `{'error', message}` when it failed, or
/// `{'elsewhere', message}` when it did not run.
fn batch_item(v: redis::Value) -> Item {
    if let redis::Value::Array(parts) = &v {
        if let [redis::Value::BulkString(tag), rest @ ..] = parts.as_slice() {
            if tag == b"error" || tag == b"elsewhere" {
                let why = rest
                    .first()
                    .and_then(|m| redis::from_redis_value::<String>(m.clone()).ok())
                    .unwrap_or_default();
                if tag == b"elsewhere" {
                    return Item::Elsewhere(why);
                }
                return Item::Done(Err(StoreError::Script(why)));
            }
        }
    }
    Item::Done(Ok(v))
}
