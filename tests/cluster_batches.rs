//! Decisions batched per node on a three-shard Redis Cluster: each worker sends the operations it
//! queued for one node in one script call, whatever their tenants, as it does on one server. The
//! budgets of tenants on different shards and a concurrency cap still hold exactly under concurrent
//! load (which prints its script calls per operation), calls queued while the nodes are busy share
//! a few script calls; and a tenant's slot migrated to another
//! node under load (the batches find it gone, the map is read again, its operations wait out the
//! migration) spends the tenant's budget exactly once.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use common::redis::{RedisCluster, RedisServer};
use common::Daemon;
use serde_json::json;

fn config(urls: &str, limits: &str) -> String {
    format!(
        "{limits}[store]\nkind = \"redis\"\nurl = \"{urls}\"\ncluster = true\ntimeout = \"2s\"\n"
    )
}

/// Script calls (EVALSHA and EVAL) a node has run so far.
fn script_calls(node: &RedisServer) -> u64 {
    node.cli(&["INFO", "commandstats"])
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| l.split(['=', ',']).nth(1)?.parse::<u64>().ok())
        .sum()
}

/// The node that serves `key`'s slot (by `CLUSTER SLOTS` as each node's own port).
fn owner(cluster: &RedisCluster, key: &str) -> usize {
    let slot: u64 = cluster.nodes()[0]
        .cli(&["CLUSTER", "KEYSLOT", key])
        .parse()
        .unwrap();
    cluster
        .nodes()
        .iter()
        .position(|n| {
            // A node answers a key it serves itself, and MOVED for any other.
            let reply = n.cli(&["EXISTS", key]);
            !reply.contains("MOVED") && !reply.contains("ASK")
        })
        .unwrap_or_else(|| panic!("no node serves slot {slot}"))
}

