//! `POST /v1/admit`: validation, the ask to the tenant actor, holding, and the answer.
//!
//! Holding happens here, in the request's own task, never in the actor: the actor has already reserved
//! the tokens (or queued the call for a slot), and this task sleeps until the reservation is due. A drop
//! guard returns the reservation or the queue place if the caller disconnects meanwhile (hyper drops the
//! request future when its connection closes), so an abandoned call spends nothing.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use compact_str::CompactString;
use serde::{Deserialize, Serialize};
use warp::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use warp::reply::Response;

use super::error::ApiError;
use super::inflight::Held;
use super::overload::{self, Overload};
use super::policy_cache::PolicyCache;
use super::spend::{clean, SpendField};
use super::{body, json, lease, name_field, App};
use crate::actors::{AdmitReply, AskError, CancelLease, CancelWaiter, ConfirmHold, Layers, Shared};
use crate::clock::{ceil_ms, ceil_secs};
use crate::config::Mode;
use crate::engine::refusal::whole_seconds;
use crate::engine::{tightest, AdmitRequest, Decision, LayerState, Scope, Shed, Verdict};
use crate::telemetry::{DecisionEvent, DecisionKind, SpanFields};

/// Names borrow from the request body when they need no unescaping (the usual case), so the only
/// copies made are the ones the tenant actor keeps.
#[derive(Deserialize)]
struct AdmitBody<'a> {
    #[serde(borrow)]
    tenant: Cow<'a, str>,
    #[serde(borrow)]
    subject: Cow<'a, str>,
    #[serde(borrow)]
    tool: Cow<'a, str>,
    #[serde(default, borrow)]
    upstream: Option<Cow<'a, str>>,
    #[serde(default)]
    cost: Option<f64>,
    #[serde(default)]
    max_wait_ms: Option<f64>,
    #[serde(default)]
    call_id: Option<String>,
    /// The call runs as an MCP task: its lease lives `[tasks] lease_ttl` and the answer carries
    /// `poll_interval_ms`.
    #[serde(default)]
    task: bool,
    /// The agent run (task) the call belongs to, for `run` spend budgets.
    #[serde(default, borrow, deserialize_with = "borrowed")]
    run: Option<Cow<'a, str>>,
    /// The call's own spend estimates, by unit.
    #[serde(default)]
    spend: Option<std::collections::BTreeMap<String, f64>>,
}

/// An optional string that borrows from the body when it needs no unescaping. serde borrows a
/// `Cow<str>` field but not an `Option<Cow<str>>`, which it always copies: for `run` on every call
/// of an agent run that was an allocation per admission.
fn borrowed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    #[derive(Deserialize)]
    struct Borrowed<'a>(#[serde(borrow)] Cow<'a, str>);
    Ok(Option::<Borrowed>::deserialize(d)?.map(|b| b.0))
}

/// Returns what a held call took if its request is dropped before the hold ends.
struct HoldGuard<'a> {
    shared: &'a Arc<Shared>,
    tenant: &'a str,
    lease: Option<u64>,
    waiter: Option<u64>,
}

impl Drop for HoldGuard<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.waiter.take() {
            self.shared.tell_existing(self.tenant, CancelWaiter(w));
        }
        if let Some(l) = self.lease.take() {
            self.shared.tell_existing(self.tenant, CancelLease(l));
        }
    }
}

