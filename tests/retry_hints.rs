//! What a retry hint promises, end to end: callers refused together that each sleep exactly as told
//! must find their slot on their first retry, on every retryable scope, and everyone must be served
//! close to the physical limit (what the limits allow with perfect knowledge).
//!
//! Each test scales its rates so that it runs in a few seconds. Tolerances hold on a busy 2-core
//! machine: a caller that comes back late still finds its slot (slots are kept), so lateness only
//! stretches the time to serve, which is allowed 1.2× the physical limit plus scheduling slack.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::{Answer, Daemon};
use serde_json::{json, Value};

/// Scheduling slack on top of 1.2× the physical limit: thread wake-ups and HTTP round trips on a
/// loaded machine, a few per caller chain.
const SLACK: Duration = Duration::from_millis(800);

/// Checks that a refusal says the same wait three times: `retry_after_ms`, `Retry-After` and the
/// number in the text. Returns the wait in milliseconds.
fn honest_hint(a: &Answer) -> u64 {
    assert_eq!(a.status, 429, "{:?}", a.body);
    assert_eq!(a.body["retryable"], true, "{:?}", a.body);
    let ms = a.body["retry_after_ms"].as_u64().expect("retry_after_ms");
    let secs = ms.div_ceil(1000);
    assert_eq!(
        a.header("retry-after").as_deref(),
        Some(secs.to_string().as_str()),
        "{:?}",
        a.body
    );
    let text = a.body["tool_result"]["content"][0]["text"]
        .as_str()
        .expect("text");
    let unit = if secs == 1 { "second" } else { "seconds" };
    assert!(
        text.contains(&format!("Wait {secs} {unit}")),
        "text {text:?} does not say {secs} {unit} ({ms} ms)"
    );
    assert_eq!(
        a.body["tool_result"]["structuredContent"]["retry_after_ms"], ms,
        "{:?}",
        a.body
    );
    ms
}

/// What a herd of callers went through.
struct Herd {
    /// Callers refused on their first call.
    refused: usize,
    /// Of those, how many were admitted on their first retry.
    first_retry_ok: usize,
    /// From the start until the last caller's call was done (admitted, and held as long as the call
    /// runs).
    served_by: Duration,
    /// Scopes of the first refusals.
    scopes: Vec<String>,
}

impl Herd {
    fn share(&self) -> f64 {
        if self.refused == 0 {
            1.0
        } else {
            self.first_retry_ok as f64 / self.refused as f64
        }
    }

    fn report(&self, row: &str, physical: Duration) {
        println!(
            "{row}: {} refused, first retry succeeded for {} ({:.0}%); everyone served by {:.2} s (physical limit {:.2} s, {:.2}x); scopes {:?}",
            self.refused,
            self.first_retry_ok,
            self.share() * 100.0,
            self.served_by.as_secs_f64(),
            physical.as_secs_f64(),
            self.served_by.as_secs_f64() / physical.as_secs_f64(),
            {
                let mut s = self.scopes.clone();
                s.sort();
                s.dedup();
                s
            }
        );
    }

    fn assert_targets(&self, row: &str, physical: Duration) {
        self.report(row, physical);
        assert!(
            self.share() >= 0.9,
            "{row}: only {} of {} first retries succeeded",
            self.first_retry_ok,
            self.refused
        );
        let bound = physical.mul_f64(1.2) + SLACK;
        assert!(
            self.served_by <= bound,
            "{row}: everyone served by {:?}, more than {bound:?}",
            self.served_by
        );
    }
}

/// `n` callers call at once (`body(i)`); each admitted call runs for `runs` and is then released
/// with that duration; each refused caller sleeps exactly as told and calls again, until admitted.
/// Times are measured from `start`.
fn herd(
    d: &Arc<Daemon>,
    n: usize,
    body: impl Fn(usize) -> Value + Send + Sync + 'static,
    runs: Duration,
    start: Instant,
) -> Herd {
    herd_over(&Arc::new(vec![d.clone()]), n, body, runs, start)
}

