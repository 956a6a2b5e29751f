//! Key names in the shared store.
//!
//! Every key of one tenant carries the tenant as a Redis Cluster hash tag (`{t:NAME}`), so one call's
//! script runs on the one shard that holds all of that tenant's state. State shared by every tenant
//! lives under tags of its own: the global buckets under `{x}`, and each `shared = true` upstream's
//! bucket, penalty and AIMD / adaptive / probe state under the upstream's own tag (`{u:NAME}`), so
//! that different shared upstreams spread over the shards of a cluster. In a cluster a call that
//! spends such state reaches its shard from this replica's slices or in a round trip of its own
//! (see [`super::redis::RedisStore::decide`]). Names are the tenant's, subject's, tool's and
//! upstream's as sent: they contain no control characters, and where two of them meet the first is
//! length-prefixed, so no two states share a key.

use crate::engine::StateKey;

/// Builds the keys of one fleet (one `key_prefix`).
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Keys {
            prefix: prefix.to_string(),
        }
    }

    /// The part every key of `tenant` starts with.
    pub fn tenant_base(&self, tenant: &str) -> String {
        format!("{}:{{t:{tenant}}}", self.prefix)
    }

    /// A key of `key`'s hash tag that admitd never writes (`PREFIX~{TAG}`: every key of the fleet
    /// starts `PREFIX:`). On a Redis Cluster the script looks it up before an operation of a node's
    /// batch, which Redis refuses on a node that does not serve the tag's slot now
    /// ([`super::nodes`]); a key that exists would pass on a node it was not yet migrated away from.
    pub fn probe(&self, key: &str) -> String {
        format!("{}~{{{}}}", self.prefix, hash_tag(key))
    }

    /// The part every key of the hash tag `tag` starts with (routes an operation to its shard).
    pub fn tag_base(&self, tag: &str) -> String {
        format!("{}:{{{tag}}}", self.prefix)
    }

    /// The part every global bucket's key starts with.
    pub fn cross_base(&self) -> String {
        format!("{}:{{x}}", self.prefix)
    }

    /// The part every key of the `shared = true` upstream `upstream` starts with: its bucket, its
    /// penalty and its state (AIMD multiplier, adaptive window, probe schedule) share this tag.
    pub fn upstream_base(&self, upstream: &str) -> String {
        format!("{}:{{u:{upstream}}}", self.prefix)
    }

    /// The tenant's hash: its own bucket layers (tenant, subjects, per-tenant upstreams), the counts
    /// of its concurrency scopes, its live leases and its tools' run times, as fields (see the
    /// script's header).
    pub fn hash(&self, tenant: &str) -> String {
        format!("{}:h", self.tenant_base(tenant))
    }

    /// The tenant's lease set: every live lease, scored by its end.
    pub fn leases(&self, tenant: &str) -> String {
        format!("{}:ls", self.tenant_base(tenant))
    }

    /// Where a bucket layer's state lives: a hash and the prefix of its fields in it (the tenant's
    /// hash for the tenant's own layers, a hash of its own with no prefix for the others).
    pub fn layer(&self, tenant: &str, k: &StateKey) -> (String, String) {
        match k {
            StateKey::TenantBucket => (self.hash(tenant), "t|".into()),
            StateKey::SubjectBucket(s) => (self.hash(tenant), format!("s:{s}|")),
            StateKey::UpstreamBucket(u) => (self.hash(tenant), format!("u:{u}|")),
            _ => (self.key(tenant, k), String::new()),
        }
    }

    /// The field of the tenant's hash that counts a concurrency scope's leases.
    pub fn slots_field(k: &StateKey) -> String {
        match k {
            StateKey::SubjectSlots(s) => format!("s:{s}|n"),
            _ => "t|n".into(),
        }
    }

    pub fn key(&self, tenant: &str, k: &StateKey) -> String {
        let t = || self.tenant_base(tenant);
        let x = || self.cross_base();
        let u = |name: &str| self.upstream_base(name);
        match k {
            StateKey::SubjectBucket(s) => format!("{}:b:s:{s}", t()),
            StateKey::SubjectToolBucket(s, tool) => {
                format!("{}:b:st:{}:{s}:{tool}", t(), s.len())
            }
            StateKey::TenantBucket => format!("{}:b:t", t()),
            StateKey::UpstreamBucket(u) => format!("{}:b:u:{u}", t()),
            StateKey::SharedUpstreamBucket(name) => format!("{}:b", u(name)),
            StateKey::GlobalBucket(None) => format!("{}:b:g", x()),
            StateKey::GlobalBucket(Some(plan)) => format!("{}:b:g:{plan}", x()),
            StateKey::SubjectSlots(s) => format!("{}:c:s:{s}", t()),
            StateKey::TenantSlots => format!("{}:c:t", t()),
            StateKey::SubjectQuota(s) => format!("{}:q:s:{s}", t()),
            StateKey::TenantQuota => format!("{}:q:t", t()),
            StateKey::Penalty(u, false) => format!("{}:pen:{u}", t()),
            StateKey::Penalty(name, true) => format!("{}:pen", u(name)),
            StateKey::UpstreamState(u, false) => format!("{}:up:{u}", t()),
            StateKey::UpstreamState(name, true) => format!("{}:up", u(name)),
            StateKey::Lease(id) => format!("{}:l:{id:016x}", t()),
            StateKey::RunTimes => format!("{}:rt", t()),
            StateKey::SubjectIndex => format!("{}:subjects", t()),
            StateKey::LeaseExtra(id) => format!("{}:lx:{id:016x}", t()),
            StateKey::Tasks => format!("{}:tasks", t()),
            StateKey::TaskCursor => format!("{}:tcur", t()),
            // A unit's name has no `:` ([a-z][a-z0-9_]*), so it ends where the caller's name starts.
            StateKey::SpendTenant(unit) => format!("{}:sp:t:{unit}", t()),
            StateKey::SpendSubject(s, unit) => format!("{}:sp:s:{unit}:{s}", t()),
            StateKey::SpendRun(run, unit) => format!("{}:sp:r:{unit}:{run}", t()),
        }
    }
}