pub async fn admit(
    app: &Arc<App>,
    traceparent: Option<String>,
    bytes: bytes::Bytes,
) -> Result<Response, ApiError> {
    // One monotonic reading dates the request both for the actor (which drops requests older than
    // the API waits for) and for the decision latency: each reading is a clock read of 20-40 ns.
    let started = app.shared.clock.mono();
    // Counted until answered: shutdown waits for every admission that got this far.
    let _admitting = super::inflight::Admitting::enter();
    if app.shared.stopping() {
        return Ok(overload::refused(Overload::ShuttingDown));
    }
    let traced = app.shared.telemetry.traces();
    // The wall-clock start only dates spans.
    let start_unix_ns = if traced {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    } else {
        0
    };
    let mut b: AdmitBody = body::parse_json(&bytes)?;
    name_field("tenant", &b.tenant)?;
    name_field("subject", &b.subject)?;
    name_field("tool", &b.tool)?;
    if let Some(u) = &b.upstream {
        name_field("upstream", u)?;
    }
    let shared = &app.shared;
    let mut req = AdmitRequest {
        subject: CompactString::from(&*b.subject),
        tool: CompactString::from(&*b.tool),
        upstream: b.upstream.as_deref().map(CompactString::from),
        cost: None,
        max_wait_ns: 0,
        returning: false,
        spend: None,
    };
    let tenant = &*b.tenant;
    let task = b.task;
    let call_id = b.call_id.take();
    let (call_id, shadow) = match the_rest(shared, &b, call_id, &mut req) {
        Ok(rest) => rest,
        // The call names a valid key, so its answer carries that key's rate-limit headers too.
        // Boxed, like the hold below: rare, and it must not grow every request's future.
        Err(e) => return Ok(Box::pin(refused_before_deciding(shared, tenant, req, e)).await),
    };
    let max_wait_ns = req.max_wait_ns;
    // Kept for a second asking (see `wait_for_promise`) only when the call may wait.
    let again = (max_wait_ns > 0 && !shadow).then(|| req.clone());
    // A place among the tenant's calls being decided on this worker (see `gate`), kept until the
    // tenant's actor answers.
    let (places, mailbox) = {
        let bounds = &shared.config.load().overload;
        (bounds.tenant_in_decision, bounds.mailbox)
    };
    let place = match places {
        0 => None,
        n => match super::gate::enter(tenant, n, mailbox).await {
            Some(place) => Some(place),
            None => return Ok(overload::refused(Overload::Mailbox)),
        },
    };
    let mut reply = match shared.admit(tenant, req, started).await {
        Err(AskError::Overloaded) => return Ok(overload::refused(Overload::Mailbox)),
        r => r?,
    };
    drop(place);
    // Counts this call among the held ones while it waits, within `[overload] max_held`.
    let mut held = None;
    if let Some(again) = again {
        if let Some(ns) = promise_within_wait(&reply, max_wait_ns) {
            match Held::try_enter(shared.config.load().overload.max_held) {
                Some(h) => held = Some(h),
                // Nothing is reserved for a promise: the refusal gives nothing back.
                None => return Ok(overload::refused(Overload::Held)),
            }
            reply = Box::pin(wait_for_promise(shared, tenant, again, ns, started)).await?;
        }
    }
    if let AdmitReply::StoreDown = reply {
        return Ok(overload::refused(Overload::StoreUnavailable));
    }
    // Decision latency: parsing and the actor's answer; the waiting that follows is reported as waited.
    let decision_ns = shared.clock.mono().saturating_sub(started);
    let (decision, tenant_name) = match reply {
        AdmitReply::Decided(d, name) if !must_hold(&d, shadow) => (d, name),
        // Waiting is the exception, so its state lives in a box of its own: the request's future,
        // moved several times on its way into the connection task, stays small.
        reply => {
            if held.is_none() {
                if let Some(h) = Held::try_enter(shared.config.load().overload.max_held) {
                    held = Some(h);
                } else {
                    give_back(shared, tenant, &reply);
                    return Ok(overload::refused(Overload::Held));
                }
            }
            Box::pin(wait_out(shared, tenant, reply, max_wait_ns, shadow)).await?
        }
    };
    drop(held);
    // A task's lease is made long-lived once the call holds it (after any hold). A caller that
    // goes away meanwhile would leave a slot taken for the task's TTL: the guard gives it back.
    let poll_interval_ms = match &decision.verdict {
        Verdict::Admitted(a) if task => Some(Box::pin(start_task(shared, tenant, a.lease)).await),
        _ => None,
    };

    let (response, event) = answer_task(
        tenant_name,
        &decision,
        call_id,
        traceparent,
        decision_ns,
        start_unix_ns,
        traced,
        poll_interval_ms,
    );
    shared.telemetry.decision(event);
    Ok(response)
}

/// Makes an admitted call's lease a task ([`super::tasks::start`]); if the request is dropped
/// meanwhile (the caller hung up), the guard gives the lease back.
async fn start_task(shared: &Arc<Shared>, tenant: &str, lease: u64) -> u64 {
    let mut guard = HoldGuard {
        shared,
        tenant,
        lease: Some(lease),
        waiter: None,
    };
    let ms = super::tasks::start(shared, tenant, lease).await;
    guard.lease = None;
    ms
}

/// Checks the admission's fields other than its names and completes `req` with them: the call id
/// (an empty one is none) and whether the daemon is in shadow mode.
fn the_rest(
    shared: &Shared,
    b: &AdmitBody,
    call_id: Option<String>,
    req: &mut AdmitRequest,
) -> Result<(Option<String>, bool), ApiError> {
    // An empty call id is no call id (a client may send one rather than leave the field out).
    let call_id = call_id.filter(|c| !c.is_empty());
    if let Some(c) = &call_id {
        name_field("call_id", c)?;
    }
    if let Some(cost) = b.cost {
        if !(cost.is_finite() && cost > 0.0) {
            return Err(ApiError::invalid(format!(
                "cost {cost} must be a positive number"
            )));
        }
    }
    let cfg = shared.config.load();
    let server_cap = cfg.server.max_wait.as_nanos() as u64;
    req.max_wait_ns = match b.max_wait_ms {
        Some(ms) if ms.is_finite() && ms >= 0.0 => ((ms * 1e6) as u64).min(server_cap),
        Some(ms) => {
            return Err(ApiError::invalid(format!(
                "max_wait_ms {ms} must be a non-negative number"
            )))
        }
        None => server_cap,
    };
    req.cost = b.cost;
    req.spend = super::spend::call_spend(&cfg, b.run.as_deref(), b.spend.as_ref())?;
    Ok((call_id, cfg.server.mode == Mode::Shadow))
}

