//! The export side of spans: a thread of its own that builds finished spans into the SDK's
//! `SpanData` and hands them to the `opentelemetry-otlp` exporter (the blocking HTTP client, or tonic
//! on a single-threaded runtime of the thread's own for gRPC).
//!
//! The queue from the span actor to this thread is bounded: a slow collector costs dropped spans,
//! never admission time. After an export fails, the thread drops spans without building them for a
//! back-off (1 s, doubling to 30 s) and then asks the collector again with an empty export; the
//! [`Pause`] it shares with the actor stops the actor recording spans meanwhile, so a collector that
//! is down costs almost nothing. Dropped spans are counted in `admitd_spans_dropped_total`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::InstrumentationScope;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;

use super::super::names;
use super::build::Finished;
use crate::clock::{Clock, Nanos, NS_PER_SEC};
use crate::config::{OtlpConfig, OtlpProtocol};

/// Spans handed to the export thread at once, and exported in one request.
pub const EXPORT_BATCH: usize = 512;
/// Batches waiting for the export thread, at most (8192 spans); further spans are dropped.
pub(super) const EXPORT_QUEUE: usize = 16;
/// Spans are dropped unbuilt for this long after a failed export, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Nanos = NS_PER_SEC;
const MAX_BACKOFF: Nanos = 30 * NS_PER_SEC;

/// The export side: a thread that builds and exports what the actor finished.
pub struct Exporter {
    tx: SyncSender<Vec<Finished>>,
    done: Receiver<()>,
    pub(super) paused: Pause,
}

/// Until when (monotonic ns) the export thread drops what it gets, shared with the span actor so it
/// does not even record spans that would be dropped.
#[derive(Debug, Clone, Default)]
pub(super) struct Pause(Arc<AtomicU64>);

impl Pause {
    pub(super) fn set(&self, until: Option<Nanos>) {
        self.0.store(until.unwrap_or(0), Ordering::Relaxed);
    }

    pub(super) fn active(&self, now: Nanos) -> bool {
        now < self.0.load(Ordering::Relaxed)
    }
}

/// Starts the OTLP exporter on a thread of its own. Fails when the exporter cannot be set up (an
/// endpoint the HTTP or gRPC client refuses).
pub fn start(cfg: &OtlpConfig, clock: Arc<dyn Clock>) -> Result<Exporter, String> {
    let cfg = cfg.clone();
    let (tx, rx) = mpsc::sync_channel::<Vec<Finished>>(EXPORT_QUEUE);
    let (done_tx, done) = mpsc::channel();
    let (ready_tx, ready) = mpsc::channel();
    let paused = Pause::default();
    let pause = paused.clone();
    std::thread::Builder::new()
        .name("otlp-export".into())
        .spawn(move || {
            let cannot = |e: &dyn std::fmt::Display| {
                format!(
                    "cannot set up OTLP export ({}) to {}: {e}",
                    cfg.protocol.as_str(),
                    cfg.endpoint
                )
            };
            let run = |mut exporter: Box<dyn ExportOn>| {
                let _ = ready_tx.send(Ok(()));
                exporter.set_resource(
                    &Resource::builder()
                        .with_service_name(cfg.service_name.clone())
                        .build(),
                );
                export_loop(&*exporter, &rx, &*clock, &pause, &cfg.endpoint);
                exporter.shutdown();
                let _ = done_tx.send(());
            };
            // A failed export pauses export (see `Backoff`) instead of being retried at once:
            // retries would hold the export thread while the queue overflows.
            let no_retry = opentelemetry_otlp::RetryPolicy::disabled();
            match cfg.protocol {
                OtlpProtocol::HttpProtobuf | OtlpProtocol::HttpJson => {
                    // The blocking HTTP client is created, used and dropped on this plain thread,
                    // never on an async runtime's.
                    let protocol = match cfg.protocol {
                        OtlpProtocol::HttpJson => Protocol::HttpJson,
                        _ => Protocol::HttpBinary,
                    };
                    match opentelemetry_otlp::SpanExporter::builder()
                        .with_http()
                        .with_endpoint(cfg.endpoint.clone())
                        .with_protocol(protocol)
                        .with_timeout(EXPORT_TIMEOUT)
                        .with_retry_policy(no_retry)
                        .build()
                    {
                        Ok(e) => run(Box::new(Blocking(e))),
                        Err(e) => {
                            let _ = ready_tx.send(Err(cannot(&e)));
                        }
                    }
                }
                OtlpProtocol::Grpc => {
                    // tonic needs a tokio runtime: a single-threaded one that runs only while this
                    // thread exports.
                    let built = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| cannot(&e))
                        .and_then(|rt| {
                            let _entered = rt.enter();
                            opentelemetry_otlp::SpanExporter::builder()
                                .with_tonic()
                                .with_endpoint(cfg.endpoint.clone())
                                .with_protocol(Protocol::Grpc)
                                .with_timeout(EXPORT_TIMEOUT)
                                .with_retry_policy(no_retry)
                                .build()
                                .map_err(|e| cannot(&e))
                                .map(|e| OnRuntime(e, rt))
                        });
                    match built {
                        Ok(e) => run(Box::new(e)),
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                }
            }
        })
        .map_err(|e| format!("cannot start the OTLP export thread: {e}"))?;
    ready
        .recv()
        .map_err(|_| "the OTLP export thread stopped while starting".to_string())??;
    Ok(Exporter { tx, done, paused })
}