/// [`herd`] over several replicas: caller `i`'s attempt `k` goes to replica `(i + k) % n`, and its
/// release to the next one.
fn herd_over(
    fleet: &Arc<Vec<Arc<Daemon>>>,
    n: usize,
    body: impl Fn(usize) -> Value + Send + Sync + 'static,
    runs: Duration,
    start: Instant,
) -> Herd {
    let barrier = Arc::new(Barrier::new(n));
    let body = Arc::new(body);
    let callers: Vec<_> = (0..n)
        .map(|i| {
            let (fleet, barrier, body) = (fleet.clone(), barrier.clone(), body.clone());
            std::thread::spawn(move || {
                let body = body(i);
                barrier.wait();
                let mut first_scope = None;
                let mut first_retry_ok = None;
                for attempt in 0..100 {
                    let d = &fleet[(i + attempt) % fleet.len()];
                    let a = d.admit(body.clone());
                    if attempt == 1 {
                        first_retry_ok = Some(a.status == 200);
                    }
                    if a.status == 200 {
                        std::thread::sleep(runs);
                        let done = start.elapsed();
                        let r = fleet[(i + attempt + 1) % fleet.len()].post(
                            "/v1/release",
                            json!({"lease_id": a.body["lease_id"], "outcome": "ok",
                                   "duration_ms": runs.as_millis() as u64}),
                        );
                        assert_eq!(r.status, 200, "{:?}", r.body);
                        return (first_scope, first_retry_ok, done);
                    }
                    let wait = honest_hint(&a);
                    if attempt == 0 {
                        first_scope = a.body["scope"].as_str().map(str::to_string);
                    }
                    std::thread::sleep(Duration::from_millis(wait));
                }
                panic!("caller {i} was never admitted");
            })
        })
        .collect();
    let results: Vec<_> = callers.into_iter().map(|c| c.join().unwrap()).collect();
    Herd {
        refused: results.iter().filter(|r| r.0.is_some()).count(),
        first_retry_ok: results.iter().filter(|r| r.1 == Some(true)).count(),
        served_by: results.iter().map(|r| r.2).max().unwrap_or_default(),
        scopes: results.iter().filter_map(|r| r.0.clone()).collect(),
    }
}

/// Generous limits everywhere except where a test sets its own.
const OPEN: &str = "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n\
                    [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n";

fn call(subject: &str, i: usize) -> Value {
    json!({"tenant": "t", "subject": subject, "tool": "query", "max_wait_ms": 0, "call_id": format!("c{i}")})
}

#[test]
fn subject_bucket_hints_hold() {
    // 10/s, burst 20, 60 callers: 20 at once, 40 more at 10/s.
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"10/s\"\nburst = 20\nconcurrency = 1000\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    ));
    let h = herd(
        &d,
        60,
        |i| call("fan-out", i),
        Duration::ZERO,
        Instant::now(),
    );
    assert!(h.scopes.iter().all(|s| s == "subject"), "{:?}", h.scopes);
    h.assert_targets("subject bucket", Duration::from_secs(4));
}

#[test]
fn tenant_upstream_hints_hold() {
    // 5/s, burst 10, 30 callers: 10 at once, 20 more at 5/s.
    let d = Arc::new(Daemon::start(&format!(
        "{OPEN}[upstreams.api]\nrate = \"5/s\"\nburst = 10\n[tools.query]\nupstream = \"api\"\n"
    )));
    let h = herd(
        &d,
        30,
        |i| call(&format!("agent-{i}"), i),
        Duration::ZERO,
        Instant::now(),
    );
    assert!(
        h.scopes.iter().all(|s| s == "tenant_upstream"),
        "{:?}",
        h.scopes
    );
    h.assert_targets("tenant_upstream", Duration::from_secs(4));
}

#[test]
fn concurrency_hints_follow_the_durations_releases_report() {
    // 4 slots per subject, 20 callers, each call runs 1 s: five rounds of four.
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 4\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    ));
    let h = herd(
        &d,
        20,
        |i| call("fan-out", i),
        Duration::from_secs(1),
        Instant::now(),
    );
    assert!(
        h.scopes.iter().all(|s| s == "concurrency"),
        "{:?}",
        h.scopes
    );
    h.assert_targets("concurrency", Duration::from_secs(5));
}

