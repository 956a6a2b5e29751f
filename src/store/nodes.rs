//! Which node of a Redis Cluster serves which slot, so that each worker batches its operations per
//! node as it does on one server.
//!
//! The map comes from `CLUSTER SLOTS` (asked through the cluster client when the store connects, and
//! again whenever an operation finds its node no longer serving its slot, or cannot reach it). Each
//! worker keeps a lane per node ([`super::lane`]); one script call carries every operation the
//! worker queued for that node meanwhile, whatever their tenants (the script's `routed` batch, under
//! the flag `allow-cross-slot-keys`, declaring no key). Before an operation of such a batch runs,
//! the script looks up a key of its hash tag that admitd never writes ([`Keys::probe`]): on a node
//! that does not serve the slot now (moved, being migrated away or in, the cluster down) Redis
//! refuses that lookup, before the operation read or wrote anything, and the operation answers
//! "elsewhere"; once the lookup passes, every key of the slot stays on the node until the script
//! call ends. An operation sent elsewhere is sent again, alone in the map's new node's next batch,
//! after the map is read again; a slot that no node serves whole yet (a migration under way, where
//! Redis itself answers multi-key commands TRYAGAIN) is waited for within `[store] timeout`. So an
//! operation runs once, all or nothing, on the node that holds its keys, or not at all.
//!
//! [`Keys::probe`]: super::keys::Keys::probe

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;

use super::error::StoreError;
use super::keys::hash_tag;
use super::lane::{Queued, Reply};
use super::redis::RedisStore;

/// The slots of a Redis Cluster.
const SLOTS: usize = 16384;
/// No node serves the slot.
const NONE: u16 = u16::MAX;
/// The first pause before an operation whose slot is moving is tried again (doubling up to
/// [`MOST_PAUSE`], within `[store] timeout`).
const FIRST_PAUSE: Duration = Duration::from_millis(2);
const MOST_PAUSE: Duration = Duration::from_millis(50);