/// The hash tag Redis Cluster places a key by: the part between the first `{` and the next `}`.
pub fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(len) = key[open + 1..].find('}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_key_of_a_tenant_shares_its_tag_and_cross_tenant_keys_share_theirs() {
        let k = Keys::new("admitd");
        let s: Arc<str> = Arc::from("bot");
        let u: Arc<str> = Arc::from("crm");
        let tenant_keys = [
            StateKey::SubjectBucket(s.clone()),
            StateKey::SubjectToolBucket(s.clone(), Arc::from("search")),
            StateKey::TenantBucket,
            StateKey::UpstreamBucket(u.clone()),
            StateKey::SubjectSlots(s.clone()),
            StateKey::TenantSlots,
            StateKey::SubjectQuota(s.clone()),
            StateKey::TenantQuota,
            StateKey::Penalty(u.clone(), false),
            StateKey::UpstreamState(u.clone(), false),
            StateKey::Lease(7),
            StateKey::RunTimes,
            StateKey::SubjectIndex,
            StateKey::LeaseExtra(7),
            StateKey::Tasks,
            StateKey::TaskCursor,
        ];
        for key in &tenant_keys {
            assert!(!key.cross_tenant(), "{key:?}");
            assert_eq!(hash_tag(&k.key("acme", key)), "t:acme", "{key:?}");
        }
        for key in [
            StateKey::GlobalBucket(None),
            StateKey::GlobalBucket(Some(Arc::from("free"))),
        ] {
            assert!(key.cross_tenant(), "{key:?}");
            assert_eq!(hash_tag(&k.key("acme", &key)), "x", "{key:?}");
        }
        // Each shared upstream's state under a tag of its own, whichever tenant's call names it.
        for name in ["crm", "search"] {
            let u: Arc<str> = Arc::from(name);
            for key in [
                StateKey::SharedUpstreamBucket(u.clone()),
                StateKey::Penalty(u.clone(), true),
                StateKey::UpstreamState(u.clone(), true),
            ] {
                assert!(key.cross_tenant(), "{key:?}");
                for tenant in ["acme", "globex"] {
                    assert_eq!(hash_tag(&k.key(tenant, &key)), format!("u:{name}"));
                }
            }
        }
        assert_eq!(
            k.key("acme", &StateKey::SharedUpstreamBucket(u.clone())),
            "admitd:{u:crm}:b"
        );
        assert_eq!(
            k.key("acme", &StateKey::Penalty(u.clone(), true)),
            "admitd:{u:crm}:pen"
        );
        assert_eq!(
            k.key("acme", &StateKey::UpstreamState(u, true)),
            "admitd:{u:crm}:up"
        );
    }

    #[test]
    fn a_probe_shares_its_keys_slot_and_is_no_key_of_the_fleet() {
        let k = Keys::new("admitd");
        for key in [
            k.tenant_base("acme"),
            k.hash("a}b"),
            k.key("acme", &StateKey::GlobalBucket(Some(Arc::from("route")))),
            format!("{}:route", k.cross_base()),
        ] {
            let probe = k.probe(&key);
            assert_eq!(hash_tag(&probe), hash_tag(&key), "{key}");
            assert!(!probe.starts_with("admitd:"), "{probe}");
        }
        assert_eq!(k.probe(&k.hash("acme")), "admitd~{t:acme}");
    }

    #[test]
    fn names_that_meet_cannot_make_the_same_key() {
        let k = Keys::new("p");
        let a = k.key(
            "t",
            &StateKey::SubjectToolBucket(Arc::from("a:b"), Arc::from("c")),
        );
        let b = k.key(
            "t",
            &StateKey::SubjectToolBucket(Arc::from("a"), Arc::from("b:c")),
        );
        assert_ne!(a, b);
        assert_eq!(
            k.key("t", &StateKey::Lease(255)),
            "p:{t:t}:l:00000000000000ff"
        );
    }
}