/// A collector that does not answer within this is treated as down.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// An exporter as the export thread drives it: one blocking call per batch.
trait ExportOn {
    fn export_blocking(&self, batch: Vec<SpanData>) -> OTelSdkResult;
    fn set_resource(&mut self, resource: &Resource);
    fn shutdown(&mut self);
}

/// An exporter whose futures need no runtime (the blocking HTTP client's).
struct Blocking<E>(E);

impl<E: SpanExporter> ExportOn for Blocking<E> {
    fn export_blocking(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        futures_executor::block_on(self.0.export(batch))
    }
    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
    fn shutdown(&mut self) {
        let _ = self.0.shutdown();
    }
}

/// An exporter whose futures run on a tokio runtime (tonic's).
struct OnRuntime<E>(E, tokio::runtime::Runtime);

impl<E: SpanExporter> ExportOn for OnRuntime<E> {
    fn export_blocking(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.1.block_on(self.0.export(batch))
    }
    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
    fn shutdown(&mut self) {
        let _entered = self.1.enter();
        let _ = self.0.shutdown();
    }
}

impl Exporter {
    pub(super) fn sender(&self) -> SyncSender<Vec<Finished>> {
        self.tx.clone()
    }

    /// Waits (up to `timeout`) for the export thread to export what it was given. Call after the
    /// span actor stopped: the thread finishes once every sender is gone.
    pub fn shutdown(self, timeout: Duration) {
        drop(self.tx);
        let _ = self.done.recv_timeout(timeout);
    }
}

pub(super) fn count_dropped(reason: &'static str, n: usize) {
    if n > 0 {
        ::metrics::counter!(names::SPANS_DROPPED, "reason" => reason).increment(n as u64);
    }
}

/// When export may be tried again after failures.
#[derive(Debug, Default)]
struct Backoff {
    /// Monotonic time before which batches are dropped; `None` while exports succeed.
    until: Option<Nanos>,
    next: Nanos,
}

impl Backoff {
    fn waiting(&self, now: Nanos) -> bool {
        self.until.is_some_and(|t| now < t)
    }

    /// Records a failed export; returns how long batches will now be dropped.
    fn failed(&mut self, now: Nanos) -> Nanos {
        let wait = self.next.max(FIRST_BACKOFF);
        self.until = Some(now + wait);
        self.next = (wait * 2).min(MAX_BACKOFF);
        wait
    }

    /// Records a successful export; true when it ends a run of failures.
    fn succeeded(&mut self) -> bool {
        self.next = 0;
        self.until.take().is_some()
    }
}

/// The export thread's state: what it exports with, and whether export is paused after failures.
struct ExportState<'a, E: ?Sized> {
    exporter: &'a E,
    scope: InstrumentationScope,
    backoff: Backoff,
    pause: &'a Pause,
    endpoint: &'a str,
}

impl<'a, E: ExportOn + ?Sized> ExportState<'a, E> {
    fn new(exporter: &'a E, pause: &'a Pause, endpoint: &'a str) -> Self {
        ExportState {
            exporter,
            scope: InstrumentationScope::builder("admitd")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            backoff: Backoff::default(),
            pause,
            endpoint,
        }
    }

    /// How long to wait for the next batch before probing the collector; `None` while export works.
    fn probe_in(&self, now: Nanos) -> Option<Duration> {
        self.backoff
            .until
            .map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }

    /// Builds and exports a batch, or drops it while export is paused.
    fn batch(&mut self, batch: Vec<Finished>, now: Nanos) {
        if self.backoff.waiting(now) {
            count_dropped("export_failed", batch.len());
            return;
        }
        let n = batch.len();
        let data: Vec<SpanData> = batch
            .into_iter()
            .map(|f| f.into_span_data(&self.scope))
            .collect();
        self.export(data, n, now);
    }

