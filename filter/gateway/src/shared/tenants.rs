//! `kvmesh.tenants`: each tenant's requests in the current second, Envoy-wide (the per-tenant
//! limit of issue 47, [`kvmesh_core::tenant`]), and its admitted requests decayed as tenant
//! usage is ([`kvmesh_core::fleet`]), which the stream owner reports to kvmesh-cp so that the
//! limit holds across gateways. One compare-and-swap per request of a configured limit; at
//! most `max_tenants` entries plus [`OTHER`]'s: a tenant past the bound takes the entry of
//! one idle since an earlier second, or counts as `other`.
//!
//! Format: entries of `len u8, id (len bytes), second u64, count u32, usage_at_ms u64, usage
//! f64 (bits)`, little-endian.

use kvmesh_core::fair::decayed;
use kvmesh_core::fleet::{clamp, Usage, MAX_SHIPPED};
use kvmesh_core::tenant::{Verdict, Window, OTHER};

use super::{u32_at, u64_at, SharedStore};

pub const KEY: &str = "kvmesh.tenants.v2";

struct Entry {
    id: String,
    window: Window,
    /// Admitted requests, decayed, as counted at `at_ms`.
    usage: f64,
    at_ms: u64,
}

impl Entry {
    fn new(id: &str, second: u64) -> Self {
        Self { id: id.to_string(), window: Window { second, count: 0 }, usage: 0.0, at_ms: 0 }
    }
}