#[test]
fn batched_decisions_hold_every_tenants_budget_and_a_cap_across_shards() {
    const TENANTS: usize = 12;
    const BURST: u64 = 40;
    const CAP: i64 = 3;
    let cluster = RedisCluster::start(3);
    let cfg = config(
        &cluster.url(),
        &format!(
            "[limits.tenant]\nrate = \"1/h\"\nburst = {BURST}\n\
             [limits.subject]\nrate = \"100000/s\"\nburst = 100000\nconcurrency = {CAP}\n"
        ),
    );
    let daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start(&cfg)).collect();
    // The tenants live on every shard.
    let shards: std::collections::HashSet<usize> = (0..TENANTS)
        .map(|t| owner(&cluster, &format!("admitd:{{t:t{t}}}:h")))
        .collect();
    assert_eq!(shards.len(), 3, "the tenants spread over the three shards");

    let before: u64 = cluster.nodes().iter().map(script_calls).sum();
    let admitted: Vec<AtomicU64> = (0..TENANTS).map(|_| AtomicU64::new(0)).collect();
    let live: Vec<AtomicI64> = (0..TENANTS).map(|_| AtomicI64::new(0)).collect();
    let most = AtomicI64::new(0);
    let operations = AtomicU64::new(0);
    let unavailable = AtomicU64::new(0);
    let next = AtomicU64::new(0);
    // Each tenant is asked three times its budget: every budget is spent whole.
    let calls = 3 * BURST * TENANTS as u64;
    std::thread::scope(|s| {
        for _ in 0..48 {
            let (admitted, live, most, operations, unavailable, next, daemons) = (
                &admitted,
                &live,
                &most,
                &operations,
                &unavailable,
                &next,
                &daemons,
            );
            s.spawn(move || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= calls {
                    return;
                }
                let t = (k % TENANTS as u64) as usize;
                let d = &daemons[k as usize % 3];
                let a = d.admit(json!({"tenant": format!("t{t}"), "subject": "s",
                    "tool": "search", "max_wait_ms": 0}));
                operations.fetch_add(1, Ordering::Relaxed);
                match a.status {
                    200 => {
                        admitted[t].fetch_add(1, Ordering::Relaxed);
                        let now = live[t].fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(5));
                        live[t].fetch_sub(1, Ordering::SeqCst);
                        let lease = a.body["lease_id"].as_str().unwrap().to_string();
                        let r = daemons[(k as usize + 1) % 3].release(&lease);
                        assert_eq!(r.status, 200, "{}", r.body);
                        operations.fetch_add(1, Ordering::Relaxed);
                    }
                    429 => {}
                    503 => {
                        unavailable.fetch_add(1, Ordering::Relaxed);
                    }
                    other => panic!("unexpected {other}: {}", a.body),
                }
            });
        }
    });
    let scripts = cluster.nodes().iter().map(script_calls).sum::<u64>() - before;
    let operations = operations.into_inner();
    let admitted: Vec<u64> = admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    let most = most.into_inner();
    let unavailable = unavailable.into_inner();
    let per = scripts as f64 / operations as f64;
    println!(
        "{operations} decisions and releases in {scripts} script calls ({per:.3} each); \
         admitted per tenant {admitted:?}; at most {most} in flight; {unavailable} unavailable"
    );
    assert_eq!(unavailable, 0, "the store answered every call");
    assert!(
        admitted.iter().all(|&a| a == BURST),
        "every tenant's budget of {BURST} admitted exactly once: {admitted:?}"
    );
    assert!(most <= CAP, "{most} leases of one subject live at once");

    // Every node stopped for 300 ms: the calls made meanwhile wait in the replica's lanes (one per
    // worker and node) and go in a few script calls per node once the nodes answer again, each
    // still decided on its own (every budget is spent: each is refused by its tenant's bucket).
    let callers: u64 = 96;
    let before: u64 = cluster.nodes().iter().map(script_calls).sum();
    let statuses = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for n in cluster.nodes() {
            n.pause();
        }
        for c in 0..callers {
            let (d, statuses) = (&daemons[0], &statuses);
            s.spawn(move || {
                let a = d.admit(
                    json!({"tenant": format!("t{}", c % TENANTS as u64), "subject": "s",
                    "tool": "search", "max_wait_ms": 0}),
                );
                statuses
                    .lock()
                    .unwrap()
                    .push((a.status, a.body["scope"].clone()));
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        for n in cluster.nodes() {
            n.resume();
        }
    });
    let made = cluster.nodes().iter().map(script_calls).sum::<u64>() - before;
    let statuses = statuses.into_inner().unwrap();
    println!("{callers} calls queued while the nodes were stopped: {made} script calls");
    assert!(
        statuses
            .iter()
            .all(|(st, scope)| *st == 429 && scope == "tenant"),
        "{statuses:?}"
    );
    assert!(
        made <= callers / 3,
        "{callers} calls queued together took {made} script calls"
    );
}

/// Moves `slot` from node `from` to node `to` as `redis-cli --cluster reshard` does: importing and
/// migrating, the keys `MIGRATE`d a few at a time with a pause between (so that calls meet the
/// slot half moved), then the slot given to `to` on every node.
fn migrate(cluster: &RedisCluster, slot: &str, from: usize, to: usize) {
    let nodes = cluster.nodes();
    let id = |i: usize| nodes[i].cli(&["CLUSTER", "MYID"]);
    let (from_id, to_id) = (id(from), id(to));
    assert_eq!(
        nodes[to].cli(&["CLUSTER", "SETSLOT", slot, "IMPORTING", &from_id]),
        "OK"
    );
    assert_eq!(
        nodes[from].cli(&["CLUSTER", "SETSLOT", slot, "MIGRATING", &to_id]),
        "OK"
    );
    let port = nodes[to].port().to_string();
    loop {
        let keys = nodes[from].cli(&["CLUSTER", "GETKEYSINSLOT", slot, "1"]);
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            break;
        }
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().copied());
        assert_eq!(nodes[from].cli(&args), "OK");
        std::thread::sleep(Duration::from_millis(30));
    }
    for i in std::iter::once(to)
        .chain(std::iter::once(from))
        .chain((0..nodes.len()).filter(|&i| i != to && i != from))
    {
        assert_eq!(
            nodes[i].cli(&["CLUSTER", "SETSLOT", slot, "NODE", &to_id]),
            "OK"
        );
    }
}

