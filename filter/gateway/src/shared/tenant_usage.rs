//! `kvmesh.tenant_usage`: the tenants' token usage as the VMs of one Envoy agree on it (fair
//! shares across VMs and gateways, issue 47, [`kvmesh_core::fleet`]). Two tables:
//!
//! - this Envoy's: every VM adds the charges it made since its last tick (one CAS on a tick
//!   that has some); the stream owner reports it to kvmesh-cp;
//! - the rest of the fleet's: the usage kvmesh-cp shipped less what this Envoy reported
//!   itself, written by the stream owner when a snapshot carries it.
//!
//! A VM's fair pick reads both once per tick that admits a tenant's request. Each table holds
//! at most [`MAX_SHIPPED`] tenants plus `other`, and whatever it reads is sanitized.
//!
//! Format: per table `at_ms u64, count u16`, then entries of `len u8, id (len bytes), usage
//! f64 (bits)`, little-endian; this Envoy's table first.

use kvmesh_core::fleet::{Usage, MAX_SHIPPED};

use super::{u64_at, SharedStore};

pub const KEY: &str = "kvmesh.tenant_usage.v1";

/// Reads one table from `bytes` at `*at`, moving `*at` past it.
pub(super) fn decode_table(bytes: &[u8], at: &mut usize) -> Usage {
    let Some(at_ms) = u64_at(bytes, *at) else { return Usage::default() };
    let count = bytes.get(*at + 8..*at + 10).and_then(|b| <[u8; 2]>::try_from(b).ok()).map_or(0, u16::from_le_bytes);
    *at += 10;
    let mut entries: Vec<(&str, f64)> = Vec::new();
    for _ in 0..count {
        let Some(&len) = bytes.get(*at) else { break };
        let start = *at + 1;
        let end = start + usize::from(len);
        let (Some(id), Some(bits)) = (bytes.get(start..end), u64_at(bytes, end)) else { break };
        let Ok(id) = std::str::from_utf8(id) else { break };
        entries.push((id, f64::from_bits(bits)));
        *at = end + 8;
    }
    Usage::sanitized(entries, MAX_SHIPPED, at_ms)
}

pub(super) fn encode_table(out: &mut Vec<u8>, u: &Usage) {
    out.extend_from_slice(&u.at_ms.to_le_bytes());
    let entries = u.entries.iter().filter(|(id, _)| id.len() <= 255).take(usize::from(u16::MAX));
    let count = entries.clone().count();
    out.extend_from_slice(&u16::try_from(count).unwrap_or(u16::MAX).to_le_bytes());
    for (id, v) in entries {
        out.push(u8::try_from(id.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&v.to_bits().to_le_bytes());
    }
}

fn decode(bytes: &[u8]) -> (Usage, Usage) {
    let mut at = 0;
    let envoy = decode_table(bytes, &mut at);
    let rest = decode_table(bytes, &mut at);
    (envoy, rest)
}

fn encode(envoy: &Usage, rest: &Usage) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + 32 * (envoy.entries.len() + rest.entries.len()));
    encode_table(&mut out, envoy);
    encode_table(&mut out, rest);
    out
}

/// This Envoy's usage and the rest of the fleet's (empty tables while the key is absent);
/// `None` when no VM ever charged a tenant or received the fleet's usage.
pub fn read(store: &dyn SharedStore) -> Option<(Usage, Usage)> {
    store.get(KEY).0.map(|v| decode(&v))
}

/// Adds `charges` (a VM's since its last tick) to this Envoy's usage at `now_ms`, at most
/// `max` tenants; false when shared data refused every write.
pub fn add(store: &dyn SharedStore, charges: &Usage, max: usize, now_ms: u64) -> bool {
    super::update(store, KEY, |value| {
        let (envoy, rest) = decode(value);
        *value = encode(&envoy.plus(charges, max.min(MAX_SHIPPED), now_ms), &rest);
    })
}

/// The rest of the fleet's usage (kvmesh-cp's less this Envoy's own report), replacing the
/// last; false when shared data refused every write.
pub fn set_rest(store: &dyn SharedStore, rest: &Usage) -> bool {
    super::update(store, KEY, |value| {
        let (envoy, _) = decode(value);
        *value = encode(&envoy, rest);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    fn usage(entries: &[(&str, f64)], at_ms: u64) -> Usage {
        Usage::sanitized(entries.iter().copied(), 8, at_ms)
    }

    #[test]
    fn the_vms_charges_add_up_and_the_rest_of_the_fleet_stays_apart() {
        let store = FakeStore::default();
        assert_eq!(read(&store), None);
        assert!(add(&store, &usage(&[("a", 100.0)], 0), 8, 0), "one VM");
        assert!(add(&store, &usage(&[("a", 50.0), ("b", 5.0)], 0), 8, 0), "another");
        assert!(set_rest(&store, &usage(&[("a", 1_000.0)], 0)));
        let (envoy, rest) = read(&store).unwrap();
        assert_eq!((envoy.get("a", 0), envoy.get("b", 0), rest.get("a", 0)), (150.0, 5.0, 1_000.0));
        assert!(add(&store, &usage(&[("b", 1.0)], 0), 8, 0));
        assert_eq!(read(&store).unwrap().1.get("a", 0), 1_000.0, "adding keeps the rest");
    }

    #[test]
    fn garbage_reads_as_empty_and_values_stay_bounded() {
        let store = FakeStore::default();
        store.set(KEY, &[1, 2, 3], None).unwrap();
        assert_eq!(read(&store), Some((Usage::default(), Usage::default())));
        let mut bad = Vec::new();
        bad.extend_from_slice(&0u64.to_le_bytes());
        bad.extend_from_slice(&u16::MAX.to_le_bytes());
        for v in [f64::NAN, f64::INFINITY, -1.0] {
            bad.extend_from_slice(&[1, b'x']);
            bad.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        store.set(KEY, &bad, store.get(KEY).1).unwrap();
        let (envoy, _) = read(&store).unwrap();
        assert!(envoy.get("x", 0).is_finite() && envoy.get("x", 0) <= kvmesh_core::fleet::MAX_USAGE);
        let names: Vec<String> = (0..1_000).map(|i| format!("t{i}")).collect();
        for n in &names {
            assert!(add(&store, &usage(&[(n, 1.0)], 0), 4_096, 0));
        }
        assert!(read(&store).unwrap().0.entries.len() <= MAX_SHIPPED + 1);
    }
}
