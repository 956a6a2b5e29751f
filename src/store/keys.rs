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
        cat(&[&self.prefix, ":{t:", tenant, "}"])
    }

    /// A key of `key`'s hash tag that admitd never writes (`PREFIX~{TAG}`: every key of the fleet
    /// starts `PREFIX:`). On a Redis Cluster the script looks it up before an operation of a node's
    /// batch, which Redis refuses on a node that does not serve the tag's slot now
    /// ([`super::nodes`]); a key that exists would pass on a node it was not yet migrated away from.
    pub fn probe(&self, key: &str) -> String {
        cat(&[&self.prefix, "~{", hash_tag(key), "}"])
    }

    /// The part every key of the hash tag `tag` starts with (routes an operation to its shard).
    pub fn tag_base(&self, tag: &str) -> String {
        cat(&[&self.prefix, ":{", tag, "}"])
    }

    /// The part every global bucket's key starts with.
    pub fn cross_base(&self) -> String {
        cat(&[&self.prefix, ":{x}"])
    }

    /// The part every key of the `shared = true` upstream `upstream` starts with: its bucket, its
    /// penalty and its state (AIMD multiplier, adaptive window, probe schedule) share this tag.
    pub fn upstream_base(&self, upstream: &str) -> String {
        cat(&[&self.prefix, ":{u:", upstream, "}"])
    }

    /// The tenant's hash: its own bucket layers (tenant, subjects, per-tenant upstreams), the counts
    /// of its concurrency scopes, its live leases and its tools' run times, as fields (see the
    /// script's header).
    pub fn hash(&self, tenant: &str) -> String {
        cat(&[&self.prefix, ":{t:", tenant, "}:h"])
    }

    /// The tenant's lease set: every live lease, scored by its end.
    pub fn leases(&self, tenant: &str) -> String {
        cat(&[&self.prefix, ":{t:", tenant, "}:ls"])
    }

    /// Where a bucket layer's state lives: a hash and the prefix of its fields in it (`None` for the
    /// tenant's hash, which holds the tenant's own layers; a hash of its own with no prefix for the
    /// others).
    pub fn layer(&self, tenant: &str, k: &StateKey) -> (Option<String>, String) {
        match k {
            StateKey::TenantBucket => (None, "t|".into()),
            StateKey::SubjectBucket(s) => (None, cat(&["s:", s, "|"])),
            StateKey::UpstreamBucket(u) => (None, cat(&["u:", u, "|"])),
            _ => (Some(self.key(tenant, k)), String::new()),
        }
    }

    /// The field of the tenant's hash that counts a concurrency scope's leases.
    pub fn slots_field(k: &StateKey) -> String {
        match k {
            StateKey::SubjectSlots(s) => cat(&["s:", s, "|n"]),
            _ => "t|n".into(),
        }
    }

    /// A key of `tenant` (or, for cross-tenant state, of the fleet). Written piece by piece: this
    /// runs several times per decision, and `format!` cost about twice as much.
    pub fn key(&self, tenant: &str, k: &StateKey) -> String {
        let p = self.prefix.as_str();
        let joined = |head: &[&str], rest: &[&str]| {
            let n = head.iter().chain(rest).map(|s| s.len()).sum();
            let mut s = String::with_capacity(n);
            for part in head.iter().chain(rest) {
                s.push_str(part);
            }
            s
        };
        let t = |rest: &[&str]| joined(&[p, ":{t:", tenant, "}"], rest);
        let x = |rest: &[&str]| joined(&[p, ":{x}"], rest);
        let u = |name: &str, rest: &str| joined(&[p, ":{u:", name, "}"], &[rest]);
        match k {
            StateKey::SubjectBucket(s) => t(&[":b:s:", s]),
            StateKey::SubjectToolBucket(s, tool) => t(&[
                ":b:st:",
                itoa::Buffer::new().format(s.len()),
                ":",
                s,
                ":",
                tool,
            ]),
            StateKey::TenantBucket => t(&[":b:t"]),
            StateKey::UpstreamBucket(u) => t(&[":b:u:", u]),
            StateKey::SharedUpstreamBucket(name) => u(name, ":b"),
            StateKey::GlobalBucket(None) => x(&[":b:g"]),
            StateKey::GlobalBucket(Some(plan)) => x(&[":b:g:", plan]),
            StateKey::SubjectSlots(s) => t(&[":c:s:", s]),
            StateKey::TenantSlots => t(&[":c:t"]),
            StateKey::SubjectQuota(s) => t(&[":q:s:", s]),
            StateKey::TenantQuota => t(&[":q:t"]),
            StateKey::Penalty(u, false) => t(&[":pen:", u]),
            StateKey::Penalty(name, true) => u(name, ":pen"),
            StateKey::UpstreamState(u, false) => t(&[":up:", u]),
            StateKey::UpstreamState(name, true) => u(name, ":up"),
            StateKey::Lease(id) => t(&[":l:", hex16(*id).as_str()]),
            StateKey::RunTimes => t(&[":rt"]),
            StateKey::SubjectIndex => t(&[":subjects"]),
            StateKey::LeaseExtra(id) => t(&[":lx:", hex16(*id).as_str()]),
            StateKey::Tasks => t(&[":tasks"]),
            StateKey::TaskCursor => t(&[":tcur"]),
            // A unit's name has no `:` ([a-z][a-z0-9_]*), so it ends where the caller's name starts.
            StateKey::SpendTenant(unit) => t(&[":sp:t:", unit]),
            StateKey::SpendSubject(s, unit) => t(&[":sp:s:", unit, ":", s]),
            StateKey::SpendRun(run, unit) => t(&[":sp:r:", unit, ":", run]),
        }
    }
}