#[test]
fn a_tenants_slot_migrated_under_load_spends_its_budget_exactly_once() {
    const BURST: u64 = 150;
    let cluster = RedisCluster::start(3);
    let cfg = config(
        &cluster.url(),
        &format!(
            "[limits.tenant]\nrate = \"1/h\"\nburst = {BURST}\n\
             [limits.subject]\nrate = \"100000/s\"\nburst = 100000\n"
        ),
    );
    let daemons: Vec<Daemon> = (0..2).map(|_| Daemon::start(&cfg)).collect();
    let hash = "admitd:{t:mover}:h";
    let slot = cluster.nodes()[0].cli(&["CLUSTER", "KEYSLOT", hash]);
    let from = owner(&cluster, hash);
    let to = (from + 1) % 3;

    let admitted = AtomicU64::new(0);
    let unavailable = AtomicU64::new(0);
    let after = AtomicU64::new(0);
    let moved = std::sync::atomic::AtomicBool::new(false);
    let statuses = Mutex::new(HashMap::<u16, u64>::new());
    std::thread::scope(|s| {
        for w in 0..8usize {
            let (admitted, unavailable, after, moved, statuses, daemons) =
                (&admitted, &unavailable, &after, &moved, &statuses, &daemons);
            s.spawn(move || {
                for k in 0..60usize {
                    let a = daemons[(w + k) % 2].admit(json!({"tenant": "mover",
                        "subject": format!("s{}", k % 7), "tool": "search", "max_wait_ms": 0}));
                    *statuses.lock().unwrap().entry(a.status).or_default() += 1;
                    match a.status {
                        200 => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            if moved.load(Ordering::Acquire) {
                                after.fetch_add(1, Ordering::Relaxed);
                            }
                            let lease = a.body["lease_id"].as_str().unwrap().to_string();
                            let r = daemons[(w + k + 1) % 2].release(&lease);
                            assert!(matches!(r.status, 200 | 503), "{}", r.body);
                        }
                        429 => {}
                        503 => {
                            unavailable.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("unexpected {other}: {}", a.body),
                    }
                    std::thread::sleep(Duration::from_millis(3));
                }
            });
        }
        // A fifth of the budget spent, the slot moves while the calls go on.
        let start = std::time::Instant::now();
        while admitted.load(Ordering::Relaxed) < BURST / 5 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{} admitted in 30 s",
                admitted.load(Ordering::Relaxed)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        migrate(&cluster, &slot, from, to);
        moved.store(true, Ordering::Release);
    });
    let (admitted, unavailable, after) = (
        admitted.into_inner(),
        unavailable.into_inner(),
        after.into_inner(),
    );
    println!(
        "slot {slot} moved from node {from} to {to}: {admitted} admitted ({after} after the move), \
         {unavailable} unavailable; answers {:?}",
        statuses.into_inner().unwrap()
    );
    let keys = |i: usize| -> u64 {
        cluster.nodes()[i]
            .cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot])
            .parse()
            .unwrap()
    };
    assert_eq!(keys(from), 0, "the slot's keys left node {from}");
    assert!(keys(to) > 0, "the slot's keys are on node {to}");
    assert!(after > 0, "decisions went on on the slot's new node");
    // Never more than the budget; and every token spent: a call the store did not answer in time
    // (503) may have spent one.
    assert!(
        admitted <= BURST,
        "{admitted} admitted past a budget of {BURST}"
    );
    assert!(
        admitted + unavailable >= BURST,
        "{admitted} admitted and {unavailable} unavailable: tokens of a budget of {BURST} were lost"
    );
}
