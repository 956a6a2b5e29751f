//! Slices of the global bucket and of `shared = true` upstreams' buckets on a three-shard Redis
//! Cluster (`[store] slice`): each replica leases a few tokens ahead and spends them itself, so a
//! decision makes one script call (on its tenant's shard) instead of one more per bucket's shard.
//! The fleet still never admits more than the bucket holds: three replicas, exact counts; a replica
//! killed holding a slice strands at most its slices, one that stops gives them back; the shard of
//! the bucket restarted (its state lost) does not let the slices taken before it be spent again. A
//! shared upstream's slice stops with a 429: at once on the replica that saw it, within a shared
//! slice's life on the others.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::redis::RedisCluster;
use common::Daemon;
use serde_json::json;

/// The global bucket: 300 tokens, refilling one an hour (nothing refills during a test).
const BURST: u64 = 300;
/// The most one replica can strand: two slices of a sixteenth of the burst each (rounded down).
const STRANDED_PER_REPLICA: u64 = 2 * (BURST / 16);

fn config(urls: &str) -> String {
    format!(
        "[limits.subject]\nrate = \"100000/s\"\nburst = 100000\n\
         [limits.tenant]\nrate = \"100000/s\"\nburst = 100000\n\
         [limits.global]\nrate = \"1/h\"\nburst = {BURST}\n\
         [store]\nkind = \"redis\"\nurl = \"{urls}\"\ncluster = true\ntimeout = \"500ms\"\nslice = \"100ms\"\n"
    )
}

/// `calls` admissions spread over `daemons` by 12 threads, over 30 tenants (so that they spread over
/// the shards); returns how many were admitted. A 503 (the store not answering) is retried.
fn hammer(daemons: &[&Daemon], calls: u64) -> u64 {
    hammer_tool(daemons, calls, "search")
}

/// [`hammer`] with calls of `tool`.
fn hammer_tool(daemons: &[&Daemon], calls: u64, tool: &str) -> u64 {
    let admitted = AtomicU64::new(0);
    let next = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..12 {
            let (admitted, next) = (&admitted, &next);
            s.spawn(move || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= calls {
                    return;
                }
                let d = daemons[k as usize % daemons.len()];
                let body = json!({"tenant": format!("t{}", k % 30), "subject": "s",
                    "tool": tool, "max_wait_ms": 0});
                let a = d.admit(body);
                match a.status {
                    200 => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        d.release(a.body["lease_id"].as_str().unwrap());
                    }
                    429 => {}
                    503 => {
                        next.fetch_sub(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    other => panic!("unexpected {other}: {}", a.body),
                }
            });
        }
    });
    admitted.into_inner()
}

/// Stops `daemons` (SIGTERM: each gives back what its slices hold) and admits what the bucket has
/// left through a fresh replica that takes no slices; returns how many it admitted.
fn finish(cluster: &RedisCluster, daemons: Vec<Daemon>) -> u64 {
    finish_with(daemons, &config(&cluster.url()), "search")
}

/// [`finish`] for the replicas of `cfg`, calling `tool`.
fn finish_with(daemons: Vec<Daemon>, cfg: &str, tool: &str) -> u64 {
    for mut d in daemons {
        d.signal("TERM");
        let _ = d.child.wait();
    }
    let fresh = Daemon::start(&cfg.replace("slice = \"100ms\"", "slice = \"0s\""));
    hammer_tool(&[&fresh], 2 * BURST, tool)
}

/// Script calls each node has run so far.
fn script_calls(cluster: &RedisCluster) -> Vec<u64> {
    cluster
        .nodes()
        .iter()
        .map(|n| {
            let stats = n.cli(&["INFO", "commandstats"]);
            stats
                .lines()
                .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
                .filter_map(|l| {
                    l.split(['=', ','])
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                })
                .sum()
        })
        .collect()
}

/// The index of the node that holds the global bucket.
fn bucket_node(cluster: &RedisCluster) -> usize {
    cluster
        .nodes()
        .iter()
        .position(|n| !n.cli(&["KEYS", "*{x}*"]).trim().is_empty())
        .expect("a node holds the global bucket")
}

