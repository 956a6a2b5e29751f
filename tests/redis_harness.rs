//! The Redis harness the shared-store tests stand on (`tests/common/redis.rs`): a standalone server
//! that keeps its port across a restart and loses its data, a paused server that holds connections
//! without answering, and a three-node cluster that routes hash-tagged keys to one slot and takes a
//! restarted node back.
//!
//! It needs `redis-server` and `redis-cli` (Debian package `redis-server`; `scripts/test.sh` installs it).

mod common;

use std::time::Duration;

use common::redis::{RedisCluster, RedisServer};

#[test]
fn a_server_answers_and_restarts_on_the_same_port_without_its_data() {
    let mut r = RedisServer::start();
    let port = r.port();
    assert_eq!(r.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(r.cli(&["PING"]), "PONG");
    assert_eq!(r.cli(&["SET", "admitd:k", "v1"]), "OK");
    assert_eq!(r.cli(&["GET", "admitd:k"]), "v1");
    // No persistence: nothing is saved, on a timer or at shutdown.
    assert_eq!(r.cli(&["CONFIG", "GET", "save"]), "save");
    assert_eq!(r.cli(&["CONFIG", "GET", "appendonly"]), "appendonly\nno");

    r.stop();
    assert!(!r.answers(), "the server still answers after stop");
    assert!(
        r.try_cli(&["PING"]).is_err(),
        "redis-cli reached a stopped server"
    );

    r.restart();
    assert_eq!(r.port(), port);
    assert_eq!(r.cli(&["PING"]), "PONG");
    assert_eq!(
        r.cli(&["GET", "admitd:k"]),
        "",
        "the data survived a restart"
    );
    assert_eq!(r.cli(&["SET", "admitd:k", "v2"]), "OK");
    assert_eq!(r.cli(&["GET", "admitd:k"]), "v2");
}

#[test]
fn a_paused_server_accepts_but_does_not_answer_until_resumed() {
    let r = RedisServer::start();
    r.pause();
    assert!(!r.answers(), "a paused server answered PING");
    r.resume();
    assert!(
        common::eventually(Duration::from_secs(5), || r.answers()),
        "the server did not answer after resume"
    );
}

#[test]
fn a_server_with_a_password_is_reached_by_cli() {
    let r = RedisServer::start_with(&["--requirepass", "s3cret"]);
    assert_eq!(r.cli(&["SET", "k", "v"]), "OK");
    assert_eq!(r.cli(&["GET", "k"]), "v");
}

#[test]
fn a_cluster_covers_every_slot_and_keeps_a_hash_tag_on_one_node() {
    let mut c = RedisCluster::start(3);
    let seeds = c.seed_urls();
    assert_eq!(seeds.len(), 3);
    assert_eq!(c.url(), seeds.join(","));
    for (node, url) in c.nodes().iter().zip(&seeds) {
        assert_eq!(url, &node.url());
        let info = node.cli(&["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "{}: {info}", node.addr());
        assert!(
            info.contains("cluster_known_nodes:3"),
            "{}: {info}",
            node.addr()
        );
    }

    // Keys with one hash tag share a slot, so one script may touch them all.
    let slot = c.cli(&["CLUSTER", "KEYSLOT", "admitd:{acme}:bucket"]);
    assert_eq!(c.cli(&["CLUSTER", "KEYSLOT", "admitd:{acme}:quota"]), slot);
    assert_eq!(c.cli(&["SET", "admitd:{acme}:bucket", "5"]), "OK");
    assert_eq!(c.cli(&["SET", "admitd:{acme}:quota", "7"]), "OK");
    // A multi-key command succeeds only when every key is in one slot.
    assert_eq!(
        c.cli(&["MGET", "admitd:{acme}:bucket", "admitd:{acme}:quota"]),
        "5\n7"
    );
    // Read back through every node: -c follows the MOVED redirection to the slot's owner.
    for node in c.nodes() {
        assert_eq!(node.cli(&["-c", "GET", "admitd:{acme}:bucket"]), "5");
    }
    // Exactly one node owns the slot.
    let owners = c
        .nodes()
        .iter()
        .filter(|n| n.cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot]) == "2")
        .count();
    assert_eq!(owners, 1);

    // A node restarted on its port rejoins with its identity and slots (its nodes file is kept).
    let port = c.nodes()[0].port();
    c.node_mut(0).restart();
    assert_eq!(c.nodes()[0].port(), port);
    c.wait_ok(Duration::from_secs(30));
    let info = c.nodes()[0].cli(&["CLUSTER", "INFO"]);
    assert!(info.contains("cluster_known_nodes:3"), "{info}");
}