/// The answer to an admission refused before it was decided (a bad cost, wait or call id) whose key
/// is valid: the error, with the `RateLimit-Policy` and `RateLimit` headers of the layers the call
/// would have passed, as on every admission answer. Without them if the tenant's state does not
/// answer.
async fn refused_before_deciding(
    shared: &Arc<Shared>,
    tenant: &str,
    req: AdmitRequest,
    e: ApiError,
) -> Response {
    let mut response = warp::Reply::into_response(e);
    if let Ok(layers) = shared.ask(tenant, Layers(req)).await {
        ratelimit_headers(response.headers_mut(), &layers);
    }
    response
}

/// A call that may wait and was refused by a bucket that promised it a slot within its wait: the
/// slot's wait. The call was not held because callers refused earlier are promised the tokens a hold
/// would reserve; the daemon waits for the slot after theirs on the caller's behalf instead.
fn promise_within_wait(reply: &AdmitReply, max_wait_ns: u64) -> Option<u64> {
    let AdmitReply::Decided(d, _) = reply else {
        return None;
    };
    let Verdict::Shed(s) = &d.verdict else {
        return None;
    };
    let bucket = matches!(
        s.scope,
        Scope::Subject | Scope::SubjectTool | Scope::Tenant | Scope::TenantUpstream | Scope::Global
    );
    let ns = s.retry_after_ms.saturating_mul(1_000_000);
    (bucket && s.retryable && ns <= max_wait_ns).then_some(ns)
}

/// Sleeps until the promised slot and asks once more, with what is left of the call's wait.
async fn wait_for_promise(
    shared: &Arc<Shared>,
    tenant: &str,
    mut req: AdmitRequest,
    wait_ns: u64,
    started: u64,
) -> Result<AdmitReply, ApiError> {
    tokio::time::sleep(Duration::from_nanos(wait_ns)).await;
    req.max_wait_ns = req.max_wait_ns.saturating_sub(wait_ns);
    req.returning = true;
    let mut reply = shared.admit(tenant, req, shared.clock.mono()).await?;
    // The wait counts as waited, as a hold would.
    let waited = shared.clock.mono().saturating_sub(started);
    if let AdmitReply::Decided(d, _) = &mut reply {
        if let Verdict::Admitted(a) = &mut d.verdict {
            a.queued_ns = a.queued_ns.saturating_add(waited);
        }
    }
    Ok(reply)
}

/// Gives back what a call that will not wait after all took: its queue place or its reservation.
fn give_back(shared: &Arc<Shared>, tenant: &str, reply: &AdmitReply) {
    let mut guard = HoldGuard {
        shared,
        tenant,
        lease: None,
        waiter: None,
    };
    match reply {
        AdmitReply::Queued { waiter, .. } => guard.waiter = Some(*waiter),
        AdmitReply::Decided(d, _) => {
            if let Verdict::Admitted(a) = &d.verdict {
                guard.lease = Some(a.lease);
            }
        }
        AdmitReply::Late | AdmitReply::StoreDown => {}
    }
}

/// Whether an admitted call must sleep out its hold before it is answered.
fn must_hold(d: &Decision, shadow: bool) -> bool {
    matches!(&d.verdict, Verdict::Admitted(a) if a.hold_ns > 0 && !shadow)
}