/// The pieces joined, in one allocation of the right size.
pub fn cat(parts: &[&str]) -> String {
    let mut s = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        s.push_str(p);
    }
    s
}

/// A lease id as its keys and fields name it: 16 lowercase hex digits.
pub fn hex16(id: u64) -> Hex16 {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = DIGITS[((id >> (60 - 4 * i)) & 0xf) as usize];
    }
    Hex16(out)
}

/// 16 hex digits, on the stack.
#[derive(Clone, Copy)]
pub struct Hex16([u8; 16]);

impl Hex16 {
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
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
    fn keys_are_named_as_the_script_and_earlier_versions_name_them() {
        let k = Keys::new("admitd");
        let s: Arc<str> = Arc::from("bot");
        let cases = [
            (
                StateKey::SubjectBucket(s.clone()),
                "admitd:{t:acme}:b:s:bot",
            ),
            (
                StateKey::SubjectToolBucket(s.clone(), Arc::from("search")),
                "admitd:{t:acme}:b:st:3:bot:search",
            ),
            (StateKey::TenantBucket, "admitd:{t:acme}:b:t"),
            (StateKey::GlobalBucket(None), "admitd:{x}:b:g"),
            (
                StateKey::GlobalBucket(Some(Arc::from("free"))),
                "admitd:{x}:b:g:free",
            ),
            (
                StateKey::Penalty(Arc::from("crm"), true),
                "admitd:{u:crm}:pen",
            ),
            (
                StateKey::Penalty(Arc::from("crm"), false),
                "admitd:{t:acme}:pen:crm",
            ),
            (
                StateKey::LeaseExtra(0xab),
                "admitd:{t:acme}:lx:00000000000000ab",
            ),
            (StateKey::SubjectIndex, "admitd:{t:acme}:subjects"),
            (
                StateKey::SpendSubject(s.clone(), Arc::from("usd")),
                "admitd:{t:acme}:sp:s:usd:bot",
            ),
        ];
        for (key, name) in cases {
            assert_eq!(k.key("acme", &key), name);
        }
        assert_eq!(k.tenant_base("acme"), "admitd:{t:acme}");
        assert_eq!(k.hash("acme"), "admitd:{t:acme}:h");
        assert_eq!(k.leases("acme"), "admitd:{t:acme}:ls");
        assert_eq!(k.cross_base(), "admitd:{x}");
        assert_eq!(
            k.layer("acme", &StateKey::SubjectBucket(s)),
            (None, "s:bot|".into())
        );
        assert_eq!(
            Keys::slots_field(&StateKey::SubjectSlots(Arc::from("bot"))),
            "s:bot|n"
        );
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
        assert_eq!(hex16(u64::MAX).as_str(), format!("{:016x}", u64::MAX));
        assert_eq!(hex16(0x0123_4567_89ab_cdef).as_str(), "0123456789abcdef");
    }
}