/// The slot Redis Cluster places `key` in: CRC16 (XMODEM) of its hash tag, modulo 16384.
pub fn slot(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in hash_tag(key).as_bytes() {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % SLOTS as u16
}

/// A node that serves slots: its address and the client its lanes connect with.
#[derive(Clone)]
pub(super) struct Node {
    pub(super) addr: Arc<str>,
    pub(super) client: redis::Client,
}

/// Which node serves each slot, as `CLUSTER SLOTS` answered.
pub(super) struct SlotMap {
    owner: Vec<u16>,
    nodes: Vec<Node>,
    /// Counts the maps read since the store started (one reader waits for another's reading).
    epoch: u64,
}

impl SlotMap {
    /// Reads a `CLUSTER SLOTS` answer: `[start, end, [host, port, ...], replicas...]` per range. A
    /// node's client is `base` (the first seed URL: its user, password, database and TLS) at the
    /// node's address; an empty host is the seed's own.
    pub(super) fn parse(
        v: &redis::Value,
        base: &redis::ConnectionInfo,
        epoch: u64,
    ) -> Result<SlotMap, String> {
        use redis::{ConnectionAddr, Value};
        let int = |v: &Value| match v {
            Value::Int(i) => Some(*i),
            _ => None,
        };
        let text = |v: &Value| match v {
            Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        };
        let Value::Array(ranges) = v else {
            return Err(format!("CLUSTER SLOTS answered {v:?}"));
        };
        let mut map = SlotMap {
            owner: vec![NONE; SLOTS],
            nodes: Vec::new(),
            epoch,
        };
        for r in ranges {
            let Value::Array(parts) = r else {
                return Err(format!("CLUSTER SLOTS range {r:?}"));
            };
            let (Some(start), Some(end), Some(Value::Array(master))) = (
                parts.first().and_then(int),
                parts.get(1).and_then(int),
                parts.get(2),
            ) else {
                return Err(format!("CLUSTER SLOTS range {r:?}"));
            };
            let (Some(host), Some(port)) =
                (master.first().and_then(text), master.get(1).and_then(int))
            else {
                return Err(format!("CLUSTER SLOTS master {master:?}"));
            };
            if !(0..SLOTS as i64).contains(&start) || !(start..SLOTS as i64).contains(&end) {
                return Err(format!("CLUSTER SLOTS range {start}-{end}"));
            }
            // `?`: the node's address is not known (yet); its slots stay unserved until it is.
            if host == "?" || !(1..=65535).contains(&port) {
                continue;
            }
            let port = port as u16;
            let addr = match base.addr() {
                ConnectionAddr::TcpTls {
                    host: seed,
                    insecure,
                    tls_params,
                    ..
                } => ConnectionAddr::TcpTls {
                    host: if host.is_empty() { seed.clone() } else { host },
                    port,
                    insecure: *insecure,
                    tls_params: tls_params.clone(),
                },
                ConnectionAddr::Tcp(seed, _) => {
                    ConnectionAddr::Tcp(if host.is_empty() { seed.clone() } else { host }, port)
                }
                ConnectionAddr::Unix(_) => return Err("a cluster seed is a unix socket".into()),
                _ => return Err("a cluster seed of an unknown kind".into()),
            };
            let name: Arc<str> = Arc::from(addr.to_string());
            let i = match map.nodes.iter().position(|n| n.addr == name) {
                Some(i) => i,
                None => {
                    let client = redis::Client::open(base.clone().set_addr(addr))
                        .map_err(|e| e.to_string())?;
                    map.nodes.push(Node { addr: name, client });
                    map.nodes.len() - 1
                }
            };
            for s in start..=end {
                map.owner[s as usize] = i as u16;
            }
        }
        Ok(map)
    }

    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The node that serves `slot`.
    pub(super) fn node(&self, slot: u16) -> Option<&Node> {
        match self.owner.get(slot as usize) {
            Some(&i) if i != NONE => self.nodes.get(i as usize),
            _ => None,
        }
    }
}

/// The store's map of a cluster, read again when an operation finds it wrong.
#[derive(Default)]
pub(super) struct Nodes {
    map: ArcSwapOption<SlotMap>,
    /// One reading at a time: who waited for another's reading does not read again.
    reading: tokio::sync::Mutex<()>,
    epochs: AtomicU64,
}

impl Nodes {
    pub(super) fn map(&self) -> Option<Arc<SlotMap>> {
        self.map.load_full()
    }

    fn epoch(&self) -> u64 {
        self.map.load().as_ref().map_or(0, |m| m.epoch)
    }
}

impl RedisStore {
    /// Reads the cluster's slot map (`CLUSTER SLOTS` through the cluster client), unless another
    /// reading finished since the map of `seen` was read.
    pub(super) async fn read_map(
        &self,
        cluster: &redis::cluster_async::ClusterConnection,
        seen: u64,
    ) -> Result<(), String> {
        let _one = self.nodes.reading.lock().await;
        if self.nodes.epoch() != seen {
            return Ok(());
        }
        let base = redis::IntoConnectionInfo::into_connection_info(
            self.cfg
                .urls()
                .first()
                .cloned()
                .unwrap_or_default()
                .as_str(),
        )
        .map_err(|e| e.to_string())?;
        let limit = Duration::from_secs(1).max(self.cfg.timeout);
        let answer = tokio::time::timeout(
            limit,
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<redis::Value>(&mut cluster.clone()),
        )
        .await
        .map_err(|_| "CLUSTER SLOTS timed out".to_string())?
        .map_err(|e| e.to_string())?;
        let epoch = self.nodes.epochs.fetch_add(1, Ordering::AcqRel) + 1;
        let map = SlotMap::parse(&answer, &base, epoch)?;
        self.nodes.map.store(Some(Arc::new(map)));
        Ok(())
    }

    /// One operation on a cluster: on the lane of this worker to the node that serves its slot,
    /// batched with the worker's other operations for that node, sent again where the map says
    /// after the script found the slot elsewhere (see the module's doc); all within `[store]
    /// timeout`.
    pub(super) async fn routed(
        self: &Arc<Self>,
        cluster: &redis::cluster_async::ClusterConnection,
        generation: u64,
        route: &str,
        op: &'static str,
        spec: Vec<u8>,
        data: Vec<u8>,
    ) -> Result<redis::Value, StoreError> {
        let deadline = tokio::time::Instant::now() + self.cfg.timeout;
        let slot = slot(route);
        let probe = self.keys.probe(route);
        if self::slot(&probe) != slot {
            return Err(StoreError::Script(format!(
                "no hash tag in the key {route:?}"
            )));
        }
        let (mut spec, mut data) = (spec, data);
        let mut pause = FIRST_PAUSE;
        let mut last: Option<Arc<str>> = None;
        loop {
            let map = self.nodes.map();
            let seen = map.as_ref().map_or(0, |m| m.epoch);
            let node = map.as_ref().and_then(|m| m.node(slot)).cloned();
            let Some(node) = node else {
                let _ = tokio::time::timeout_at(deadline, self.read_map(cluster, seen)).await;
                if self
                    .nodes
                    .map()
                    .and_then(|m| m.node(slot).cloned())
                    .is_some()
                {
                    continue;
                }
                return Err(StoreError::Connection(format!(
                    "no node of the cluster serves slot {slot}"
                )));
            };
            if last.as_ref() == Some(&node.addr) {
                // The map names the node that just sent it away: the slot is moving. Wait a little.
                if tokio::time::Instant::now() + pause >= deadline {
                    return Err(StoreError::Timeout);
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MOST_PAUSE);
            }
            let (answer, answered) = tokio::sync::oneshot::channel();
            let queued = Queued {
                route: probe.clone(),
                op,
                spec,
                data,
                answer,
            };
            if !self
                .lanes
                .enqueue(&node.client, generation, &node.addr, queued)
            {
                return Err(StoreError::Connection("the connection has ended".into()));
            }
            let reply = match tokio::time::timeout_at(deadline, answered).await {
                Err(_) => return Err(StoreError::Timeout),
                Ok(Err(_)) => {
                    return Err(StoreError::Connection(
                        "the connection ended with the call".into(),
                    ))
                }
                Ok(Ok(reply)) => reply,
            };
            match reply {
                Reply::Done(r) => return r,
                Reply::Elsewhere {
                    why,
                    spec: s,
                    data: d,
                } => {
                    tracing::debug!(store = "redis", node = %node.addr, slot, why = %why,
                        "an operation's slot is not on the node the map named; reading the map again");
                    (spec, data) = (s, d);
                    let _ = tokio::time::timeout_at(deadline, self.read_map(cluster, seen)).await;
                    last = Some(node.addr);
                }
                Reply::Unsent {
                    error,
                    spec: s,
                    data: d,
                } => {
                    // The node could not be reached: sent again only if the map now names another.
                    (spec, data) = (s, d);
                    let _ = tokio::time::timeout_at(deadline, self.read_map(cluster, seen)).await;
                    let now = self.nodes.map().and_then(|m| m.node(slot).cloned());
                    if now.is_none_or(|n| n.addr == node.addr) {
                        return Err(error);
                    }
                    last = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    #[test]
    fn slots_are_redis_clusters() {
        // CLUSTER KEYSLOT on Redis 7.0.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        assert_eq!(slot("a"), 15495);
        assert_eq!(slot("123456789"), 12739);
        // Only the hash tag counts.
        assert_eq!(slot("admitd:{foo}:h"), 12182);
        assert_eq!(slot("{}foo"), slot("{}foo"));
        assert_ne!(slot("{}foo"), slot("foo"));
    }

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn the_map_names_each_slots_node_with_the_seeds_credentials() {
        let base =
            redis::IntoConnectionInfo::into_connection_info("redis://u:pw@10.0.0.1:7000/").unwrap();
        let v = Value::Array(vec![
            range(0, 5460, "10.0.0.1", 7000),
            range(5461, 10922, "", 7001),
            range(10923, 16000, "10.0.0.3", 7002),
            range(16001, 16383, "10.0.0.1", 7000),
        ]);
        let map = SlotMap::parse(&v, &base, 1).unwrap();
        assert_eq!(&*map.node(0).unwrap().addr, "10.0.0.1:7000");
        assert_eq!(&*map.node(16383).unwrap().addr, "10.0.0.1:7000");
        // An empty host is the seed's.
        assert_eq!(&*map.node(5461).unwrap().addr, "10.0.0.1:7001");
        assert_eq!(&*map.node(16000).unwrap().addr, "10.0.0.3:7002");
        assert_eq!(map.nodes.len(), 3);
        let info = map.node(16000).unwrap().client.get_connection_info();
        assert_eq!(info.redis_settings().password(), Some("pw"));
        assert_eq!(info.redis_settings().username(), Some("u"));
    }

    #[test]
    fn slots_no_node_serves_are_unserved_and_a_bad_answer_is_an_error() {
        let base = redis::IntoConnectionInfo::into_connection_info("redis://h:1").unwrap();
        let v = Value::Array(vec![range(0, 99, "h", 1), range(100, 199, "?", 2)]);
        let map = SlotMap::parse(&v, &base, 1).unwrap();
        assert!(map.node(99).is_some());
        assert!(map.node(100).is_none());
        assert!(map.node(200).is_none());
        assert!(SlotMap::parse(&Value::Int(1), &base, 1).is_err());
        assert!(SlotMap::parse(&Value::Array(vec![range(5, 3, "h", 1)]), &base, 1).is_err());
        assert!(SlotMap::parse(&Value::Array(vec![range(0, 16384, "h", 1)]), &base, 1).is_err());
    }
}