/// The waiting part of an admission: a call queued for a concurrency slot until the actor decides
/// it, and an admitted call held until its reservation is due. If the request is dropped meanwhile
/// (the caller hung up), the guard gives back the queue place or the reservation.
async fn wait_out(
    shared: &Arc<Shared>,
    tenant: &str,
    reply: AdmitReply,
    max_wait_ns: u64,
    shadow: bool,
) -> Result<(Decision, Arc<str>), ApiError> {
    let mut guard = HoldGuard {
        shared,
        tenant,
        lease: None,
        waiter: None,
    };
    let (mut decision, tenant_name) = match reply {
        AdmitReply::Decided(d, name) => (d, name),
        AdmitReply::Late => return Err(AskError::Timeout.into()),
        AdmitReply::StoreDown => {
            return Err(ApiError::unavailable(
                "the shared state of the limits does not answer; retry the request",
            ))
        }
        AdmitReply::Queued { waiter, mut rx } => {
            guard.waiter = Some(waiter);
            // The actor answers by the deadline; the slack only guards against a lost answer.
            let slack = Duration::from_nanos(max_wait_ns) + Duration::from_secs(2);
            let d = if let Ok(Ok(d)) = tokio::time::timeout(slack, &mut rx).await {
                d
            } else {
                rx.close();
                match rx.try_recv() {
                    Ok(d) => d,
                    Err(_) => {
                        return Err(ApiError::unavailable(
                            "the tenant's queue did not answer in time; retry the request",
                        ))
                    }
                }
            };
            guard.waiter = None;
            (d, Arc::from(tenant))
        }
    };
    if let Verdict::Admitted(a) = &decision.verdict {
        if must_hold(&decision, shadow) {
            let (lease, hold_ns) = (a.lease, a.hold_ns);
            guard.lease = Some(lease);
            tokio::time::sleep(Duration::from_nanos(hold_ns)).await;
            // The layers were read when the call was decided; the answer goes out a hold later, when
            // each bucket is that much nearer to full.
            for l in &mut decision.layers {
                l.reset_ns = l.reset_ns.saturating_sub(hold_ns);
            }
            // An upstream of the call may have answered 429 while it was held: then it is refused
            // with the upstream's wait rather than sent to meet the same 429.
            if !decision.resolved.upstreams.is_empty() {
                if let Ok(Some(Ok(Some(refused)))) =
                    shared.ask_existing(tenant, ConfirmHold(lease)).await
                {
                    decision = refused;
                }
            }
            guard.lease = None;
        }
    }
    Ok((decision, tenant_name))
}

static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// A number written as an integer when it is whole (`20`, not `20.0`).
struct Num(f64);

impl Serialize for Num {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Whole (a comparison, not `fract`, which is a call into libm on the x86-64 baseline).
        if self.0.abs() < 9e15 && self.0 == self.0 as i64 as f64 {
            s.serialize_i64(self.0 as i64)
        } else {
            s.serialize_f64(self.0)
        }
    }
}

#[derive(Serialize)]
struct WouldShed<'a> {
    scope: &'a str,
    retry_after_ms: u64,
}

/// A lease id, written by [`lease::encode_into`] where the body is written by hand.
struct LeaseId<'a> {
    tenant: &'a str,
    lease: u64,
}

impl Serialize for LeaseId<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&lease::encode(self.tenant, self.lease))
    }
}

#[derive(Serialize)]
struct AdmittedBody<'a> {
    admitted: bool,
    lease_id: LeaseId<'a>,
    waited_ms: u64,
    /// One of [`Mode`]'s fixed words, written as it is.
    mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<Num>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reset_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    would_shed: Option<WouldShed<'a>>,
    /// Shadow mode: how long enforce mode would have held this call (shadow mode admits at once).
    #[serde(skip_serializing_if = "Option::is_none")]
    would_wait_ms: Option<u64>,
    /// An MCP task's first poll interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    poll_interval_ms: Option<u64>,
    /// `true` when nothing was checked: the shared store did not answer and `on_error =
    /// "fail_open"` admitted the call (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    unchecked: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    spend: Option<SpendField<'a>>,
}

#[derive(Serialize)]
struct TextContent<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    text: &'a str,
}

#[derive(Serialize)]
struct Structured<'a> {
    error: &'a str,
    scope: &'a str,
    retry_after_ms: u64,
    retryable: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    spend: Option<SpendShedFields<'a>>,
}

/// `unit`, `budget` and `remaining` of a refusal by a spend budget.
#[derive(Serialize, Clone, Copy)]
struct SpendShedFields<'a> {
    unit: &'a str,
    budget: &'static str,
    remaining: f64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolResult<'a> {
    content: [TextContent<'a>; 1],
    structured_content: Structured<'a>,
    is_error: bool,
}

#[derive(Serialize)]
pub(super) struct ShedBody<'a> {
    admitted: bool,
    scope: &'a str,
    reason: &'a str,
    retry_after_ms: u64,
    retryable: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    spend: Option<SpendShedFields<'a>>,
    tool_result: ToolResult<'a>,
}

/// A shed call's `CallToolResult` as JSON, for answers made elsewhere (the edge check's JSON-RPC).
pub(super) fn tool_result_json(s: &Shed) -> serde_json::Value {
    serde_json::to_value(shed_body(s).tool_result).unwrap_or_default()
}

pub(super) fn shed_body(s: &Shed) -> ShedBody<'_> {
    let spend = s.spend.as_deref().map(|x| SpendShedFields {
        unit: &x.unit,
        budget: x.budget.as_str(),
        remaining: clean(x.remaining),
    });
    ShedBody {
        admitted: false,
        scope: s.scope.as_str(),
        reason: &s.reason,
        retry_after_ms: s.retry_after_ms,
        retryable: s.retryable,
        spend,
        tool_result: ToolResult {
            content: [TextContent {
                kind: "text",
                text: &s.message,
            }],
            structured_content: Structured {
                error: "rate_limited",
                scope: s.scope.as_str(),
                retry_after_ms: s.retry_after_ms,
                retryable: s.retryable,
                spend,
            },
            is_error: true,
        },
    }
}

