//! Several admitd replicas sharing one Redis (and a three-shard Redis Cluster) enforce one budget:
//! a runaway loop spread over three replicas is admitted exactly what one process would admit, a
//! concurrency cap holds across replicas, the slots of a replica killed mid-call come back at the
//! lease TTL, each `on_error` policy behaves as written while Redis is down, and quotas and
//! penalties survive a `kill -9` of admitd.

mod common;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::redis::{RedisCluster, RedisServer};
use common::{metric, Daemon};
use serde_json::{json, Value};

fn store(urls: &str, cluster: bool, extra: &str) -> String {
    format!(
        "[store]\nkind = \"redis\"\nurl = \"{urls}\"\ncluster = {cluster}\ntimeout = \"250ms\"\n{extra}\n"
    )
}

fn replicas(n: usize, config: &str) -> Vec<Daemon> {
    (0..n).map(|_| Daemon::start(config)).collect()
}

fn call(tenant: &str, subject: &str) -> Value {
    json!({"tenant": tenant, "subject": subject, "tool": "search", "max_wait_ms": 0})
}

/// The runaway-loop scenario: two tenants at one call a second and one subject looping as fast as
/// it can for 10 s, every call sent to the next of the replicas in turn. Returns (admitted calls of
/// the loop, admitted calls of each light tenant).
fn runaway_loop(daemons: &[Daemon]) -> (u64, [u64; 2]) {
    let loop_admitted = AtomicU64::new(0);
    let light = [AtomicU64::new(0), AtomicU64::new(0)];
    let start = Instant::now();
    let run = Duration::from_secs(10);
    std::thread::scope(|s| {
        for (i, tenant) in ["initech", "globex"].iter().enumerate() {
            let light = &light[i];
            s.spawn(move || {
                for k in 0..10u32 {
                    let at = Duration::from_millis(100) + Duration::from_secs(u64::from(k));
                    if let Some(left) = at.checked_sub(start.elapsed()) {
                        std::thread::sleep(left);
                    }
                    let k = k as usize;
                    if admit_and_release(
                        &daemons[k % daemons.len()],
                        &daemons[(k + 1) % daemons.len()],
                        tenant,
                        "agent",
                    ) {
                        light.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        for w in 0..2usize {
            let loop_admitted = &loop_admitted;
            s.spawn(move || {
                let mut k = w;
                while start.elapsed() < run {
                    let (d, r) = (
                        &daemons[k % daemons.len()],
                        &daemons[(k + 1) % daemons.len()],
                    );
                    k += 1;
                    if admit_and_release(d, r, "acme", "runaway") {
                        loop_admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    (
        loop_admitted.into_inner(),
        [
            light[0].load(Ordering::Relaxed),
            light[1].load(Ordering::Relaxed),
        ],
    )
}

/// Admits a call through `d` and, when admitted, releases it through `r`.
fn admit_and_release(d: &Daemon, r: &Daemon, tenant: &str, subject: &str) -> bool {
    let a = d.admit(call(tenant, subject));
    if a.status != 200 {
        return false;
    }
    assert_eq!(r.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    true
}

const LOOP_LIMITS: &str = "[limits.subject]\nrate = \"120/min\"\nburst = 20\n";

#[test]
fn three_replicas_on_one_redis_admit_a_loop_exactly_once() {
    let redis = RedisServer::start();
    let daemons = replicas(
        3,
        &format!("{LOOP_LIMITS}{}", store(&redis.url(), false, "")),
    );
    let (looped, light) = runaway_loop(&daemons);
    println!("one Redis, three replicas: loop admitted {looped}, light tenants {light:?}");
    // Burst 20 plus 2/s for 10 s: what one process admits.
    assert!((38..=42).contains(&looped), "loop admitted {looped}");
    assert_eq!(light, [10, 10]);
}

#[test]
fn three_replicas_on_a_three_shard_cluster_admit_a_loop_exactly_once() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.seed_urls().join(",");
    let daemons = replicas(3, &format!("{LOOP_LIMITS}{}", store(&urls, true, "")));
    let ready = daemons[0].get("/readyz");
    assert_eq!(ready.body["store"]["cluster"], true, "{}", ready.body);
    let (looped, light) = runaway_loop(&daemons);
    println!(
        "three-shard cluster, three replicas: loop admitted {looped}, light tenants {light:?}"
    );
    assert!((38..=42).contains(&looped), "loop admitted {looped}");
    assert_eq!(light, [10, 10]);
}

#[test]
fn a_concurrency_cap_holds_across_replicas_and_a_dead_replicas_slots_return_at_the_ttl() {
    let redis = RedisServer::start();
    let config = format!(
        "[server]\nlease_ttl = \"2s\"\n[limits.subject]\nrate = \"100000/s\"\nburst = 100000\nconcurrency = 4\n{}",
        store(&redis.url(), false, "")
    );
    let daemons = replicas(3, &config);
    let live = AtomicI64::new(0);
    let most = AtomicI64::new(0);
    let admitted = AtomicU64::new(0);
    std::thread::scope(|s| {
        for c in 0..200usize {
            let (live, most, admitted, daemons) = (&live, &most, &admitted, &daemons);
            s.spawn(move || {
                for k in 0..3usize {
                    let d = &daemons[(c + k) % 3];
                    let a = d.admit(call("acme", "fanout"));
                    if a.status != 200 {
                        continue;
                    }
                    let now = live.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    admitted.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                    live.fetch_sub(1, Ordering::SeqCst);
                    let lease = a.body["lease_id"].as_str().unwrap().to_string();
                    // Released through another replica than the one that admitted it.
                    assert_eq!(daemons[(c + k + 1) % 3].release(&lease).status, 200);
                }
            });
        }
    });
    let most = most.into_inner();
    println!(
        "200 callers over three replicas: {} admitted, at most {most} in flight",
        admitted.into_inner()
    );
    assert!(most <= 4, "{most} leases were live at once");
    assert!(most >= 2, "the callers did overlap");

    // A replica dies holding all four slots: the others refuse until the lease TTL frees them.
    let mut daemons = daemons;
    let mut doomed = daemons.remove(0);
    for _ in 0..4 {
        assert_eq!(doomed.admit(call("acme", "fanout")).status, 200);
    }
    let _ = doomed.child.kill();
    let _ = doomed.child.wait();
    let killed = Instant::now();
    let refused = daemons[0].admit(call("acme", "fanout"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "concurrency");
    assert!(common::eventually(Duration::from_secs(5), || {
        daemons[1].admit(call("acme", "fanout")).status == 200
    }));
    let back = killed.elapsed();
    assert!(
        back >= Duration::from_millis(1500) && back <= Duration::from_millis(3500),
        "slots came back {back:?} after the kill (lease TTL 2 s)"
    );
}

fn inflight(d: &Daemon, tenant: &str) -> u64 {
    let a = d.get(&format!("/v1/tenants/{tenant}"));
    match a.status {
        404 => 0,
        _ => a.body["inflight"].as_u64().unwrap_or(u64::MAX),
    }
}

#[test]
fn fail_closed_refuses_with_a_retry_hint_while_redis_is_down_and_resumes() {
    let mut redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 3\n{}",
        store(&redis.url(), false, "on_error = \"fail_closed\"")
    ));
    let held = d.admit(call("acme", "bot"));
    assert_eq!(held.status, 200);
    redis.stop();
    for _ in 0..5 {
        let started = Instant::now();
        let a = d.admit(call("acme", "bot"));
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "no long wait on the store"
        );
        assert_eq!(a.status, 503, "{}", a.body);
        assert_eq!(a.body["error"], "store_unavailable");
        assert!(a.body["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(a.header("retry-after").as_deref(), Some("1"));
        assert_eq!(a.body["tool_result"]["isError"], true);
        let text = a.body["tool_result"]["content"][0]["text"]
            .as_str()
            .unwrap();
        assert!(text.contains("Wait 1 second"), "{text}");
    }
    let ready = d.get("/readyz");
    assert_eq!(ready.status, 503);
    assert_eq!(
        ready.body["store"]["state"], "unreachable",
        "{}",
        ready.body
    );
    assert_eq!(ready.body["store"]["mode"], "fail_closed");
    let m = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        metric(&m, "admitd_store_mode{mode=\"fail_closed\"}"),
        Some(1.0),
        "{m}"
    );
    assert!(
        metric(
            &m,
            "admitd_store_fallback_decisions_total{mode=\"fail_closed\"}"
        )
        .unwrap_or(0.0)
            >= 5.0
    );
    assert!(metric(&m, "admitd_store_errors_total{kind=\"connection\"}").unwrap_or(0.0) >= 1.0);

    redis.restart();
    assert!(common::eventually(Duration::from_secs(5), || d
        .get("/readyz")
        .status
        == 200));
    // Redis restarted empty (no persistence): shared enforcement resumes from its state.
    let a = d.admit(call("acme", "bot"));
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(d.release(a.body["lease_id"].as_str().unwrap()).status, 200);
    let m = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(metric(&m, "admitd_store_mode{mode=\"shared\"}"), Some(1.0));
    assert_eq!(inflight(&d, "acme"), 0);
    assert!(!d.log_lines().iter().any(|l| l.contains("panicked")));
}

#[test]
fn fail_open_admits_while_redis_is_down_and_shared_limits_return_with_it() {
    let redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 2\n{}",
        store(&redis.url(), false, "on_error = \"fail_open\"")
    ));
    for _ in 0..2 {
        assert_eq!(d.admit(call("acme", "bot")).status, 200);
    }
    assert_eq!(d.admit(call("acme", "bot")).status, 429);
    redis.pause();
    let mut leases = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let a = d.admit(call("acme", "bot"));
        // The store does not answer at all: the call waits no longer than the timeout (250 ms).
        assert!(
            started.elapsed() < Duration::from_millis(900),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(a.status, 200, "{}", a.body);
        leases.push(a.body["lease_id"].as_str().unwrap().to_string());
    }
    for l in &leases {
        assert_eq!(d.release(l).status, 200, "an unchecked lease releases");
    }
    let m = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        metric(
            &m,
            "admitd_store_fallback_decisions_total{mode=\"fail_open\"}"
        )
        .unwrap_or(0.0)
            >= 5.0,
        "{m}"
    );
    assert!(
        metric(&m, "admitd_store_errors_total{kind=\"timeout\"}").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
    redis.resume();
    assert!(common::eventually(Duration::from_secs(5), || d
        .get("/readyz")
        .status
        == 200));
    // The subject's spent burst was kept in Redis all along.
    let a = d.admit(call("acme", "bot"));
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["scope"], "subject");
}

#[test]
fn local_fallback_enforces_a_share_of_each_limit_and_returns_to_shared_state() {
    let mut redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 10\nconcurrency = 100\n{}",
        store(
            &redis.url(),
            false,
            "on_error = \"local_fallback\"\nreplicas = 2"
        )
    ));
    for _ in 0..3 {
        assert_eq!(d.admit(call("acme", "bot")).status, 200);
    }
    redis.stop();
    // Alone, this replica enforces half of the burst.
    let admitted = (0..8)
        .filter(|_| d.admit(call("acme", "bot")).status == 200)
        .count();
    assert_eq!(admitted, 5, "burst 10 / 2 replicas");
    let m = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        metric(&m, "admitd_store_mode{mode=\"local_fallback\"}"),
        Some(1.0)
    );
    assert_eq!(d.get("/readyz").status, 503);
    redis.restart();
    assert!(common::eventually(Duration::from_secs(5), || d
        .get("/readyz")
        .status
        == 200));
    // Back on the shared state (a fresh Redis, as it restarted without persistence).
    let admitted = (0..12)
        .filter(|_| d.admit(call("acme", "bot")).status == 200)
        .count();
    assert_eq!(admitted, 10);
}

#[test]
fn quotas_penalties_and_leases_survive_a_kill_9_of_admitd() {
    let redis = RedisServer::start();
    let config = format!(
        "[limits.subject]\ndaily_quota = 4\nconcurrency = 2\n[tools.crm_read]\nupstream = \"crm\"\n[upstreams.crm]\nrate = \"10/s\"\nburst = 10\n{}",
        store(&redis.url(), false, "")
    );
    let mut first = Daemon::start(&config);
    for _ in 0..2 {
        assert_eq!(
            first.admit(call("acme", "bot")).status,
            200,
            "two leases left in flight"
        );
    }
    assert_eq!(first.admit(call("acme", "spender")).status, 200);
    let f = first.post(
        "/v1/feedback",
        json!({"tenant": "acme", "upstream": "crm", "status": 429, "retry_after": "60"}),
    );
    assert_eq!(f.status, 202);
    let _ = first.child.kill();
    let _ = first.child.wait();

    let second = Daemon::start(&config);
    // The penalty is still there.
    let a = second.admit(
        json!({"tenant": "acme", "subject": "spender", "tool": "crm_read", "max_wait_ms": 0}),
    );
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["scope"], "upstream_penalty");
    assert!(a.body["retry_after_ms"].as_u64().unwrap() > 50_000);
    // The in-flight leases still hold their slots.
    let a = second.admit(call("acme", "bot"));
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["scope"], "concurrency");
    // The daily quota: bot spent 2 of 4 and spender 1 (the penalty refusal spent nothing).
    for _ in 0..3 {
        let a = second.admit(call("acme", "spender"));
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(
            second.release(a.body["lease_id"].as_str().unwrap()).status,
            200
        );
    }
    let over = second.admit(call("acme", "spender"));
    assert_eq!(over.body["scope"], "daily_quota", "{}", over.body);
    let snap = second.get("/v1/tenants/acme");
    assert_eq!(snap.status, 200);
    // bot's two leases and spender's first, all from before the kill.
    assert_eq!(snap.body["inflight"], 3, "{}", snap.body);
    assert!(snap.body["penalties"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["upstream"] == "crm"));
}

#[test]
fn a_replica_shows_the_state_another_replica_spent() {
    let redis = RedisServer::start();
    let config = format!("{LOOP_LIMITS}{}", store(&redis.url(), false, ""));
    let daemons = replicas(2, &config);
    for _ in 0..5 {
        assert_eq!(daemons[0].admit(call("acme", "bot")).status, 200);
    }
    let snap = daemons[1].get("/v1/tenants/acme");
    assert_eq!(snap.status, 200, "{}", snap.body);
    let bot = snap.body["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["layer"] == "subject" && b["key"] == "bot")
        .cloned()
        .unwrap_or_else(|| panic!("{}", snap.body));
    assert_eq!(bot["tokens"], 15, "{bot}");
}

/// Makes a test CA and a certificate for 127.0.0.1 signed by it, in `dir`: (ca.pem, cert, key).
fn tls_files(dir: &std::path::Path) -> (String, String, String) {
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl (installed with the system's TLS library) is needed for the TLS test");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(p("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &p("ca.key"),
        "-out",
        &p("ca.pem"),
        "-days",
        "2",
        "-subj",
        "/CN=admitd test CA",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &p("srv.key"),
        "-out",
        &p("srv.csr"),
        "-subj",
        "/CN=127.0.0.1",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p("srv.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca.key"),
        "-CAcreateserial",
        "-out",
        &p("srv.pem"),
        "-days",
        "2",
        "-extfile",
        &p("ext.cnf"),
    ]);
    (p("ca.pem"), p("srv.pem"), p("srv.key"))
}

#[test]
fn rediss_verifies_the_server_and_a_password_in_the_url_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_files(dir.path());
    let tls_port = common::redis::free_port();
    let port = tls_port.to_string();
    let redis = RedisServer::start_with(&[
        "--tls-port",
        &port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "s3cret",
    ]);
    let url = format!("rediss://:s3cret@127.0.0.1:{tls_port}");
    let config = format!(
        "[limits.subject]\nburst = 2\nrate = \"1/h\"\n{}",
        store(&url, false, "")
    );
    // Trusting the test CA: the store is used over TLS.
    let d = Daemon::start_with_env(&config, &[("SSL_CERT_FILE", &ca)]);
    let ready = d.get("/readyz");
    assert_eq!(ready.status, 200, "{}", ready.body);
    for _ in 0..2 {
        assert_eq!(d.admit(call("acme", "bot")).status, 200);
    }
    assert_eq!(d.admit(call("acme", "bot")).status, 429);
    let keys = redis.cli(&["--scan", "--pattern", "admitd:*"]);
    assert!(keys.contains("admitd:{t:acme}:h"), "{keys}");
    // Not trusting it: the store is refused, and /readyz says why.
    let untrusted = Daemon::start_with_env(&config, &[("SSL_CERT_FILE", &cert)]);
    let ready = untrusted.get("/readyz");
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        ready.body["store"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("certificate"),
        "{}",
        ready.body
    );
    // A wrong password is refused too.
    let wrong = format!(
        "[limits.subject]\nburst = 2\n{}",
        store(&format!("rediss://:nope@127.0.0.1:{tls_port}"), false, "")
    );
    let d = Daemon::start_with_env(&wrong, &[("SSL_CERT_FILE", &ca)]);
    assert_eq!(d.get("/readyz").status, 503);
}

#[test]
fn a_user_password_and_database_in_a_redis_url_are_used_by_every_connection() {
    // Decisions go on each worker's own connection, which admitd opens itself for redis:// (not
    // through the client library): it must log in and select the database as the library does.
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    redis.cli(&["ACL", "SETUSER", "fleet", "on", ">f1eet", "~*", "+@all"]);
    let url = format!("redis://fleet:f1eet@127.0.0.1:{}/3", redis.port());
    let d = Daemon::start(&format!(
        "[limits.subject]\nburst = 2\nrate = \"1/h\"\n{}",
        store(&url, false, "")
    ));
    assert_eq!(d.get("/readyz").status, 200);
    for _ in 0..2 {
        assert_eq!(d.admit(call("acme", "bot")).status, 200);
    }
    let refused = d.admit(call("acme", "bot"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    // Every key in database 3, none in 0.
    let in_3 = redis.cli(&["-n", "3", "--scan", "--pattern", "admitd:*"]);
    assert!(in_3.contains("admitd:{t:acme}:h"), "{in_3}");
    assert_eq!(
        redis.cli(&["-n", "0", "--scan", "--pattern", "admitd:*"]),
        ""
    );
    // The user's decisions ran as that user.
    let clients = redis.cli(&["CLIENT", "LIST"]);
    assert!(clients.contains("user=fleet"), "{clients}");
}

#[test]
fn worker_connections_refused_at_login_are_503s_and_admitd_recovers_when_login_works_again() {
    // The store's own connections log in while the password is right; then it changes, and each
    // worker's connection (opened by admitd itself for redis://) is refused at login.
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let url = format!("redis://:s3cret@127.0.0.1:{}", redis.port());
    let d = Daemon::start(&format!(
        "[limits.subject]\nburst = 50\n{}",
        store(&url, false, "")
    ));
    assert_eq!(d.get("/readyz").status, 200);
    redis.cli(&["CONFIG", "SET", "requirepass", "changed"]);
    redis.cli_as("changed", &["CLIENT", "KILL", "TYPE", "normal"]);
    for _ in 0..3 {
        let a = d.admit(call("acme", "bot"));
        assert_eq!(a.status, 503, "{}", a.body);
        assert_eq!(a.body["error"], "store_unavailable", "{}", a.body);
    }
    redis.cli_as("changed", &["CONFIG", "SET", "requirepass", "s3cret"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let a = d.admit(call("acme", "bot"));
        if a.status == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not back: {}", a.body);
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[test]
fn a_flushed_script_is_loaded_again() {
    let redis = RedisServer::start();
    let d = Daemon::start(&format!("{LOOP_LIMITS}{}", store(&redis.url(), false, "")));
    assert_eq!(d.admit(call("acme", "bot")).status, 200);
    let before = redis.cli(&["INFO", "commandstats"]);
    assert!(
        before.contains("cmdstat_evalsha"),
        "called by its SHA: {before}"
    );
    redis.cli(&["SCRIPT", "FLUSH"]);
    // The next call meets NOSCRIPT, loads the script and is decided all the same.
    let a = d.admit(call("acme", "bot"));
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["remaining"], 18);
    assert_eq!(d.get("/readyz").status, 200);
}

#[test]
fn in_a_cluster_a_refusal_by_cross_tenant_state_gives_back_the_tenants_part() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.seed_urls().join(",");
    // Without slices: with them, a token of the bucket may be on its way to this replica's slice
    // while the third call is decided on the bucket's shard, which then refuses it (see
    // tests/slices.rs for slices); here every call takes the two-part way this test is about.
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = 10\n[limits.global]\nrate = \"1/h\"\nburst = 3\n{}",
        store(&urls, true, "slice = \"0s\"")
    ));
    for _ in 0..3 {
        assert_eq!(d.admit(call("acme", "bot")).status, 200);
    }
    let refused = d.admit(call("acme", "bot"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "global");
    // The subject's bucket (on the tenant's shard) holds the token the refused call took there.
    let snap = d.get("/v1/tenants/acme");
    let bot = snap.body["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["layer"] == "subject" && b["key"] == "bot")
        .cloned()
        .unwrap_or_else(|| panic!("{}", snap.body));
    assert_eq!(bot["tokens"], 7, "{bot}");
    assert_eq!(
        snap.body["inflight"], 3,
        "the refused call holds no lease: {}",
        snap.body
    );
}

#[test]
fn in_a_cluster_a_refusal_by_the_global_bucket_gives_back_a_shared_upstreams_part() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.seed_urls().join(",");
    // Without slices: the call is decided on the tenant's shard, then on the upstream's, then on
    // the global bucket's (three shards, three tags).
    let d = Daemon::start(&format!(
        "[limits.global]\nrate = \"1/h\"\nburst = 3\n\
         [upstreams.api]\nrate = \"1/h\"\nburst = 10\nshared = true\n[tools.ask]\nupstream = \"api\"\n{}",
        store(&urls, true, "slice = \"0s\"")
    ));
    let ask = || json!({"tenant": "acme", "subject": "bot", "tool": "ask", "max_wait_ms": 0});
    for _ in 0..3 {
        assert_eq!(d.admit(ask()).status, 200);
    }
    // The upstream's bucket, on its own shard.
    let key = "admitd:{u:api}:b";
    let node = cluster
        .nodes()
        .iter()
        .find(|n| n.cli(&["EXISTS", key]).trim() == "1")
        .expect("a node holds the upstream's bucket");
    let tat = || node.cli(&["HGET", key, "tat"]);
    let before = tat();
    let refused = d.admit(ask());
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "global", "{}", refused.body);
    // The upstream's part took its token, and gave it back when the global bucket refused.
    assert_eq!(tat(), before, "the upstream's bucket is as it was");
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(snap.body["inflight"], 3, "{}", snap.body);
}

#[test]
fn in_a_cluster_a_shared_upstreams_429_is_kept_on_its_own_shard() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.seed_urls().join(",");
    let d = Daemon::start(&format!(
        "[upstreams.api]\nrate = \"10/s\"\nburst = 10\nshared = true\n[tools.ask]\nupstream = \"api\"\n{}",
        store(&urls, true, "")
    ));
    let ask = |t: &str| json!({"tenant": t, "subject": "bot", "tool": "ask", "max_wait_ms": 0});
    let a = d.admit(ask("acme"));
    assert_eq!(a.status, 200, "{}", a.body);
    let r = d.post(
        "/v1/release",
        json!({"lease_id": a.body["lease_id"], "outcome": "upstream_rate_limited", "retry_after": "3"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // The penalty, the cut and the probe schedule written after it live under the upstream's tag.
    let node = cluster
        .nodes()
        .iter()
        .find(|n| n.cli(&["EXISTS", "admitd:{u:api}:pen"]).trim() == "1")
        .expect("a node holds the upstream's penalty");
    let m: f64 = node
        .cli(&["HGET", "admitd:{u:api}:up", "m"])
        .parse()
        .unwrap();
    assert_eq!(m, 0.5);
    assert!(
        !node.cli(&["HGET", "admitd:{u:api}:up", "v"]).is_empty(),
        "the probe schedule was written"
    );
    // Every tenant is refused, and each tenant's snapshot reads them from that shard.
    for tenant in ["acme", "globex"] {
        let refused = d.admit(ask(tenant));
        assert_eq!(refused.status, 429, "{}", refused.body);
        assert_eq!(
            refused.body["scope"], "upstream_penalty",
            "{}",
            refused.body
        );
        let snap = d.get(&format!("/v1/tenants/{tenant}"));
        let api = snap.body["upstreams"]
            .as_array()
            .and_then(|u| u.iter().find(|u| u["upstream"] == "api"))
            .cloned()
            .unwrap_or_else(|| panic!("{}", snap.body));
        assert_eq!(api["multiplier"], 0.5, "{api}");
        assert!(
            snap.body["penalties"]
                .as_array()
                .is_some_and(|p| p.iter().any(|p| p["upstream"] == "api")),
            "{}",
            snap.body
        );
    }
}

#[test]
fn redis_stopped_under_load_and_started_again_leaves_nothing_stuck() {
    let mut redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nconcurrency = 4\n{}",
        store(&redis.url(), false, "on_error = \"fail_closed\"")
    ));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let answers = std::sync::Mutex::new(std::collections::BTreeMap::<u16, u64>::new());
    std::thread::scope(|s| {
        for w in 0..4 {
            let (d, stop, answers) = (&d, &stop, &answers);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let a = d.admit(call("acme", &format!("agent-{w}")));
                    *answers.lock().unwrap().entry(a.status).or_default() += 1;
                    if a.status == 200 {
                        std::thread::sleep(Duration::from_millis(5));
                        // A release may meet the outage too: then the lease runs out at its TTL.
                        let _ = d.release(a.body["lease_id"].as_str().unwrap());
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        redis.stop();
        std::thread::sleep(Duration::from_millis(700));
        redis.restart();
        assert!(common::eventually(Duration::from_secs(5), || d
            .get("/readyz")
            .status
            == 200));
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
    });
    let answers = answers.into_inner().unwrap();
    println!("answers by status while Redis stopped and started: {answers:?}");
    assert!(answers.get(&200).copied().unwrap_or(0) > 10, "{answers:?}");
    assert!(answers.get(&503).copied().unwrap_or(0) > 0, "{answers:?}");
    assert!(
        answers.keys().all(|s| [200, 429, 503].contains(s)),
        "{answers:?}"
    );
    // Everything admitted after the restart was released: nothing is in flight.
    assert_eq!(inflight(&d, "acme"), 0);
    assert!(!d.log_lines().iter().any(|l| l.contains("panicked")));
}

/// `cmdstat_evalsha`'s call count: the script calls Redis has run.
fn script_calls(redis: &RedisServer) -> u64 {
    let stats = redis.cli(&["INFO", "commandstats"]);
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A Redis that `DEBUG SLEEP` can put to sleep, and a replica on it (a subject's `burst` at 1/h,
/// concurrency caps of 100, the store's `timeout`) that has admitted one call of acme/bot.
fn one_admitted_on_a_redis_that_can_sleep(burst: u32, timeout: &str) -> (RedisServer, Daemon) {
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let d = Daemon::start(&format!(
        "[limits.subject]\nrate = \"1/h\"\nburst = {burst}\nconcurrency = 100\n[limits.tenant]\nconcurrency = 100\n{}pool_size = 2\n",
        store(&redis.url(), false, "").replace("timeout = \"250ms\"", &format!("timeout = \"{timeout}\""))
    ));
    assert_eq!(d.admit(call("acme", "bot")).status, 200);
    (redis, d)
}

#[test]
fn calls_queued_while_redis_is_busy_share_script_calls_and_each_is_decided_once() {
    let (redis, d) = one_admitted_on_a_redis_that_can_sleep(40, "3s");
    let before = script_calls(&redis);
    let callers = 48;
    let answers = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        // Redis is busy for 400 ms: every call made meanwhile waits in the replica's queue.
        s.spawn(|| redis.cli(&["DEBUG", "SLEEP", "0.4"]));
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..callers {
            let (d, answers) = (&d, &answers);
            s.spawn(move || {
                let a = d.admit(call("acme", "bot"));
                answers.lock().unwrap().push(a);
            });
        }
    });
    let answers = answers.into_inner().unwrap();
    let admitted: Vec<&str> = answers
        .iter()
        .filter(|a| a.status == 200)
        .map(|a| a.body["lease_id"].as_str().unwrap())
        .collect();
    let refused = answers.iter().filter(|a| a.status == 429).count();
    assert_eq!(
        (admitted.len(), refused),
        (39, callers - 39),
        "the burst left after the first call, exactly: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let made = script_calls(&redis) - before;
    assert!(
        made <= callers as u64 / 2,
        "{callers} decisions queued together took {made} script calls"
    );
    for lease in &admitted {
        assert_eq!(d.release(lease).status, 200);
    }
    let snap = d.get("/v1/tenants/acme");
    assert_eq!(
        snap.body["inflight"], 1,
        "only the first call's lease: {}",
        snap.body
    );
    // Released twice: unknown the second time, in a batch as alone.
    assert_eq!(d.release(admitted[0]).status, 404);
}

#[test]
fn a_failing_operation_in_a_batch_answers_an_error_for_itself_only() {
    let redis = RedisServer::start();
    let script = common::script::text();
    let upstream = json!({
        "u": {"n": "crm", "p": "t:{t:a}:pen:crm", "s": "t:{t:a}:up:crm", "aw": 0, "forget": 1e6, "x": false},
        "limited": true, "retry_after": 2e6, "default_penalty": 1e6
    })
    .to_string();
    let out = redis.cli(&[
        "EVAL", script, "1", "t:{t:a}", "batch", "nope", "{}", "", "decide", "{}", "", "upstream",
        &upstream, "",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "three answers of two parts each: {out}");
    assert_eq!(lines[0], "error", "{out}");
    assert!(lines[1].contains("unknown operation nope"), "{out}");
    assert_eq!(lines[2], "error", "a spec the script cannot read: {out}");
    assert_eq!(
        (lines[4], lines[5]),
        ("ok", "2000000"),
        "the operation after them still runs: {out}"
    );
    let until: f64 = redis
        .cli(&["HGET", "t:{t:a}:pen:crm", "until"])
        .parse()
        .unwrap();
    assert!(until > 0.0, "the penalty is stored");
}

/// Every key admitd writes has an expiry that covers what it holds: the tenant's lease set and hash
/// live until the last lease ends and the buckets are full again, and nothing lives forever,
/// whether the key is new, its last lease released and a new one admitted, or refused into.
#[test]
fn every_key_expires_and_outlives_what_it_holds() {
    let redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[server]\nlease_ttl = \"40s\"\n[limits.subject]\nrate = \"1/h\"\nburst = 3\nconcurrency = 2\ndaily_quota = 100\n[limits.tenant]\nconcurrency = 10\n{}",
        store(&redis.url(), false, "")
    ));
    let pttl = |key: &str| -> i64 { redis.cli(&["PTTL", key]).parse().unwrap() };
    let leases = "admitd:{t:acme}:ls";
    let hash = "admitd:{t:acme}:h";
    // New keys.
    let first = d.admit(call("acme", "bot"));
    assert_eq!(first.status, 200, "{}", first.body);
    let left = pttl(leases);
    assert!(
        left >= 40_000,
        "the lease set outlives its lease's 40 s: {left} ms"
    );
    let left = pttl(hash);
    assert!(
        left >= 3_600_000 - 5_000,
        "the hash lives until the subject's bucket is full again (1 h): {left} ms"
    );
    // The last lease released, the set stays (its sentinel) with its expiry, and a new lease
    // is covered by it.
    assert_eq!(
        d.release(first.body["lease_id"].as_str().unwrap()).status,
        200
    );
    assert_eq!(redis.cli(&["ZCARD", leases]), "1", "only the sentinel");
    assert_eq!(redis.cli(&["HGET", hash, "s:bot|n"]), "0");
    let second = d.admit(call("acme", "bot"));
    assert_eq!(second.status, 200, "{}", second.body);
    let left = pttl(leases);
    assert!(left >= 40_000, "{left} ms");
    // Refused: at the concurrency cap, then past the burst (a promise is written into the bucket).
    assert_eq!(d.admit(call("acme", "bot")).status, 200);
    assert_eq!(d.admit(call("acme", "bot")).status, 429);
    for member in redis.cli(&["ZRANGE", leases, "0", "-1"]).lines() {
        if member == "~" {
            continue;
        }
        let id = u64::from_str_radix(&member[..16], 16).unwrap();
        let lease = admitd::api::lease::encode("acme", id);
        assert_eq!(d.release(&lease).status, 200);
    }
    assert_eq!(redis.cli(&["HGET", hash, "t|n"]), "0");
    let refused = d.admit(call("acme", "bot"));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.body["scope"], "subject", "{}", refused.body);
    // An upstream's 429 writes a penalty and its state.
    assert_eq!(
        d.post(
            "/v1/feedback",
            json!({"tenant": "acme", "upstream": "crm", "status": 429, "retry_after": "5"})
        )
        .status,
        202
    );
    let keys = redis.cli(&["--scan", "--pattern", "admitd:*"]);
    assert!(keys.lines().count() >= 4, "{keys}");
    for key in keys.lines() {
        let left = pttl(key);
        assert!(left > 0, "{key} has no expiry: PTTL {left}");
    }
}

/// A lease never released leaves its slot at its end, and a sweep takes it out of the tenant's
/// hash and lease set: what a replica that died with leases held leaves behind does not stay.
#[test]
fn an_ended_lease_is_swept_from_the_hash_and_the_set() {
    let redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[server]\nlease_ttl = \"1s\"\n[limits.subject]\nconcurrency = 1\n{}",
        store(&redis.url(), false, "")
    ));
    let hash = "admitd:{t:acme}:h";
    let first = d.admit(call("acme", "bot"));
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(
        d.admit(call("acme", "bot")).status,
        429,
        "the one slot is held"
    );
    let lease_fields = || {
        redis
            .cli(&["HKEYS", hash])
            .lines()
            .filter(|f| f.starts_with("l:"))
            .count()
    };
    assert_eq!(lease_fields(), 1);
    std::thread::sleep(Duration::from_millis(1_300));
    // Its end passed: the slot is free again, and the one who finds it full sweeps it.
    let second = d.admit(call("acme", "bot"));
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(lease_fields(), 1, "only the second lease");
    assert_eq!(redis.cli(&["ZCARD", "admitd:{t:acme}:ls"]), "2");
    assert_eq!(redis.cli(&["HGET", hash, "s:bot|n"]), "1");
    // The ended lease is unknown to a release.
    assert_eq!(
        d.release(first.body["lease_id"].as_str().unwrap()).status,
        404
    );
}

/// A lease written by an earlier version, which kept what its release needs as JSON rather than
/// MessagePack, is still released: its slot and its count are freed.
#[test]
fn a_lease_kept_as_json_by_an_earlier_version_is_released() {
    let redis = RedisServer::start();
    let d = Daemon::start(&format!(
        "[limits.subject]\nconcurrency = 1\n{}",
        store(&redis.url(), false, "")
    ));
    let hash = "admitd:{t:acme}:h";
    let first = d.admit(call("acme", "bot"));
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(redis.cli(&["HGET", hash, "s:bot|n"]), "1");
    let field = redis
        .cli(&["HKEYS", hash])
        .lines()
        .find(|f| f.starts_with("l:"))
        .expect("the lease's field")
        .to_string();
    let member = redis
        .cli(&["ZRANGE", "admitd:{t:acme}:ls", "0", "-1"])
        .lines()
        .find(|m| *m != "~")
        .expect("the lease's member")
        .to_string();
    // The earlier layout: `day|hold_until|started|ends|tokens|flags|` and the JSON.
    let value = redis.cli(&["HGET", hash, &field]);
    let head: Vec<&str> = value.splitn(7, '|').take(4).collect();
    let data = json!({"subject": "bot", "tool": "search", "cost": 1, "keys": [], "quotas": [],
                      "m": member, "up": []});
    let old = format!("{}|[]||{data}", head.join("|"));
    assert_eq!(redis.cli(&["HSET", hash, &field, &old]), "0");
    assert_eq!(
        d.release(first.body["lease_id"].as_str().unwrap()).status,
        200
    );
    assert_eq!(redis.cli(&["HGET", hash, "s:bot|n"]), "0");
    assert_eq!(d.admit(call("acme", "bot")).status, 200);
}

/// Calls whose callers stopped waiting (their timeout passed while Redis was busy) are not decided
/// afterwards: no lease and no token are left behind for callers that were told to retry.
#[test]
fn calls_given_up_by_their_callers_are_not_decided_later() {
    let (redis, d) = one_admitted_on_a_redis_that_can_sleep(100, "100ms");
    let statuses = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| redis.cli(&["DEBUG", "SLEEP", "0.6"]));
        std::thread::sleep(Duration::from_millis(30));
        // Two calls take the two script calls the tenant's worker may have in flight: they reach
        // Redis (asleep) and run when it wakes. The next ones wait in the worker's queue.
        for wave in [1, 1, 14] {
            for _ in 0..wave {
                let (d, statuses) = (&d, &statuses);
                s.spawn(move || {
                    let a = d.admit(call("acme", "bot"));
                    statuses.lock().unwrap().push(a.status);
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let statuses = statuses.into_inner().unwrap();
    assert!(
        statuses.iter().all(|&s| s == 503),
        "every caller gave up after 100 ms: {statuses:?}"
    );
    // Redis woke up long after: the first admission's lease, and the two calls it already held.
    // The tenant's lease set holds its leases and a sentinel.
    let leases = redis
        .cli(&["ZCARD", "admitd:{t:acme}:ls"])
        .parse::<usize>()
        .unwrap()
        - 1;
    assert!(
        leases <= 3,
        "{leases} leases for 1 admitted call and 16 refused ones"
    );
}
