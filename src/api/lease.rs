//! Lease ids: opaque to clients, but carrying the tenant so a release goes straight to the right actor
//! without a daemon-wide lease table (which would be one more shared structure on the hot path).
//!
//! Form: 16 hex digits of the lease number, then the tenant name in hex. A malformed id is simply an
//! unknown lease.

use compact_str::CompactString;
use smallvec::SmallVec;

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Appends the id of lease `lease` of `tenant` to `out`: the answer's body is written this way,
/// without a string of its own. Only hex digits, so nothing in it needs escaping in JSON.
pub fn encode_into(out: &mut Vec<u8>, tenant: &str, lease: u64) {
    let mut digits = [0u8; 16];
    for (i, d) in digits.iter_mut().enumerate() {
        *d = HEX[(lease >> (60 - 4 * i)) as usize & 0xf];
    }
    out.reserve(16 + 2 * tenant.len());
    out.extend_from_slice(&digits);
    for b in tenant.bytes() {
        out.extend_from_slice(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
    }
}

pub fn encode(tenant: &str, lease: u64) -> String {
    let mut id = Vec::new();
    encode_into(&mut id, tenant, lease);
    String::from_utf8(id).expect("hex digits are UTF-8")
}

/// The tenant and lease number of an id (the tenant inline when it is short: no allocation).
pub fn decode(id: &str) -> Option<(CompactString, u64)> {
    if id.len() < 18 || id.len() > 16 + 256 || id.len() % 2 != 0 || !id.is_ascii() {
        return None;
    }
    let lease = u64::from_str_radix(&id[..16], 16).ok()?;
    let bytes: Option<SmallVec<[u8; 128]>> = (16..id.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&id[i..i + 2], 16).ok())
        .collect();
    let tenant = CompactString::from_utf8(bytes?).ok()?;
    super::check_name(&tenant).ok()?;
    Some((tenant, lease))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for t in ["acme", "ünï", "a b/c"] {
            let id = encode(t, 0xdead_beef_1234);
            assert_eq!(decode(&id), Some((t.into(), 0xdead_beef_1234)));
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
            assert!(id.starts_with("0000deadbeef1234"), "{id}");
        }
    }

    #[test]
    fn garbage_is_unknown() {
        for id in [
            "",
            "xyz",
            "00000000000000000",
            "zzzzzzzzzzzzzzzz61",
            "000000000000000161ff",
            "0000000000000001",
        ] {
            assert_eq!(decode(id), None, "{id}");
        }
    }
}