/// The largest integer a structured field may carry (RFC 8941: at most 15 digits). Larger values
/// (a burst near the 1e15 the config allows, the refill time of a huge burst at a tiny rate) are
/// written as this.
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

fn sf_integer(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
}

/// The whole part of a burst (bursts are positive: truncation is `floor`, without a call into libm).
pub(super) fn whole(burst: f64) -> u64 {
    burst as u64
}

/// Appends a layer name as the inside of a structured-field string. A string may hold printable
/// ASCII only, and an upstream's name (in `tenant_upstream:<name>`) may be any UTF-8 without control
/// characters: bytes outside printable ASCII, and `"`, `\` and `%`, are written `%xx`.
fn push_sf_name(out: &mut String, name: &str) {
    let plain = |b: u8| (0x20..=0x7e).contains(&b) && !matches!(b, b'"' | b'\\' | b'%');
    if name.bytes().all(plain) {
        out.push_str(name);
        return;
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in name.bytes() {
        if plain(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
    }
}

/// `RateLimit-Policy`: every bucket layer that applied, `"name";q=<burst>;w=<seconds to refill>`.
pub fn policy_header(layers: &[LayerState]) -> String {
    let mut s = String::new();
    let mut n = itoa::Buffer::new();
    for (i, l) in layers.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push('"');
        push_sf_name(&mut s, &l.name);
        s.push_str("\";q=");
        s.push_str(n.format(sf_integer(whole(l.burst))));
        s.push_str(";w=");
        s.push_str(n.format(sf_integer(l.window_secs)));
    }
    s
}

/// `RateLimit`: the tightest layer, `"name";r=<whole tokens left>;t=<seconds until full>`.
pub fn ratelimit_header(l: &LayerState) -> String {
    let mut s = String::with_capacity(l.name.len() + 32);
    let mut n = itoa::Buffer::new();
    s.push('"');
    push_sf_name(&mut s, &l.name);
    s.push_str("\";r=");
    s.push_str(n.format(sf_integer(l.remaining)));
    s.push_str(";t=");
    s.push_str(n.format(sf_integer(ceil_secs(l.reset_ns))));
    s
}

/// The body of an admission, written directly: it is on every answer, and serde's generic path cost
/// several times this. `admitted_body_matches_serde` holds it to the serde rendering of
/// [`AdmittedBody`]. It assumes nothing it copies needs escaping: the lease id is hex digits (and the
/// tenant hex-encoded), the mode one of [`Mode`]'s fixed words; the numbers go through `itoa` or
/// serde. Writing the lease id and mode as they are took the answer from about 3 640 to 3 030
/// instructions (callgrind; docs/BENCHMARKS.md).
fn write_admitted(b: &AdmittedBody) -> Vec<u8> {
    // Room for a spend field too (about 80 bytes a unit), so that it is not grown on the way.
    let spend = b.spend.as_ref().map_or(0, |s| 96 * s.0.len());
    let mut out = Vec::with_capacity(160 + 2 * b.lease_id.tenant.len() + spend);
    let mut n = itoa::Buffer::new();
    out.extend_from_slice(b"{\"admitted\":true,\"lease_id\":\"");
    lease::encode_into(&mut out, b.lease_id.tenant, b.lease_id.lease);
    out.extend_from_slice(b"\",\"waited_ms\":");
    out.extend_from_slice(n.format(b.waited_ms).as_bytes());
    out.extend_from_slice(b",\"mode\":\"");
    out.extend_from_slice(b.mode.as_bytes());
    out.push(b'"');
    if let Some(r) = b.remaining {
        out.extend_from_slice(b",\"remaining\":");
        out.extend_from_slice(n.format(r).as_bytes());
    }
    if let Some(l) = &b.limit {
        out.extend_from_slice(b",\"limit\":");
        let _ = serde_json::to_writer(&mut out, l);
    }
    if let Some(r) = b.reset_ms {
        out.extend_from_slice(b",\"reset_ms\":");
        out.extend_from_slice(n.format(r).as_bytes());
    }
    if let Some(w) = &b.would_shed {
        out.extend_from_slice(b",\"would_shed\":");
        let _ = serde_json::to_writer(&mut out, w);
    }
    if let Some(w) = b.would_wait_ms {
        out.extend_from_slice(b",\"would_wait_ms\":");
        out.extend_from_slice(n.format(w).as_bytes());
    }
    if let Some(p) = b.poll_interval_ms {
        out.extend_from_slice(b",\"poll_interval_ms\":");
        out.extend_from_slice(n.format(p).as_bytes());
    }
    if let Some(u) = b.unchecked {
        out.extend_from_slice(if u {
            b",\"unchecked\":true"
        } else {
            b",\"unchecked\":false"
        });
    }
    if let Some(s) = &b.spend {
        out.extend_from_slice(b",\"spend\":");
        s.write_into(&mut out);
    }
    out.push(b'}');
    out
}

pub(super) fn answer(
    tenant: Arc<str>,
    d: &Decision,
    call_id: Option<String>,
    traceparent: Option<String>,
    decision_ns: u64,
    start_unix_ns: u128,
    traced: bool,
) -> (Response, DecisionEvent) {
    answer_task(
        tenant,
        d,
        call_id,
        traceparent,
        decision_ns,
        start_unix_ns,
        traced,
        None,
    )
}

/// [`answer`], with a task's first poll interval in the admitted body.
#[allow(clippy::too_many_arguments)]
fn answer_task(
    tenant: Arc<str>,
    d: &Decision,
    call_id: Option<String>,
    traceparent: Option<String>,
    decision_ns: u64,
    start_unix_ns: u128,
    traced: bool,
    poll_interval_ms: Option<u64>,
) -> (Response, DecisionEvent) {
    let tightest = d.tightest();
    // For spans only (without them the header is not even looked up; see `body::Head::read`).
    let mut span = traced.then(|| {
        Box::new(SpanFields {
            traceparent,
            lease: None,
            start_unix_ns,
        })
    });
    let mut event = DecisionEvent {
        tenant: tenant.clone(),
        subject: d.resolved.subject.clone(),
        subject_label: d.resolved.subject_label.clone(),
        tool: d.resolved.tool.clone(),
        upstream: d.resolved.upstream.clone(),
        cost: d.resolved.cost,
        kind: DecisionKind::Admitted,
        scope: None,
        retryable: false,
        waited_ns: 0,
        retry_after_ms: 0,
        decision_ns,
        call_id,
        lease: 0,
        unchecked: false,
        span: None,
    };
    let mut response = match &d.verdict {
        Verdict::Admitted(a) => {
            let waited_ns = if a.mode == Mode::Shadow {
                0
            } else {
                a.queued_ns + a.hold_ns
            };
            event.waited_ns = waited_ns;
            event.lease = a.lease;
            if let Some(s) = &a.would_shed {
                event.kind = DecisionKind::ShadowShed;
                event.scope = Some(s.scope);
                event.retry_after_ms = s.retry_after_ms;
                event.retryable = s.retryable;
            }
            let body = AdmittedBody {
                admitted: true,
                lease_id: LeaseId {
                    tenant: &tenant,
                    lease: a.lease,
                },
                waited_ms: ceil_ms(waited_ns),
                mode: a.mode.as_str(),
                remaining: tightest.map(|t| t.remaining),
                limit: tightest.map(|t| Num(t.burst)),
                reset_ms: tightest.map(|t| ceil_ms(t.reset_ns)),
                would_shed: a.would_shed.as_ref().map(|s| WouldShed {
                    scope: s.scope.as_str(),
                    retry_after_ms: s.retry_after_ms,
                }),
                would_wait_ms: (a.mode == Mode::Shadow && a.hold_ns > 0)
                    .then(|| ceil_ms(a.hold_ns)),
                poll_interval_ms,
                unchecked: a.unchecked.then_some(true),
                spend: a.spend.as_deref().map(|v| SpendField(v)),
            };
            event.unchecked = a.unchecked;
            let r = super::json_response(StatusCode::OK, write_admitted(&body));
            if let Some(span) = &mut span {
                span.lease = Some(a.lease);
            }
            r
        }
        Verdict::Shed(s) => {
            event.kind = DecisionKind::Shed;
            event.scope = Some(s.scope);
            event.retry_after_ms = s.retry_after_ms;
            event.retryable = s.retryable;
            let mut r = json(StatusCode::TOO_MANY_REQUESTS, &shed_body(s));
            if s.retryable {
                r.headers_mut().insert(
                    warp::http::header::RETRY_AFTER,
                    HeaderValue::from(whole_seconds(s.retry_after_ms).max(1)),
                );
            }
            r
        }
    };
    ratelimit_headers(response.headers_mut(), &d.layers);
    event.span = span;
    (response, event)
}

/// `RateLimit-Policy` (every layer) and `RateLimit` (the tightest), when any layer applied.
fn ratelimit_headers(h: &mut HeaderMap, layers: &[LayerState]) {
    if let Some(v) = PolicyCache::header(layers) {
        h.insert(&RATELIMIT_POLICY, v);
    }
    if let Some(t) = tightest(layers) {
        let v = ratelimit_header(t).into_bytes();
        if let Ok(v) = HeaderValue::from_maybe_shared(bytes::Bytes::from(v)) {
            h.insert(&RATELIMIT, v);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::clock::NS_PER_SEC;
    use crate::engine::{Layer, Scope};

    /// A caller that goes away while its admitted call is being made a task must not leave the
    /// lease to live the task's TTL. The window is the wait for the tenant actor's answer to the
    /// start: microseconds in memory mode, and with Redis one script call, which the Redis
    /// client gives up on after 500 ms (a Redis held longer marks the store down and the call is
    /// answered as a plain one), too short and too loosely timed for a black-box test to hang up
    /// inside it on purpose. Here the start's future is polled once (the message is sent; the
    /// actor, on this thread, has not answered) and dropped, as hyper drops a request's future.
    #[test]
    fn a_caller_gone_while_its_call_is_made_a_task_gives_the_lease_back() {
        use crate::clock::FakeClock;
        use crate::config::Config;
        use crate::telemetry::Telemetry;
        use futures_util::FutureExt;
        actix::System::new().block_on(async {
            let config = "[limits.tenant]\nconcurrency = 1\n";
            let shared = Shared::new(
                Config::parse("t.toml", config).unwrap(),
                Arc::new(FakeClock::new(0)),
                Telemetry::default(),
                vec![actix::Arbiter::current()],
            );
            let call = || AdmitRequest {
                subject: "worker".into(),
                tool: "export".into(),
                upstream: None,
                cost: None,
                max_wait_ns: 0,
                returning: false,
                spend: None,
            };
            let admitted = |r: &AdmitReply| {
                matches!(r, AdmitReply::Decided(d, _) if matches!(d.verdict, Verdict::Admitted(_)))
            };
            let first = shared.admit("acme", call(), 0).await.unwrap();
            let AdmitReply::Decided(d, _) = &first else {
                panic!("decided at once");
            };
            let Verdict::Admitted(a) = &d.verdict else {
                panic!("admitted");
            };
            assert!(
                start_task(&shared, "acme", a.lease).now_or_never().is_none(),
                "the start waits for the actor"
            );
            // The start and the lease's return reach the actor in that order; the next call
            // finds the only slot free.
            let next = shared.admit("acme", call(), 0).await.unwrap();
            assert!(admitted(&next), "the slot came back");
            // And the slot is taken while a task holds it, so the check above can fail.
            let AdmitReply::Decided(d, _) = &next else {
                unreachable!()
            };
            let Verdict::Admitted(a) = &d.verdict else {
                unreachable!()
            };
            start_task(&shared, "acme", a.lease).await;
            let refused = shared.admit("acme", call(), 0).await.unwrap();
            assert!(!admitted(&refused), "a task holds the slot");
        });
    }

    pub(in crate::api) fn layer(
        layer: Layer,
        burst: f64,
        w: u64,
        remaining: u64,
        reset_ns: u64,
    ) -> LayerState {
        LayerState {
            layer,
            name: layer.as_str().into(),
            burst,
            window_secs: w,
            remaining,
            reset_ns,
        }
    }

    #[test]
    fn headers_follow_the_structured_field_form() {
        let layers = [
            layer(Layer::Subject, 20.0, 10, 19, NS_PER_SEC / 2),
            layer(Layer::Tenant, 50.0, 5, 49, NS_PER_SEC / 10),
        ];
        assert_eq!(
            policy_header(&layers),
            "\"subject\";q=20;w=10, \"tenant\";q=50;w=5"
        );
        assert_eq!(ratelimit_header(&layers[0]), "\"subject\";r=19;t=1");
    }

    #[test]
    fn header_names_stay_within_structured_field_strings() {
        let mut l = layer(Layer::TenantUpstream, 9.0, 2, 3, NS_PER_SEC);
        l.name = "tenant_upstream:crm".into();
        assert_eq!(
            policy_header(&[l.clone()]),
            "\"tenant_upstream:crm\";q=9;w=2"
        );
        l.name = "tenant_upstream:é \"x\"\\50%".into();
        let policy = policy_header(&[l.clone()]);
        assert_eq!(policy, "\"tenant_upstream:%c3%a9 %22x%22%5c50%25\";q=9;w=2");
        assert_eq!(
            ratelimit_header(&l),
            "\"tenant_upstream:%c3%a9 %22x%22%5c50%25\";r=3;t=1"
        );
        // Printable ASCII only, and the one pair of quotes delimits the string.
        assert!(policy.bytes().all(|b| (0x20..=0x7e).contains(&b)));
        assert_eq!(policy.matches('"').count(), 2);
    }

    #[test]
    fn header_numbers_stay_within_structured_field_integers() {
        let huge = [layer(
            Layer::Subject,
            1e15,
            u64::MAX,
            1_000_000_000_000_000,
            u64::MAX,
        )];
        assert_eq!(
            policy_header(&huge),
            "\"subject\";q=999999999999999;w=999999999999999"
        );
        assert_eq!(
            ratelimit_header(&huge[0]),
            "\"subject\";r=999999999999999;t=18446744074"
        );
    }

    #[test]
    fn a_run_borrows_from_the_body_unless_it_is_escaped() {
        let plain = br#"{"tenant":"t","subject":"s","tool":"x","run":"r-1"}"#;
        let b: AdmitBody = serde_json::from_slice(plain).unwrap();
        assert!(matches!(b.run, Some(Cow::Borrowed("r-1"))));
        let escaped = br#"{"tenant":"t","subject":"s","tool":"x","run":"r\u002d2"}"#;
        let b: AdmitBody = serde_json::from_slice(escaped).unwrap();
        assert!(matches!(b.run.as_deref(), Some("r-2")));
        let none = br#"{"tenant":"t","subject":"s","tool":"x","run":null}"#;
        assert!(serde_json::from_slice::<AdmitBody>(none)
            .unwrap()
            .run
            .is_none());
        let absent = br#"{"tenant":"t","subject":"s","tool":"x"}"#;
        assert!(serde_json::from_slice::<AdmitBody>(absent)
            .unwrap()
            .run
            .is_none());
        let wrong = br#"{"tenant":"t","subject":"s","tool":"x","run":5}"#;
        assert!(serde_json::from_slice::<AdmitBody>(wrong).is_err());
    }

    #[test]
    fn admitted_body_matches_serde() {
        let shed = WouldShed {
            scope: "subject",
            retry_after_ms: 1500,
        };
        let views = [
            crate::engine::spend::SpendView {
                unit: "usd".into(),
                reserved: 0.05,
                remaining: Some((0.93, crate::engine::spend::SpendBudget::Run)),
            },
            crate::engine::spend::SpendView {
                unit: "tokens".into(),
                reserved: 300.0,
                remaining: None,
            },
            crate::engine::spend::SpendView {
                unit: "rows_2".into(),
                reserved: 0.0,
                remaining: Some((
                    -0.6000000001,
                    crate::engine::spend::SpendBudget::SubjectDaily,
                )),
            },
            crate::engine::spend::SpendView {
                unit: "big".into(),
                reserved: 1e15,
                remaining: Some((
                    99_999_999_999_500.0,
                    crate::engine::spend::SpendBudget::TenantDaily,
                )),
            },
        ];
        // A name that would need escaping (config never makes one) takes serde's path.
        let odd = [crate::engine::spend::SpendView {
            unit: "odd\"name".into(),
            reserved: f64::INFINITY,
            remaining: Some((1e-7, crate::engine::spend::SpendBudget::Run)),
        }];
        let bodies = [
            AdmittedBody {
                admitted: true,
                lease_id: LeaseId {
                    tenant: "acme",
                    lease: 0xdead_beef,
                },
                waited_ms: 0,
                mode: "enforce",
                remaining: Some(19),
                limit: Some(Num(20.0)),
                reset_ms: Some(500),
                would_shed: None,
                would_wait_ms: None,
                poll_interval_ms: None,
                unchecked: None,
                spend: None,
            },
            AdmittedBody {
                admitted: true,
                lease_id: LeaseId {
                    tenant: "a\"b\\c ü",
                    lease: u64::MAX,
                },
                waited_ms: 1234,
                mode: "shadow",
                remaining: None,
                limit: Some(Num(2.5)),
                reset_ms: None,
                would_shed: Some(shed),
                would_wait_ms: Some(250),
                poll_interval_ms: Some(5_500),
                unchecked: None,
                spend: Some(SpendField(&views)),
            },
            AdmittedBody {
                admitted: true,
                lease_id: LeaseId {
                    tenant: "t",
                    lease: 0,
                },
                waited_ms: u64::MAX,
                mode: "enforce",
                remaining: Some(0),
                limit: None,
                reset_ms: Some(u64::MAX),
                would_shed: None,
                would_wait_ms: None,
                poll_interval_ms: Some(u64::MAX),
                unchecked: Some(true),
                spend: Some(SpendField(&odd)),
            },
        ];
        for b in &bodies {
            let by_hand = write_admitted(b);
            assert_eq!(
                String::from_utf8(by_hand).unwrap(),
                serde_json::to_string(b).unwrap()
            );
        }
    }

    #[test]
    fn shed_body_is_a_complete_tool_result() {
        let s = Shed {
            scope: Scope::TenantUpstream,
            retry_after_ms: 4000,
            retryable: true,
            reason: "rate limit reached".into(),
            message: "Wait 4 seconds".into(),
            spend: None,
        };
        let v = serde_json::to_value(shed_body(&s)).unwrap();
        assert_eq!(v["admitted"], false);
        assert_eq!(v["scope"], "tenant_upstream");
        assert_eq!(v["tool_result"]["isError"], true);
        assert_eq!(v["tool_result"]["content"][0]["type"], "text");
        assert_eq!(
            v["tool_result"]["structuredContent"]["retry_after_ms"],
            4000
        );
        assert_eq!(
            v["tool_result"]["structuredContent"]["error"],
            "rate_limited"
        );
    }
}

#[cfg(test)]
#[path = "admit_props.rs"]
mod props;