/// Reports a 429 with `Retry-After: retry_after` for one call to `api` by tenant `t`.
fn report_429(d: &Daemon, retry_after: &str) {
    let a = d.admit(json!({"tenant": "t", "subject": "probe", "tool": "query", "max_wait_ms": 0}));
    assert_eq!(a.status, 200, "{:?}", a.body);
    let r = d.post(
        "/v1/release",
        json!({"lease_id": a.body["lease_id"], "outcome": "upstream_rate_limited",
               "upstream_status": 429, "retry_after": retry_after}),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
}

#[test]
fn penalty_hints_promise_the_bucket_slot_after_the_penalty() {
    // The upstream asks for 2 s; then 20 callers on a 5/s, burst-5 budget: 5 when the penalty ends,
    // 15 more at 5/s. The AIMD cut is kept out of the way (factor 1) so the budget is the one
    // configured.
    let d = Arc::new(Daemon::start(&format!(
        "{OPEN}[upstreams.api]\nrate = \"5/s\"\nburst = 5\naimd_factor = 1.0\n[tools.query]\nupstream = \"api\"\n"
    )));
    // The probe took one token; it is back long before the penalty ends.
    report_429(&d, "2");
    let start = Instant::now();
    let h = herd(
        &d,
        20,
        |i| call(&format!("agent-{i}"), i),
        Duration::ZERO,
        start,
    );
    assert!(
        h.scopes.iter().all(|s| s == "upstream_penalty"),
        "{:?}",
        h.scopes
    );
    h.assert_targets("upstream_penalty", Duration::from_secs(5));
}

#[test]
fn mixed_hints_promise_the_whole_path() {
    // A penalty of 1 s ends into a nearly empty 5/s budget (burst 10, drained just before), and
    // each agent may run 2 calls at once, each running 0.3 s. After the penalty, 5 tokens are back;
    // the 20 callers then go at 5/s: the last is admitted at 1 + 15/5 = 4 s and done at 4.3 s.
    let d = Arc::new(Daemon::start(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 2\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n\
         [upstreams.api]\nrate = \"5/s\"\nburst = 10\naimd_factor = 1.0\n[tools.query]\nupstream = \"api\"\n",
    ));
    for i in 0..9 {
        let a = d.admit(call(&format!("drain-{i}"), i));
        assert_eq!(a.status, 200, "{:?}", a.body);
        d.release(a.body["lease_id"].as_str().unwrap());
    }
    report_429(&d, "1");
    let start = Instant::now();
    // Four agents, five callers each: the concurrency cap binds right after the penalty.
    let h = herd(
        &d,
        20,
        |i| call(&format!("agent-{}", i % 4), i),
        Duration::from_millis(300),
        start,
    );
    h.assert_targets("mixed", Duration::from_millis(4_300));
}

/// Milliseconds from `since` to `at`.
fn ms_between(since: Instant, at: Instant) -> u64 {
    at.duration_since(since).as_millis() as u64
}

#[test]
fn hints_past_the_promise_horizon_are_spread_and_say_the_wait_is_long() {
    // Burst 4 at 6/min: a new slot every 10 s. Thirty refusals in a row: the first are promised
    // the slots up to the horizon (60 s past the bucket's full-at instant), one each; the rest are
    // past it, must not all be told the same instant, and are told the wait is long.
    //
    // Every timing bound below is taken from instants the test measured itself, so a busy machine
    // (slow requests) cannot fail it: a hint is `slot - (now - first take) + jitter`, where the
    // daemon's `now - first take` lies between 0 and the time from before the first admission to
    // the refusal's answer, and jitter adds at most 100 ms. Which refusals are promised and which
    // are past the horizon is read from the refusals' order, never from a hint's size: hints past
    // the horizon are spread at random from the horizon on, so a threshold on their size would
    // sometimes count one of them as a promise.
    let d = Daemon::start(
        "[limits.subject]\nrate = \"6/min\"\nburst = 4\nconcurrency = 1000\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    );
    let first_take = Instant::now();
    for i in 0..4 {
        assert_eq!(d.admit(call("slow", i)).status, 200);
    }
    // (hint, ms from before the first admission to this refusal's answer, text)
    let mut refusals: Vec<(u64, u64, String)> = Vec::new();
    for i in 0..30 {
        let a = d.admit(call("slow", i));
        let answered = ms_between(first_take, Instant::now());
        let hint = honest_hint(&a);
        let text = a.body["tool_result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        refusals.push((hint, answered, text));
    }
    let hints: Vec<u64> = refusals.iter().map(|r| r.0).collect();
    let answered: Vec<u64> = refusals.iter().map(|r| r.1).collect();
    println!(
        "hints (ms): {hints:?}\nanswered at (ms after the first admission was sent): {answered:?}"
    );
    // All 34 requests fell well inside the first refill (10 s): otherwise a token is back and the
    // numbers below mean something else.
    assert!(
        answered[29] < 9_000,
        "the 34 requests took {} ms: too slow for this test's 10 s slots",
        answered[29]
    );

    // The promised refusals come first, then only refusals past the horizon, each saying the wait
    // is long (and no promised one says so).
    let long = |text: &str| text.contains("continue without this call");
    let promised = refusals.iter().take_while(|r| !long(&r.2)).count();
    for (h, _, text) in &refusals[promised..] {
        assert!(
            long(text),
            "a refusal after the first past the horizon ({h} ms) is promised again, or does not say the wait is long: {text:?}; {hints:?}"
        );
    }
    assert!(
        (6..=10).contains(&promised),
        "{promised} refusals promised a slot before the horizon, expected one per 10 s slot up to it: {hints:?}"
    );

    // Promised: one slot each, 10 s apart, in order.
    for (k, (h, at, _)) in refusals[..promised].iter().enumerate() {
        let slot = 10_000 * (k as u64 + 1);
        assert!(
            (slot.saturating_sub(at + 1)..=slot + 101).contains(h),
            "promise {k} is {h} ms, answered {at} ms after the first admission was sent: expected the slot at {slot} ms: {hints:?}"
        );
    }

    // Past the horizon: spread over the slots that follow, not one instant, and never before the
    // last promised slot (in time since the first admission: a hint counts from its own refusal).
    let beyond = &refusals[promised..];
    assert!(beyond.len() >= 20, "{hints:?}");
    let mut whole_secs: Vec<u64> = beyond.iter().map(|b| b.0.div_ceil(1000)).collect();
    whole_secs.sort_unstable();
    whole_secs.dedup();
    assert!(
        whole_secs.len() >= beyond.len() / 2,
        "hints past the horizon collapse: {hints:?}"
    );
    let comes_back: Vec<u64> = beyond.iter().map(|b| b.1 + b.0).collect();
    let (lo, hi) = (
        *comes_back.iter().min().unwrap(),
        *comes_back.iter().max().unwrap(),
    );
    assert!(
        hi - lo >= 30_000,
        "spread only over {lo}..{hi} ms after the first admission: {hints:?}"
    );
    let last_slot = 10_000 * promised as u64;
    for (b, back) in beyond.iter().zip(&comes_back) {
        assert!(
            *back >= last_slot,
            "a hint past the horizon ({} ms, back {back} ms after the first admission) comes before the last promised slot ({last_slot} ms): {hints:?}",
            b.0
        );
    }
}

#[test]
fn a_call_allowed_to_wait_does_not_take_a_slot_promised_earlier() {
    // 2/s, burst 1: the refused caller is promised the next token (0.5 s); a call allowed to wait,
    // arriving just after, must come after it, not take its token.
    let d = Daemon::start(
        "[limits.subject]\nrate = \"2/s\"\nburst = 1\nconcurrency = 1000\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    );
    assert_eq!(d.admit(call("s", 0)).status, 200);
    let refused = d.admit(call("s", 1));
    let promised = honest_hint(&refused);
    let sent = Instant::now();
    let d = Arc::new(d);
    let waiting = {
        let d = d.clone();
        std::thread::spawn(move || {
            let a = d.admit(
                json!({"tenant": "t", "subject": "s", "tool": "query", "max_wait_ms": 3000}),
            );
            (a, sent.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(promised).saturating_sub(sent.elapsed()));
    let retry = d.admit(call("s", 1));
    let (held, after) = waiting.join().unwrap();
    println!(
        "promised {promised} ms; polite retry {}; call allowed to wait: {} after {after:?}",
        retry.status, held.status
    );
    assert_eq!(
        retry.status, 200,
        "the promised slot was taken: {:?}",
        retry.body
    );
    // The waiting call is served by the daemon after the promised slot (held, then admitted).
    assert_eq!(held.status, 200, "{:?} {:?}", held.body, held.headers);
    assert!(
        after >= Duration::from_millis(promised + 400),
        "admitted after {after:?}, before the slot after the promise"
    );
}

/// Three replicas sharing one Redis.
fn fleet(config: &str) -> (common::redis::RedisServer, Arc<Vec<Arc<Daemon>>>) {
    let redis = common::redis::RedisServer::start();
    let text = format!(
        "{config}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout = \"250ms\"\n",
        redis.url()
    );
    let fleet = (0..3).map(|_| Arc::new(Daemon::start(&text))).collect();
    (redis, Arc::new(fleet))
}

/// The promises are kept where the state is: callers spread over three replicas on one Redis,
/// each coming back to another replica than the one that refused it, find their slots as on one.
#[test]
fn subject_bucket_hints_hold_across_replicas() {
    let (_redis, fleet) = fleet(
        "[limits.subject]\nrate = \"10/s\"\nburst = 20\nconcurrency = 1000\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    );
    let h = herd_over(
        &fleet,
        60,
        |i| call("fan-out", i),
        Duration::ZERO,
        Instant::now(),
    );
    assert!(h.scopes.iter().all(|s| s == "subject"), "{:?}", h.scopes);
    h.assert_targets("subject bucket, three replicas", Duration::from_secs(4));
}

#[test]
fn tenant_upstream_hints_hold_across_replicas() {
    let (_redis, fleet) = fleet(&format!(
        "{OPEN}[upstreams.api]\nrate = \"5/s\"\nburst = 10\n[tools.query]\nupstream = \"api\"\n"
    ));
    let h = herd_over(
        &fleet,
        30,
        |i| call(&format!("agent-{i}"), i),
        Duration::ZERO,
        Instant::now(),
    );
    assert!(
        h.scopes.iter().all(|s| s == "tenant_upstream"),
        "{:?}",
        h.scopes
    );
    h.assert_targets("tenant_upstream, three replicas", Duration::from_secs(4));
}

#[test]
fn concurrency_hints_hold_across_replicas() {
    let (_redis, fleet) = fleet(
        "[limits.subject]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 4\n\
         [limits.tenant]\nrate = \"1000/s\"\nburst = 1000\nconcurrency = 1000\n",
    );
    let h = herd_over(
        &fleet,
        20,
        |i| call("fan-out", i),
        Duration::from_secs(1),
        Instant::now(),
    );
    assert!(
        h.scopes.iter().all(|s| s == "concurrency"),
        "{:?}",
        h.scopes
    );
    h.assert_targets("concurrency, three replicas", Duration::from_secs(5));
}

#[test]
fn penalty_hints_promise_the_bucket_slot_after_the_penalty_across_replicas() {
    let (_redis, fleet) = fleet(&format!(
        "{OPEN}[upstreams.api]\nrate = \"5/s\"\nburst = 5\naimd_factor = 1.0\n[tools.query]\nupstream = \"api\"\n"
    ));
    report_429(&fleet[0], "2");
    let start = Instant::now();
    let h = herd_over(
        &fleet,
        20,
        |i| call(&format!("agent-{i}"), i),
        Duration::ZERO,
        start,
    );
    assert!(
        h.scopes.iter().all(|s| s == "upstream_penalty"),
        "{:?}",
        h.scopes
    );
    // 2 s of penalty, then 5 at once and 15 more at 5/s.
    h.assert_targets("upstream_penalty, three replicas", Duration::from_secs(5));
}