#[test]
fn three_replicas_spending_slices_never_admit_more_than_the_global_bucket() {
    let cluster = RedisCluster::start(3);
    let cfg = config(&cluster.url());
    let daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
    let all: Vec<&Daemon> = daemons.iter().collect();
    // Well within the bucket, every call is admitted: a slice that has not come back yet sends the
    // call to the bucket's shard, never refuses it.
    assert_eq!(hammer(&all, 50), 50);
    let before: u64 = script_calls(&cluster).iter().sum();
    let admitted = hammer(&all, 120);
    let scripts = script_calls(&cluster).iter().sum::<u64>() - before;
    println!("120 calls: {admitted} admitted, {scripts} script calls (decisions and releases)");
    assert_eq!(admitted, 120);
    // Without slices an admission makes two script calls and its release a third (360); with
    // them, one each and the occasional slice.
    assert!(scripts < 300, "{scripts} script calls for 120 admissions");
    let m = daemons[0].get("/metrics").body;
    let m = m.as_str().unwrap_or_default();
    let way = |w: &str| {
        common::metric(
            m,
            &format!("admitd_store_global_decisions_total{{way=\"{w}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(way("slice") > way("shard"), "{m}");
    let first = 170 + hammer(&all, 900);
    assert!(first <= BURST, "{first} admitted past a bucket of {BURST}");
    assert!(
        first + 3 * STRANDED_PER_REPLICA >= BURST,
        "{first} admitted: more stranded than the slices can hold"
    );
    // What the replicas hold goes back as they stop: the bucket is admitted exactly, no call more.
    let total = first + finish(&cluster, daemons);
    assert_eq!(total, BURST, "every token of the bucket is admitted once");
}

#[test]
fn a_replica_killed_holding_a_slice_strands_no_more_than_its_slices() {
    let cluster = RedisCluster::start(3);
    let cfg = config(&cluster.url());
    let mut daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
    // The doomed replica takes slices and spends some of them.
    let doomed_admitted = hammer(&[&daemons[0]], 40);
    let mut doomed = daemons.remove(0);
    let _ = doomed.child.kill();
    let _ = doomed.child.wait();
    let others: Vec<&Daemon> = daemons.iter().collect();
    let mut total = doomed_admitted + hammer(&others, 400);
    assert!(total <= BURST, "{total} admitted past a bucket of {BURST}");
    total += finish(&cluster, daemons);
    println!("killed replica admitted {doomed_admitted}; the fleet {total} of {BURST}");
    assert!(total <= BURST, "{total} admitted past a bucket of {BURST}");
    assert!(
        total + STRANDED_PER_REPLICA >= BURST,
        "{total} admitted: the killed replica stranded more than its slices"
    );
}

#[test]
fn a_replica_that_stops_gives_its_slices_back() {
    let cluster = RedisCluster::start(3);
    let cfg = config(&cluster.url());
    let mut daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
    // The stopping replica takes slices and spends some of them, then stops (SIGTERM): what it did
    // not spend goes back to the bucket, and the others admit the bucket exactly.
    let stopped_admitted = hammer(&[&daemons[0]], 40);
    let mut stopped = daemons.remove(0);
    stopped.signal("TERM");
    let _ = stopped.child.wait();
    let others: Vec<&Daemon> = daemons.iter().collect();
    let mut total = stopped_admitted + hammer(&others, 400);
    assert!(total <= BURST, "{total} admitted past a bucket of {BURST}");
    total += finish(&cluster, daemons);
    println!("stopped replica admitted {stopped_admitted}; the fleet {total} of {BURST}");
    assert_eq!(total, BURST, "the stopped replicas' slices came back");
}

#[test]
fn the_buckets_shard_restarted_does_not_spend_slices_taken_before() {
    let mut cluster = RedisCluster::start(3);
    let cfg = config(&cluster.url());
    let daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
    let all: Vec<&Daemon> = daemons.iter().collect();
    let first = hammer(&all, 600);
    assert!(first <= BURST, "{first} admitted past a bucket of {BURST}");
    // The bucket's shard restarts without its data: the bucket is full again, and the slices taken
    // from the bucket before are not spent on top of it.
    let node = bucket_node(&cluster);
    cluster.node_mut(node).restart();
    cluster.wait_ok(Duration::from_secs(20));
    let mut second = 0;
    for _ in 0..3 {
        second += hammer(&all, 400);
        assert!(
            second <= BURST,
            "{second} admitted past the restarted bucket of {BURST}"
        );
        std::thread::sleep(Duration::from_millis(1_100));
    }
    println!("before the restart {first}, after it {second} of {BURST}");
    assert!(
        second + 3 * STRANDED_PER_REPLICA >= BURST,
        "after the restart {second}"
    );
}

/// A `shared = true` upstream's bucket of 300 (refilling one an hour) behind the tool `query`, and a
/// second shared upstream behind `mail`; no global bucket.
fn shared_config(urls: &str) -> String {
    format!(
        "[limits.subject]\nrate = \"100000/s\"\nburst = 100000\n\
         [limits.tenant]\nrate = \"100000/s\"\nburst = 100000\n\
         [upstreams.search]\nrate = \"1/h\"\nburst = {BURST}\nshared = true\n\
         [upstreams.mail]\nrate = \"1/h\"\nburst = {BURST}\nshared = true\n\
         [tools.query]\nupstream = \"search\"\n[tools.send]\nupstream = \"mail\"\n\
         [store]\nkind = \"redis\"\nurl = \"{urls}\"\ncluster = true\ntimeout = \"500ms\"\nslice = \"100ms\"\n"
    )
}

/// The cluster decisions of `d` spending cross-tenant buckets from slices (`slice`) and on their
/// shards (`shard`).
fn ways(d: &Daemon) -> (f64, f64) {
    let m = d.get("/metrics").body;
    let m = m.as_str().unwrap_or_default();
    let way = |w: &str| {
        common::metric(
            m,
            &format!("admitd_store_global_decisions_total{{way=\"{w}\"}}"),
        )
        .unwrap_or(0.0)
    };
    (way("slice"), way("shard"))
}

#[test]
fn three_replicas_spending_slices_never_admit_more_than_a_shared_upstreams_bucket() {
    let cluster = RedisCluster::start(3);
    let cfg = shared_config(&cluster.url());
    let daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
    let all: Vec<&Daemon> = daemons.iter().collect();
    assert_eq!(hammer_tool(&all, 50, "query"), 50);
    assert_eq!(hammer_tool(&all, 120, "query"), 120);
    let (slice, shard) = ways(&daemons[0]);
    assert!(slice > shard, "from slices {slice}, on the shard {shard}");
    let first = 170 + hammer_tool(&all, 900, "query");
    assert!(first <= BURST, "{first} admitted past a bucket of {BURST}");
    assert!(
        first + 3 * STRANDED_PER_REPLICA >= BURST,
        "{first} admitted: more stranded than the slices can hold"
    );
    let total = first + finish_with(daemons, &cfg, "query");
    println!(
        "shared upstream: {first} admitted by the fleet, {total} with what came back, of {BURST}"
    );
    assert_eq!(total, BURST, "every token of the bucket is admitted once");
}

/// One call of `tool` for `tenant` on `d`.
fn ask(d: &Daemon, tenant: &str, tool: &str) -> common::Answer {
    d.admit(json!({"tenant": tenant, "subject": "s", "tool": tool, "max_wait_ms": 0}))
}

#[test]
fn a_429_through_one_replica_stops_a_shared_upstream_on_another_within_a_slices_life() {
    let cluster = RedisCluster::start(3);
    let cfg = shared_config(&cluster.url()).replace(
        &format!("[upstreams.search]\nrate = \"1/h\"\nburst = {BURST}"),
        "[upstreams.search]\nrate = \"1/h\"\nburst = 5000",
    );
    let (a, b) = (Daemon::start(&cfg), Daemon::start(&cfg));
    // Both replicas spend slices of the upstream's bucket.
    for d in [&a, &b] {
        assert_eq!(hammer_tool(&[d], 60, "query"), 60);
        let (slice, _) = ways(d);
        assert!(slice > 0.0, "no call spent from a slice");
    }
    // B holds a slice: its calls are decided from it (one that finds it expired asks for the
    // next).
    let from_slice = (0..50).any(|_| {
        let (before, _) = ways(&b);
        let held = ask(&b, "acme", "query");
        assert_eq!(held.status, 200, "{}", held.body);
        b.release(held.body["lease_id"].as_str().unwrap());
        ways(&b).0 > before
    });
    assert!(from_slice, "B decided no call from its slice");
    // A's call meets a 429 with Retry-After: 5 s.
    let l = ask(&a, "acme", "query");
    assert_eq!(l.status, 200, "{}", l.body);
    let r = a.post(
        "/v1/release",
        json!({"lease_id": l.body["lease_id"], "outcome": "upstream_rate_limited", "retry_after": "5"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let reported = std::time::Instant::now();
    // A stops at once, whatever its slice held; every tenant is paused.
    for tenant in ["acme", "globex"] {
        let r = ask(&a, tenant, "query");
        assert_eq!(r.status, 429, "A, {tenant}: {}", r.body);
        assert_eq!(r.body["scope"], "upstream_penalty", "{}", r.body);
    }
    // B stops within its slice's life (250 ms) and a round trip: its calls are decided on the
    // upstream's shard, none from a slice, while the penalty runs.
    std::thread::sleep(Duration::from_millis(400).saturating_sub(reported.elapsed()));
    let (sliced, _) = ways(&b);
    for tenant in ["acme", "globex", "initech"] {
        let r = ask(&b, tenant, "query");
        assert_eq!(r.status, 429, "B, {tenant}: {}", r.body);
        assert_eq!(r.body["scope"], "upstream_penalty", "{}", r.body);
    }
    assert_eq!(
        ways(&b).0,
        sliced,
        "no call decided from a slice under the penalty"
    );
    // The other shared upstream is not paused, and still decided from B's slices.
    let (before, _) = ways(&b);
    assert_eq!(hammer_tool(&[&b], 30, "send"), 30);
    assert!(ways(&b).0 > before);
}

#[test]
fn a_throttled_shared_upstream_is_decided_on_its_shard_within_a_slices_life() {
    let cluster = RedisCluster::start(3);
    let cfg = shared_config(&cluster.url()).replace(
        &format!("[upstreams.search]\nrate = \"1/h\"\nburst = {BURST}"),
        "[upstreams.search]\nrate = \"1/h\"\nburst = 5000\nadaptive_k = 1\nadaptive_min_requests = 0",
    );
    let (a, b) = (Daemon::start(&cfg), Daemon::start(&cfg));
    // B spends slices (its releases count as accepts in the upstream's window).
    assert_eq!(hammer_tool(&[&b], 60, "query"), 60);
    assert!(ways(&b).0 > 0.0, "no call spent from a slice");
    // Through A, the upstream answers 503s (no penalty, each a rejection): its throttle now
    // refuses about half of the calls.
    for _ in 0..150 {
        let f = a.post(
            "/v1/feedback",
            json!({"tenant": "acme", "upstream": "search", "status": 503}),
        );
        assert_eq!(f.status, 202, "{}", f.body);
    }
    let reported = std::time::Instant::now();
    std::thread::sleep(Duration::from_millis(400).saturating_sub(reported.elapsed()));
    // Within a slice's life B's calls are all decided on the upstream's shard, where the throttle
    // refuses some of them.
    let (sliced, _) = ways(&b);
    let mut refused = 0;
    for i in 0..40 {
        let r = ask(&b, &format!("t{i}"), "query");
        match r.status {
            200 => {
                b.release(r.body["lease_id"].as_str().unwrap());
            }
            429 => {
                assert_eq!(r.body["scope"], "adaptive", "{}", r.body);
                refused += 1;
            }
            other => panic!("{other}: {}", r.body),
        }
    }
    assert_eq!(
        ways(&b).0,
        sliced,
        "no call decided from a slice while throttled"
    );
    assert!(refused > 0, "the throttle refused none of 40 calls");
}

/// The node of `cluster` that holds keys of the hash tag `tag`.
fn node_of(cluster: &RedisCluster, tag: &str) -> usize {
    let pattern = format!("*{{{tag}}}*");
    let holders: Vec<usize> = (0..cluster.nodes().len())
        .filter(|&i| {
            !cluster.nodes()[i]
                .cli(&["KEYS", &pattern])
                .trim()
                .is_empty()
        })
        .collect();
    assert_eq!(holders.len(), 1, "{tag} on nodes {holders:?}");
    holders[0]
}

#[test]
fn two_shared_upstreams_live_under_tags_of_their_own_and_spread_over_the_shards() {
    let cluster = RedisCluster::start(3);
    // Without slices: every call visits its upstream's shard, which shows where its work goes.
    let cfg = shared_config(&cluster.url()).replace("slice = \"100ms\"", "slice = \"0s\"");
    let d = Daemon::start(&cfg);
    // One tenant (`hooli`, in the third of the slots neither upstream's tag is in), one caller.
    let run = |tool: &str, n: usize| {
        for _ in 0..n {
            let a = ask(&d, "hooli", tool);
            assert_eq!(a.status, 200, "{}", a.body);
            d.release(a.body["lease_id"].as_str().unwrap());
        }
    };
    run("query", 5);
    run("send", 5);
    let (search, mail, tenant) = (
        node_of(&cluster, "u:search"),
        node_of(&cluster, "u:mail"),
        node_of(&cluster, "t:hooli"),
    );
    assert!(
        search != mail && mail != tenant && search != tenant,
        "search on {search}, mail on {mail}, the tenant on {tenant}"
    );
    for node in cluster.nodes() {
        // Only the (default) global bucket lives under `{x}`.
        let x = node.cli(&["KEYS", "*{x}*"]);
        assert!(
            x.lines()
                .all(|k| k.trim().is_empty() || k.trim() == "admitd:{x}:b:g"),
            "an upstream's key under {{x}}: {x}"
        );
    }
    // Each upstream's calls make their script calls on its own shard.
    for (tool, here, there) in [("query", search, mail), ("send", mail, search)] {
        let before = script_calls(&cluster);
        let started = std::time::Instant::now();
        run(tool, 40);
        std::thread::sleep(Duration::from_millis(300));
        let after = script_calls(&cluster);
        let grew: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        println!("40 calls of {tool}: script calls by node {grew:?}");
        // A decision each on the upstream's shard, and the releases' reports gathered: one call
        // per 100 ms at most (and the probe schedule's writes, when the answers move it). None on
        // the other's.
        let gathered = started.elapsed().as_millis() as u64 / 100 + 2;
        assert!(grew[here] >= 40, "{tool}: {grew:?}");
        assert!(
            grew[here] <= 40 + gathered,
            "{tool}: {grew:?}, at most {gathered} sends"
        );
        assert!(grew[there] < 5, "{tool}: {grew:?}");
    }
}

/// Every command each node has run so far (the script's inner commands and the script calls
/// themselves), leaving out what the test and the cluster's own upkeep send.
fn commands(cluster: &RedisCluster) -> Vec<u64> {
    const UPKEEP: [&str; 8] = [
        "info", "cluster", "ping", "keys", "config", "client", "command", "hello",
    ];
    cluster
        .nodes()
        .iter()
        .map(|n| {
            n.cli(&["INFO", "commandstats"])
                .lines()
                .filter_map(|l| {
                    let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                    if UPKEEP.iter().any(|u| name.starts_with(u)) {
                        return None;
                    }
                    rest.split(['=', ',']).nth(1)?.parse::<u64>().ok()
                })
                .sum()
        })
        .collect()
}

/// The hot-shard measurement of docs/BENCHMARKS.md: three replicas on a three-shard cluster, the
/// limits of benches/throughput.toml (nothing is shed), 1 000 tenants × 20 subjects, 64 callers at
/// once, admit only;
/// slices off and on, alternating. Prints the script calls per admission (every shard's), each
/// shard's commands per admission and their spread.
/// `cargo test --release --test slices -- --ignored --nocapture commands_per_shard`
#[test]
#[ignore = "a measurement, not a check"]
fn commands_per_shard() {
    measure_commands_per_shard("");
}

/// The same with every call's tool behind a `shared = true` upstream (its budget as generous as the
/// global bucket's): a decision then spends two cross-tenant buckets on two other shards (the
/// upstream's `{u:api}` and the global `{x}`), or neither, from slices. Admissions only (a
/// release's report of the upstream's answer reaches its shard gathered, a few calls a second).
/// `cargo test --release --test slices -- --ignored --nocapture commands_per_shard`
#[test]
#[ignore = "a measurement, not a check"]
fn commands_per_shard_with_a_shared_upstream() {
    measure_commands_per_shard(
        "[upstreams.api]\nrate = \"10000000/s\"\nburst = 10000000\nshared = true\n\
         [tools.search]\nupstream = \"api\"\n",
    );
}

fn measure_commands_per_shard(extra: &str) {
    const CALLS: u64 = 6_000;
    /// Callers at once, as the throughput workload's 64 connections.
    const CLIENTS: usize = 64;
    let limits = format!("{}{extra}", include_str!("../benches/throughput.toml"));
    let cluster = RedisCluster::start(3);
    for round in 0..4 {
        let slice = if round % 2 == 0 { "0s" } else { "100ms" };
        let cfg = format!(
            "{limits}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ncluster = true\ntimeout = \"500ms\"\nslice = \"{slice}\"\n",
            cluster.url()
        );
        let daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
        let before = commands(&cluster);
        let scripts_before: u64 = script_calls(&cluster).iter().sum();
        let admitted = AtomicU64::new(0);
        let next = AtomicU64::new(0);
        let other = std::sync::Mutex::new(Vec::<String>::new());
        let started = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..CLIENTS {
                let (admitted, next, daemons, other) = (&admitted, &next, &daemons, &other);
                s.spawn(move || loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= CALLS {
                        return;
                    }
                    let h = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                    let body = json!({"tenant": format!("t{}", h % 1000),
                        "subject": format!("s{}", (h / 1000) % 20), "tool": "search"});
                    let a = daemons[k as usize % 3].admit(body);
                    if a.status == 200 {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        let mut other = other.lock().unwrap();
                        if other.len() < 3 {
                            other.push(format!("{} {}", a.status, a.body));
                        }
                    }
                });
            }
        });
        let elapsed = started.elapsed();
        let admitted = admitted.into_inner() as f64;
        let scripts = (script_calls(&cluster).iter().sum::<u64>() - scripts_before) as f64;
        let per: Vec<f64> = commands(&cluster)
            .iter()
            .zip(&before)
            .map(|(a, b)| (a - b) as f64 / admitted)
            .collect();
        let mean = per.iter().sum::<f64>() / per.len() as f64;
        let spread = per
            .iter()
            .map(|p| (p - mean) / mean * 100.0)
            .fold(0.0f64, |m, d| m.max(d.abs()));
        println!(
            "slice = {slice:>5}: {admitted} admitted in {elapsed:.1?}; script calls per admission {:.3}; commands per admission by shard {:.2?}, total {:.2}, largest deviation from the mean {spread:.0}%",
            scripts / admitted,
            per,
            per.iter().sum::<f64>()
        );
        for o in other.into_inner().unwrap() {
            println!("  not admitted: {o}");
        }
    }
}

/// The node of `cluster` that serves the slot of the hash tag `tag` (whether it holds keys or not).
fn serving(cluster: &RedisCluster, tag: &str) -> usize {
    let key = format!("admitd:{{{tag}}}:none");
    let serving: Vec<usize> = (0..cluster.nodes().len())
        .filter(|&i| !cluster.nodes()[i].cli(&["EXISTS", &key]).contains("MOVED"))
        .collect();
    assert_eq!(serving.len(), 1, "{tag} served by {serving:?}");
    serving[0]
}

/// Holds `n` calls of `tool` for `tenant` on `d` (admitted, not released yet): their lease ids.
fn hold(d: &Daemon, tenant: &str, tool: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let a = ask(d, tenant, tool);
            assert_eq!(a.status, 200, "{}", a.body);
            a.body["lease_id"].as_str().unwrap().to_string()
        })
        .collect()
}

/// Releases `lease` on `d` with `outcome` (and the upstream's `status`, when given).
fn release_with(d: &Daemon, lease: &str, outcome: &str, status: Option<u16>) {
    let mut body = json!({"lease_id": lease, "outcome": outcome});
    if let Some(s) = status {
        body["upstream_status"] = json!(s);
    }
    let r = d.post("/v1/release", body);
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn releases_that_change_nothing_on_a_shared_upstreams_shard_make_no_call_there() {
    let cluster = RedisCluster::start(3);
    // `search`: shared, with no budget (no AIMD, nothing probed) and no adaptive throttle: only a
    // 429 changes anything on its shard (its penalty). Without slices, each decision checks the
    // penalty there.
    let cfg = format!(
        "[limits.subject]\nrate = \"100000/s\"\nburst = 100000\nconcurrency = 1000\n\
         [limits.tenant]\nrate = \"100000/s\"\nburst = 100000\nconcurrency = 1000\n\
         [upstreams.search]\nshared = true\nadaptive_k = 0\n\
         [tools.query]\nupstream = \"search\"\n\
         [store]\nkind = \"redis\"\nurl = \"{}\"\ncluster = true\ntimeout = \"500ms\"\nslice = \"0s\"\n",
        cluster.url()
    );
    let d = Daemon::start(&cfg);
    // `hooli`'s slots are on another node than `{u:search}`'s.
    let leases = hold(&d, "hooli", "query", 31);
    let (search, tenant) = (serving(&cluster, "u:search"), node_of(&cluster, "t:hooli"));
    assert_ne!(search, tenant);
    let before = script_calls(&cluster);
    for (i, lease) in leases[..30].iter().enumerate() {
        match i % 3 {
            0 => release_with(&d, lease, "ok", Some(200)),
            1 => release_with(&d, lease, "error", Some(500)),
            _ => release_with(&d, lease, "error", Some(503)),
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let grew: Vec<u64> = script_calls(&cluster)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    println!("30 releases: script calls by node {grew:?}");
    assert_eq!(grew[search], 0, "{grew:?}");
    assert!(grew[tenant] >= 30, "{grew:?}");
    // A 429 still goes at once: the penalty stops the upstream's next call.
    let before = script_calls(&cluster);
    let r = d.post(
        "/v1/release",
        json!({"lease_id": leases[30], "outcome": "upstream_rate_limited", "retry_after": "5"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(script_calls(&cluster)[search] > before[search]);
    let r = ask(&d, "globex", "query");
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.body["scope"], "upstream_penalty", "{}", r.body);
}

/// The AIMD multiplier of `{u:search}` as its shard holds it.
fn multiplier(cluster: &RedisCluster, node: usize) -> f64 {
    let m = cluster.nodes()[node].cli(&["HGET", "admitd:{u:search}:up", "m"]);
    m.trim().parse().unwrap_or(1.0)
}

#[test]
fn healthy_releases_of_a_shared_upstream_reach_its_shard_gathered_and_still_recover_its_rate() {
    let cluster = RedisCluster::start(3);
    // `search` has a budget (so AIMD, probing) and the default adaptive throttle.
    let cfg = shared_config(&cluster.url())
        .replace("burst = 100000\n", "burst = 100000\nconcurrency = 1000\n");
    let d = Daemon::start(&cfg);
    const N: usize = 120;
    let leases = hold(&d, "hooli", "query", N + 4);
    let (search, tenant) = (node_of(&cluster, "u:search"), node_of(&cluster, "t:hooli"));
    assert_ne!(search, tenant);
    std::thread::sleep(Duration::from_millis(300));
    let before = script_calls(&cluster);
    let started = std::time::Instant::now();
    for lease in &leases[..N] {
        release_with(&d, lease, "ok", Some(200));
    }
    std::thread::sleep(Duration::from_millis(300));
    let took = started.elapsed();
    let grew: Vec<u64> = script_calls(&cluster)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    println!("{N} healthy releases in {took:?}: script calls by node {grew:?}");
    // One operation per 100 ms on the upstream's shard (and a probe schedule's write when the
    // answers move it), not one per release.
    let sends = took.as_millis() as u64 / 100 + 2;
    assert!(grew[search] >= 1, "{grew:?}");
    assert!(
        grew[search] <= 2 * sends,
        "{grew:?}: more than {sends} sends"
    );
    assert!(grew[search] < N as u64 / 3, "{grew:?}");
    assert!(grew[tenant] >= N as u64, "{grew:?}");
    // The answers were counted: the adaptive window holds N requests and N accepts.
    let window: u64 = cluster.nodes()[search]
        .cli(&["HGETALL", "admitd:{u:search}:up"])
        .lines()
        .collect::<Vec<_>>()
        .chunks(2)
        .filter(|kv| kv.len() == 2 && kv[0].trim().starts_with("a:"))
        .map(|kv| kv[1].trim().parse::<u64>().unwrap())
        .sum();
    assert_eq!(window, N as u64);
    // A 429 cuts the rate at once (the release waits for it).
    let r = d.post(
        "/v1/release",
        json!({"lease_id": leases[N], "outcome": "upstream_rate_limited", "retry_after": "1"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let cut = multiplier(&cluster, search);
    assert!(cut < 0.9, "the multiplier after a 429: {cut}");
    // Three healthy answers then win 3 × aimd_recover (0.05) back, once their send arrives.
    for lease in &leases[N + 1..] {
        release_with(&d, lease, "ok", Some(200));
    }
    let expected = cut + 3.0 * 0.05;
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    let mut m = multiplier(&cluster, search);
    while (m - expected).abs() > 1e-9 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        m = multiplier(&cluster, search);
    }
    assert!(
        (m - expected).abs() < 1e-9,
        "the multiplier {m} after the cut to {cut} and three healthy answers"
    );
}

/// The requests and accepts `{u:search}`'s adaptive window holds on `node`.
fn window(cluster: &RedisCluster, node: usize) -> (u64, u64) {
    let all = cluster.nodes()[node].cli(&["HGETALL", "admitd:{u:search}:up"]);
    let lines: Vec<&str> = all.lines().map(str::trim).collect();
    let mut out = (0, 0);
    for kv in lines.chunks(2).filter(|kv| kv.len() == 2) {
        let n: u64 = kv[1].parse().unwrap_or(0);
        if kv[0].starts_with("r:") {
            out.0 += n;
        } else if kv[0].starts_with("a:") {
            out.1 += n;
        }
    }
    out
}

#[test]
fn answers_gathered_before_a_503_or_a_429_are_counted_with_it() {
    let cluster = RedisCluster::start(3);
    let cfg = shared_config(&cluster.url())
        .replace("burst = 100000\n", "burst = 100000\nconcurrency = 1000\n");
    let d = Daemon::start(&cfg);
    let leases = hold(&d, "hooli", "query", 12);
    let search = node_of(&cluster, "u:search");
    // Five healthy answers, then a 503: once the 503's release is answered, the window holds all
    // six (the five counted first, with it or just before).
    for lease in &leases[..5] {
        release_with(&d, lease, "ok", Some(200));
    }
    release_with(&d, &leases[5], "error", Some(503));
    assert_eq!(window(&cluster, search), (6, 5));
    // The same before a 429 of this probed upstream: the five go first, then the 429.
    for lease in &leases[6..11] {
        release_with(&d, lease, "ok", Some(200));
    }
    let r = d.post(
        "/v1/release",
        json!({"lease_id": leases[11], "outcome": "upstream_rate_limited", "retry_after": "1"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(window(&cluster, search), (12, 10));
    let m = multiplier(&cluster, search);
    assert!(m < 0.9, "the multiplier after the 429: {m}");
}