    /// Asks the collector whether it is back, with an empty export, once the pause is over.
    fn probe(&mut self, now: Nanos) {
        if !self.backoff.waiting(now) {
            self.export(Vec::new(), 0, now);
        }
    }

    fn export(&mut self, data: Vec<SpanData>, n: usize, now: Nanos) {
        match self.exporter.export_blocking(data) {
            Ok(()) => {
                if n > 0 {
                    ::metrics::counter!(names::SPANS_EXPORTED).increment(n as u64);
                }
                if self.backoff.succeeded() {
                    self.pause.set(None);
                    tracing::info!(endpoint = self.endpoint, "OTLP span export works again");
                }
            }
            Err(e) => {
                count_dropped("export_failed", n);
                let first = self.backoff.until.is_none();
                let wait = self.backoff.failed(now);
                self.pause.set(self.backoff.until);
                if first {
                    tracing::warn!(
                        endpoint = self.endpoint,
                        error = %e,
                        "OTLP span export failed; spans are not recorded until the collector answers again (asked again in {} s, then less and less often)",
                        wait / NS_PER_SEC
                    );
                }
            }
        }
    }
}

/// Builds and exports batches until every sender is gone. While export is paused, batches that
/// still arrive (spans that were open) are dropped and the collector is probed when the pause ends.
fn export_loop<E: ExportOn + ?Sized>(
    exporter: &E,
    rx: &Receiver<Vec<Finished>>,
    clock: &dyn Clock,
    pause: &Pause,
    endpoint: &str,
) {
    let mut state = ExportState::new(exporter, pause, endpoint);
    loop {
        let next = match state.probe_in(clock.mono()) {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(wait) => rx.recv_timeout(wait),
        };
        match next {
            Ok(batch) => state.batch(batch, clock.mono()),
            Err(RecvTimeoutError::Timeout) => state.probe(clock.mono()),
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_sdk::error::OTelSdkError;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct FakeExporter {
        down: AtomicBool,
        /// Sizes of the batches it was asked to export.
        calls: Mutex<Vec<usize>>,
    }

    impl SpanExporter for FakeExporter {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.calls.lock().unwrap().push(batch.len());
            match self.down.load(Ordering::SeqCst) {
                true => Err(OTelSdkError::InternalFailure("connection refused".into())),
                false => Ok(()),
            }
        }
    }

    fn sheds(n: usize) -> Vec<Finished> {
        (0..n).map(|_| Finished::feedback_example()).collect()
    }

    #[test]
    fn failed_exports_pause_export_with_a_doubling_backoff_and_a_probe_resumes_it() {
        let exporter = Blocking(FakeExporter::default());
        let pause = Pause::default();
        let mut st = ExportState::new(&exporter, &pause, "http://collector");
        let s = NS_PER_SEC;
        st.batch(sheds(3), 0);
        assert_eq!(*exporter.0.calls.lock().unwrap(), [3]);
        assert_eq!(st.probe_in(0), None, "export works: no probing");

        exporter.0.down.store(true, Ordering::SeqCst);
        st.batch(sheds(2), 10 * s);
        assert!(pause.active(10 * s) && !pause.active(11 * s));
        assert_eq!(st.probe_in(10 * s), Some(Duration::from_secs(1)));
        st.batch(sheds(4), 10 * s + 1);
        assert_eq!(
            exporter.0.calls.lock().unwrap().len(),
            2,
            "dropped while paused"
        );
        st.probe(10 * s + 2);
        assert_eq!(
            exporter.0.calls.lock().unwrap().len(),
            2,
            "no probe before the pause ends"
        );
        // Each failed probe doubles the pause: 2 s, 4 s, ... up to 30 s.
        let mut now = 11 * s;
        for wait in [2, 4, 8, 16, 30, 30] {
            st.probe(now);
            assert_eq!(
                exporter.0.calls.lock().unwrap().last(),
                Some(&0),
                "an empty probe"
            );
            assert_eq!(st.probe_in(now), Some(Duration::from_secs(wait)));
            now += wait * s;
        }
        exporter.0.down.store(false, Ordering::SeqCst);
        st.probe(now);
        assert_eq!(st.probe_in(now), None);
        assert!(!pause.active(now));
        st.batch(sheds(5), now);
        assert_eq!(exporter.0.calls.lock().unwrap().last(), Some(&5));
        // The next outage starts again at 1 s.
        exporter.0.down.store(true, Ordering::SeqCst);
        st.batch(sheds(1), now);
        assert_eq!(st.probe_in(now), Some(Duration::from_secs(1)));
    }
}