fn decode(bytes: &[u8]) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(&len) = bytes.get(at) {
        let start = at + 1;
        let end = start + usize::from(len);
        let (Some(id), Some(second), Some(count), Some(at_ms), Some(bits)) = (
            bytes.get(start..end),
            u64_at(bytes, end),
            u32_at(bytes, end + 8),
            u64_at(bytes, end + 12),
            u64_at(bytes, end + 20),
        ) else {
            break;
        };
        let Ok(id) = std::str::from_utf8(id) else { break };
        let usage = clamp(f64::from_bits(bits));
        out.push(Entry { id: id.to_string(), window: Window { second, count }, usage, at_ms });
        at = end + 28;
    }
    out
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * 48);
    for e in entries {
        let id = e.id.as_bytes().get(..255).unwrap_or(e.id.as_bytes());
        out.push(u8::try_from(id.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(id);
        out.extend_from_slice(&e.window.second.to_le_bytes());
        out.extend_from_slice(&e.window.count.to_le_bytes());
        out.extend_from_slice(&e.at_ms.to_le_bytes());
        out.extend_from_slice(&e.usage.to_bits().to_le_bytes());
    }
    out
}

/// This Envoy's admitted requests per tenant, decayed to `now_ms` (at most [`MAX_SHIPPED`]
/// tenants); `None` while no request was counted.
pub fn usage(store: &dyn SharedStore, now_ms: u64) -> Option<Usage> {
    let entries = decode(&store.get(KEY).0?);
    let each = entries.iter().map(|e| (e.id.as_str(), decayed(e.usage, e.at_ms, now_ms)));
    Some(Usage::sanitized(each.collect::<Vec<_>>(), MAX_SHIPPED, now_ms))
}

/// Counts one request of `tenant` at `now_ms` under `limit` per second, `elsewhere` more
/// made in this second at other gateways (estimated); returns the verdict and whether it was
/// counted as [`OTHER`] (past the bound). `None`: shared data refused every write (the
/// request goes on, uncounted).
pub fn hit(
    store: &dyn SharedStore,
    tenant: &str,
    limit: u32,
    elsewhere: u32,
    max_tenants: usize,
    now_ms: u64,
) -> Option<(Verdict, bool)> {
    let mut result = None;
    let written = super::update(store, KEY, |value| {
        let mut entries = decode(value);
        let second = now_ms / 1000;
        let found = entries.iter().position(|e| e.id == tenant);
        let index = match found {
            Some(i) => Some(i),
            None if entries.iter().filter(|e| e.id != OTHER).count() < max_tenants => None,
            None => {
                // The bound: an idle tenant's entry is taken over, else `other`'s is used.
                match entries.iter().position(|e| e.id != OTHER && e.window.second < second) {
                    Some(i) => {
                        entries.remove(i);
                        None
                    }
                    None => Some(entries.iter().position(|e| e.id == OTHER).unwrap_or_else(|| {
                        entries.push(Entry::new(OTHER, second));
                        entries.len() - 1
                    })),
                }
            }
        };
        let index = index.unwrap_or_else(|| {
            entries.push(Entry::new(tenant, second));
            entries.len() - 1
        });
        let Some(entry) = entries.get_mut(index) else { return };
        let other = entry.id != tenant;
        let verdict = entry.window.hit_with(limit, elsewhere, now_ms);
        if verdict.allowed {
            entry.usage = clamp(decayed(entry.usage, entry.at_ms, now_ms) + 1.0);
            entry.at_ms = entry.at_ms.max(now_ms);
        }
        result = Some((verdict, other));
        *value = encode(&entries);
    });
    if written {
        result
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fake::FakeStore;

    #[test]
    fn each_tenant_has_its_own_window() {
        let store = FakeStore::default();
        assert!(hit(&store, "a", 2, 0, 8, 1_000).unwrap().0.allowed);
        assert!(hit(&store, "a", 2, 0, 8, 1_100).unwrap().0.allowed);
        let (v, other) = hit(&store, "a", 2, 0, 8, 1_200).unwrap();
        assert!(!v.allowed && !other);
        assert_eq!((v.remaining, v.reset_ms), (0, 800));
        assert!(hit(&store, "b", 2, 0, 8, 1_300).unwrap().0.allowed, "another tenant");
        assert!(hit(&store, "a", 2, 0, 8, 2_000).unwrap().0.allowed, "the next second");
    }

    #[test]
    fn past_the_bound_tenants_share_other_and_idle_entries_are_reused() {
        let store = FakeStore::default();
        for i in 0..3 {
            assert!(!hit(&store, &format!("t{i}"), 100, 0, 3, 1_000).unwrap().1);
        }
        for i in 3..1_000 {
            let (_, other) = hit(&store, &format!("t{i}"), 100_000, 0, 3, 1_500).unwrap();
            assert!(other, "t{i}");
        }
        let value = store.get(KEY).0.unwrap();
        assert!(value.len() <= 4 * (1 + 5 + 28), "bounded: {} bytes", value.len());
        assert!(!hit(&store, "new", 100, 0, 3, 2_000).unwrap().1, "an idle entry is taken over");
    }

    #[test]
    fn the_fleets_requests_count_and_admitted_ones_are_kept_decayed() {
        let store = FakeStore::default();
        assert_eq!(usage(&store, 0), None);
        assert!(hit(&store, "a", 3, 1, 8, 1_000).unwrap().0.allowed);
        assert!(hit(&store, "a", 3, 1, 8, 1_100).unwrap().0.allowed);
        let (v, _) = hit(&store, "a", 3, 1, 8, 1_200).unwrap();
        assert_eq!((v.allowed, v.remaining), (false, 0), "two here and one elsewhere");
        let u = usage(&store, 1_200).unwrap();
        assert!((u.get("a", 1_200) - 2.0).abs() < 0.03, "the refused one is not counted: {u:?}");
        let later = usage(&store, 1_200 + kvmesh_core::fair::HALF_LIFE_MS).unwrap();
        let halved = later.get("a", 1_200 + kvmesh_core::fair::HALF_LIFE_MS);
        assert!((halved - u.get("a", 1_200) / 2.0).abs() < 0.01, "halved: {halved}");
    }

    #[test]
    fn garbage_reads_as_an_empty_table() {
        let store = FakeStore::default();
        store.set(KEY, &[200, 1, 2, 3], None).unwrap();
        assert!(hit(&store, "a", 1, 0, 4, 0).unwrap().0.allowed);
    }
}
